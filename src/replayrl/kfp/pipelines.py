"""The pipelines: `replay_loop` (N iterations unrolled), `replay_iteration` (the next task's
worth, for recurring runs), `compare_arms` (a replay and an on-policy lineage in
parallel, then the comparison) and `async_segment` (one segment of an asynchronous lineage:
W generation workers, the trainer and the evaluator as parallel accelerator tasks; defined in
`replayrl.kfp.async_pipeline`), built from the components with the pod settings of a config
(`replayrl.kfp.tasks`), and compiled to the YAML users upload in the KFP UI.

Two layouts (`kubernetes.layout`):

- "task" (the default): one accelerator pod runs `kubernetes.iterations_per_task`
  iterations with long-lived workers (`run_iterations`), so pod start, imports, engine
  start and the checkpoint download are paid once per task; `replay_loop` is open ->
  ceil(N / iterations_per_task) tasks.
- "step": one sub-pipeline per iteration, one pod per step: generate -> compact -> train ->
  (evaluate, when due) -> record. Whether an iteration evaluates depends on the config (a
  runtime value), so the evaluation and its record sit in a `dsl.If` branch, the record
  without evaluation in the `dsl.Else` branch, and the branch that ran hands its outputs on
  through `dsl.OneOf`; no GPU pod starts for an evaluation that is not due.

Every pipeline opens its lineage on a CPU pod; when v0's evaluation is still to be logged
(a new lineage), a GPU task evaluates it before the first iteration. The whole pipeline sits
in a `dsl.ExitHandler` whose exit task (`release_lineage`, CPU) drops the run's lineage
leases whatever happened, so a failed or stopped run leaves its lineage free at once; a run
killed without its exit task leaves it busy for one lease TTL at most (`lease.heartbeat`).

KFP v2 has no loops over runtime values, so `replay_loop` chains copies; each starts from the
iteration and policy version the previous one committed. A KFP backend turns the compiled
spec into one Argo Workflow object, which must fit Argo's 1 MiB limit together with its
run-time status (etcd's limit is 1.5 MiB); `compile_pipelines` refuses a spec over
`MAX_SPEC_BYTES`.

Run parameters (`replayrl.kfp.tasks.PARAMETER_HELP`): `run_root_s3_uri` (required), `config`
(one line of JSON, or a URI), `arm`, `lineage`, `model_id`, `dataset_id`, and in `replay_loop`
and `compare_arms` `iterations` (1 to the compiled `--iterations`: the unrolled tasks past the
first sit in conditions on it); empty strings keep the config's values. Pod settings are
compile-time: they come from the `kubernetes:` section of the config given to `replayrl
compile --config`.
"""

# No `from __future__ import annotations`: KFP reads the pipelines' real annotations.
import json
import shutil
import tempfile
from pathlib import Path

import yaml
from kfp import compiler, dsl

from replayrl import logs
from replayrl.config import KubernetesConfig, RunConfig, load_config
from replayrl.kfp import DEFAULT_IMAGE, DEFAULT_ITERATIONS
from replayrl.kfp.async_pipeline import async_default_config, async_segment_pipeline
from replayrl.kfp.components import compare
from replayrl.kfp.iterations import (
    chain,
    evaluate_v0,
    initial_evaluation_pipeline,
    iteration_pipeline,
    iterations_task,
)
from replayrl.kfp.smoke import SMOKE_FILE, smoke_pipeline
from replayrl.kfp.tasks import documented, on_cpu, open_task, pod_settings, released_at_exit

LOOP_FILE = "replay_loop.yaml"
ITERATION_FILE = "replay_iteration.yaml"
COMPARE_FILE = "compare_arms.yaml"
ASYNC_FILE = "async_segment.yaml"


# The largest compiled pipeline `compile_pipelines` writes. A KFP 2.15-2.17 backend turns the
# spec into one Argo Workflow, and Argo fails a run whose Workflow with its status exceeds
# 1 MiB (node-status offload is off in a default install). Measured by
# tests/pipeline/test_kfp_spec_size.py, which estimates that Workflow (compact JSON) from the
# 2.15 argocompiler's structure (each distinct component and container once, each component's
# Kubernetes config, each task's driver and executor entries with its spec as JSON, the
# fixed templates) and its status at the run's end (a node per pod and DAG, each driver's
# pod-spec-patch): replay_loop grows by ~1.9 bytes of Workflow per byte of YAML (2.5-3x for a
# small pipeline, whose fixed templates weigh more), so a spec at this cap makes a Workflow
# of about 0.5 MiB, and one of 2.5x the cap would not fit.
MAX_SPEC_BYTES = 256 * 1024

# The `config` parameter's help, after its format.
CONFIG_DEFAULT = (
    "Its default: the config the pipeline was compiled with (the library defaults, the tiny "
    "CPU demo, without one)."
)


def replay_loop_pipeline(
    *,
    iterations: int,
    image: str = DEFAULT_IMAGE,
    k8s: KubernetesConfig | None = None,
    default_config: str = "",
):
    """`replay_loop`: open the lineage, then `iterations` iterations, one after the other."""
    if iterations < 1:
        from replayrl.errors import ReplayRLError

        raise ReplayRLError(f"replay_loop needs --iterations >= 1, got {iterations}.")
    k8s = pod_settings(k8s, image)
    one = iteration_pipeline(image=image, k8s=k8s)
    initial_evaluation = initial_evaluation_pipeline(image=image, k8s=k8s)

    most = iterations  # the compiled maximum; `iterations` below is the run's parameter

    def replay_loop(
        run_root_s3_uri: str,
        config: str = default_config,
        iterations: int = iterations,
        arm: str = "",
        lineage: str = "",
        model_id: str = "",
        dataset_id: str = "",
    ):
        overrides = dict(model_id=model_id, dataset_id=dataset_id)
        with released_at_exit(
            k8s,
            image,
            config=config,
            run_root=run_root_s3_uri,
            arms=[arm],
            lineages=[lineage],
            **overrides,
        ):
            opened = open_task(
                k8s,
                image,
                iterations,
                max_iterations=most,
                config=config,
                arm=arm,
                lineage=lineage,
                run_root=run_root_s3_uri,
                **overrides,
            )
            v0 = evaluate_v0(initial_evaluation, opened)
            chain(
                opened, after=v0, iterations=most, wanted=iterations, k8s=k8s, image=image, one=one
            )

    replay_loop.__doc__ = documented(
        "Run iterations of one lineage.",
        ["run_root_s3_uri", "config", "iterations", "arm", "lineage", "model_id", "dataset_id"],
        max_iterations=iterations,
        config_default=CONFIG_DEFAULT,
    )
    replay_loop = dsl.pipeline(
        name="replay-loop",
        pipeline_root=k8s.pipeline_root,
        description=(
            f"replayrl: up to {iterations} RL iterations with experience replay (generate, "
            "compact, train, evaluate), continuing the lineage where it stands."
        ),
    )(replay_loop)
    return replay_loop


def replay_iteration_pipeline(
    *, image: str = DEFAULT_IMAGE, k8s: KubernetesConfig | None = None, default_config: str = ""
):
    """`replay_iteration`: exactly one iteration, the one the lineage's state says is next."""
    k8s = pod_settings(k8s, image)
    one = iteration_pipeline(image=image, k8s=k8s)
    initial_evaluation = initial_evaluation_pipeline(image=image, k8s=k8s)

    # The condition sits in a sub-pipeline of its own, on one of its inputs: kfp.local
    # (2.17.3) cannot resolve a condition on a named output of a sibling task (it skips the
    # branch), while one on a pipeline input works there as on a cluster.
    @dsl.pipeline(name="replayrl-iteration-unless-finished")
    def unless_finished(
        config: str, owner: str, iteration: int, policy_version: int, remaining: int
    ):
        with dsl.If(remaining > 0, name="iterations-left"):
            if k8s.layout == "task":
                # One task's worth; run_iterations stops at `iterations` by itself.
                iterations_task(
                    k8s,
                    image,
                    config=config,
                    owner=owner,
                    iteration=iteration,
                    count=k8s.iterations_per_task,
                    release=True,
                ).set_display_name("iterations")
            else:
                one(
                    config=config,
                    owner=owner,
                    iteration=iteration,
                    policy_version=policy_version,
                    release=True,
                    wanted=1,
                    index=0,
                )

    def replay_iteration(
        run_root_s3_uri: str,
        config: str = default_config,
        arm: str = "",
        lineage: str = "",
        model_id: str = "",
        dataset_id: str = "",
    ):
        overrides = dict(model_id=model_id, dataset_id=dataset_id)
        with released_at_exit(
            k8s,
            image,
            config=config,
            run_root=run_root_s3_uri,
            arms=[arm],
            lineages=[lineage],
            **overrides,
        ):
            opened = open_task(
                k8s,
                image,
                0,
                config=config,
                arm=arm,
                lineage=lineage,
                run_root=run_root_s3_uri,
                **overrides,
            )
            v0 = evaluate_v0(initial_evaluation, opened)
            unless_finished(
                config=opened.outputs["config"],
                owner=opened.outputs["owner"],
                iteration=opened.outputs["iteration"],
                policy_version=opened.outputs["policy_version"],
                remaining=opened.outputs["remaining"],
            ).set_display_name("iteration").after(v0)

    replay_iteration.__doc__ = documented(
        "Run the next iteration of one lineage; nothing when it has reached `iterations`.",
        ["run_root_s3_uri", "config", "arm", "lineage", "model_id", "dataset_id"],
        config_default=CONFIG_DEFAULT,
    )
    replay_iteration = dsl.pipeline(
        name="replay-iteration",
        pipeline_root=k8s.pipeline_root,
        description=(
            "replayrl: the next RL iteration of a lineage, read from its state and committed "
            "with a compare-and-swap; schedule it as a recurring run (max concurrency 1)."
        ),
    )(replay_iteration)
    return replay_iteration


def compare_arms_pipeline(
    *,
    iterations: int,
    image: str = DEFAULT_IMAGE,
    k8s: KubernetesConfig | None = None,
    default_config: str = "",
):
    """`compare_arms`: a replay lineage and an on-policy lineage as two parallel branches
    (each opened, then `iterations` iterations), then the comparison step, whose table and
    plot show in the KFP UI and go to MLflow as a comparison run."""
    if iterations < 1:
        from replayrl.errors import ReplayRLError

        raise ReplayRLError(f"compare_arms needs --iterations >= 1, got {iterations}.")
    k8s = pod_settings(k8s, image)
    one = iteration_pipeline(image=image, k8s=k8s)
    initial_evaluation = initial_evaluation_pipeline(image=image, k8s=k8s)
    branches = {
        arm: _arm_pipeline(
            k8s, image, iterations, arm=arm, one=one, initial_evaluation=initial_evaluation
        )
        for arm in ("replay", "on-policy")
    }

    def compare_arms(
        run_root_s3_uri: str,
        config: str = default_config,
        iterations: int = iterations,
        replay_lineage: str = "",
        on_policy_lineage: str = "",
        model_id: str = "",
        dataset_id: str = "",
    ):
        overrides = dict(model_id=model_id, dataset_id=dataset_id)
        arms = (("replay", replay_lineage), ("on-policy", on_policy_lineage))
        with released_at_exit(
            k8s,
            image,
            config=config,
            run_root=run_root_s3_uri,
            arms=[arm for arm, _ in arms],
            lineages=[lineage for _, lineage in arms],
            **overrides,
        ):
            resolved = {
                arm: branches[arm](
                    config=config,
                    run_root=run_root_s3_uri,
                    lineage=lineage,
                    iterations=iterations,
                    **overrides,
                ).set_display_name(f"{arm} arm")
                for arm, lineage in arms
            }
            # Each arm's resolved config names the lineage it opened: those two are compared.
            _compareiterations_task(resolved, k8s, image)

    compare_arms.__doc__ = documented(
        "Train both arms of one config, then compare them.",
        [
            "run_root_s3_uri",
            "config",
            "iterations",
            "replay_lineage",
            "on_policy_lineage",
            "model_id",
            "dataset_id",
        ],
        max_iterations=iterations,
        config_default="Both arms and the comparison use its tracking.experiment. "
        + CONFIG_DEFAULT,
    )
    compare_arms = dsl.pipeline(
        name="compare-arms",
        pipeline_root=k8s.pipeline_root,
        description=(
            f"replayrl: a replay and an on-policy lineage side by side (up to {iterations} "
            "iterations each), then pass@1 against generation compute, as a table and plot."
        ),
    )(compare_arms)
    return compare_arms


def _arm_pipeline(
    k8s: KubernetesConfig, image: str, most: int, *, arm: str, one, initial_evaluation
):
    """One arm of `compare_arms` as a sub-pipeline whose output is the config it resolved:
    open its lineage, evaluate v0 when due, then `iterations` iterations (at most `most`).
    A sub-pipeline, so the comparison can wait for all of it: a task may not depend on one
    inside a condition (the iterations past the first) from outside it."""

    def branch(
        config: str,
        run_root: str,
        lineage: str,
        iterations: int,
        model_id: str,
        dataset_id: str,
    ) -> str:
        opened = open_task(
            k8s,
            image,
            iterations,
            max_iterations=most,
            config=config,
            arm=arm,
            lineage=lineage,
            run_root=run_root,
            model_id=model_id,
            dataset_id=dataset_id,
        ).set_display_name(f"open {arm}")
        v0 = evaluate_v0(initial_evaluation, opened, label=f"{arm} ")
        chain(
            opened,
            after=v0,
            iterations=most,
            wanted=iterations,
            k8s=k8s,
            image=image,
            one=one,
            label=f"{arm} ",
        )
        return opened.outputs["config"]

    return dsl.pipeline(name=f"replayrl-{arm}-arm")(branch)


def _compareiterations_task(resolved: dict, k8s: KubernetesConfig, image: str):
    """The comparison step after both arms (`resolved`, by arm: each arm's sub-pipeline task,
    whose output is the config it opened, naming its lineage). Idempotent (one comparison run
    per KFP run id), so retried like the other steps."""
    comparison = compare(
        replay_config=resolved["replay"].output,
        on_policy_config=resolved["on-policy"].output,
        key=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
    )
    return on_cpu(comparison, k8s, image, retry=True).set_display_name("compare arms")


def without_tracking_credentials(tree: dict) -> dict:
    """A config tree (parsed YAML) whose `tracking.uri` carries no user name or password."""
    tracking = tree.get("tracking") if isinstance(tree, dict) else None
    if isinstance(tracking, dict) and isinstance(tracking.get("uri"), str):
        return {**tree, "tracking": {**tracking, "uri": logs.without_credentials(tracking["uri"])}}
    return tree


def one_line_config(config_path: str | Path) -> str:
    """The config file as one line of JSON (which is YAML) that loads to the same config:
    what a pipeline's `config` parameter takes where a form field is one line (the KFP UI's
    run form drops line breaks, and a pasted preset becomes one `#` comment). Tracking
    credentials are left out: Kubeflow stores and shows run parameters."""
    load_config(config_path)  # refuse a config that does not load, before printing it
    tree = yaml.safe_load(Path(config_path).read_text()) or {}
    return json.dumps(without_tracking_credentials(tree), default=str)


def compile_pipelines(
    out_dir: str | Path,
    *,
    iterations: int = DEFAULT_ITERATIONS,
    image: str = DEFAULT_IMAGE,
    config_path: str | Path | None = None,
) -> list[Path]:
    """Write replay_loop.yaml, replay_iteration.yaml, compare_arms.yaml (both arms with up to
    `iterations` each), async_segment.yaml and replayrl_smoke.yaml (the namespace's
    self-test) to `out_dir`. With `config_path`, its text is
    the default `config` parameter (for async_segment with `asynchronous.enabled: true`), its
    `kubernetes:` section sets the pods, and its `asynchronous.workers` the worker tasks of
    async_segment (default 1)."""
    default_config = ""
    tree: dict = {}
    cfg = RunConfig()
    if config_path is not None:
        cfg = load_config(config_path)
        # One line of JSON: kfp 2.17.3 copies parameter defaults into the YAML's comment
        # header unescaped, and a multi-line default breaks the file. No tracking
        # credentials (pods take them from MLFLOW_TRACKING_USERNAME/PASSWORD or
        # MLFLOW_TRACKING_URI).
        default_config = one_line_config(config_path)
        tree = json.loads(default_config)
    k8s = cfg.kubernetes
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    loop = replay_loop_pipeline(
        iterations=iterations, image=image, k8s=k8s, default_config=default_config
    )
    one = replay_iteration_pipeline(image=image, k8s=k8s, default_config=default_config)
    arms = compare_arms_pipeline(
        iterations=iterations, image=image, k8s=k8s, default_config=default_config
    )
    smoke = smoke_pipeline(image=image, k8s=k8s, default_config=default_config)
    segment = async_segment_pipeline(
        workers=cfg.asynchronous.workers,
        trainers=cfg.asynchronous.trainers,
        trainer_nodes=cfg.asynchronous.trainer_nodes,
        image=image,
        k8s=k8s,
        default_config=async_default_config(tree),
    )
    written = []
    for pipeline, name in (
        (loop, LOOP_FILE),
        (one, ITERATION_FILE),
        (arms, COMPARE_FILE),
        (segment, ASYNC_FILE),
        (smoke, SMOKE_FILE),
    ):
        path = out / name
        with tempfile.TemporaryDirectory(prefix="replayrl-compile-") as tmp:
            draft = Path(tmp) / name
            compiler.Compiler().compile(pipeline, str(draft))
            check_spec_size(draft, name=name, iterations=iterations, k8s=k8s)
            if config_path is None:
                text = draft.read_text()
                path.write_text(TEMPLATE_NOTE.format(image=image) + text)
            else:
                shutil.copyfile(draft, path)
        written.append(path)
    return written


# The first lines of a pipeline compiled without a config (the committed pipelines/compiled/):
# uploaded as it is, it would train the tiny CPU demo, with the image named below.
TEMPLATE_NOTE = (
    "# TEMPLATE: compiled with the library defaults (the tiny CPU demo) and the image\n"
    "# {image}. For a cluster, compile your own:\n"
    "#   replayrl compile --config my-config.yaml --image registry/replayrl@sha256:... --out build/\n"
)


def check_spec_size(path: Path, *, name: str, iterations: int, k8s: KubernetesConfig) -> None:
    """Refuse a compiled pipeline a KFP backend could not run (see `MAX_SPEC_BYTES`)."""
    from replayrl.errors import ReplayRLError

    size = path.stat().st_size
    if size <= MAX_SPEC_BYTES:
        return
    if name == ASYNC_FILE:
        raise ReplayRLError(
            f"{name} would be {size // 1024} KiB, more than the {MAX_SPEC_BYTES // 1024} KiB a "
            f"KFP backend can run (its Argo Workflow must fit 1 MiB with the run's status): "
            f"compile it with fewer asynchronous.workers (one task each)."
        )
    if k8s.layout == "task":
        tasks = -(-iterations // k8s.iterations_per_task)
        fix = (
            f"raise kubernetes.iterations_per_task (now {k8s.iterations_per_task}, {tasks} tasks "
            f"per lineage) so fewer tasks are unrolled, or compile fewer --iterations"
        )
    else:
        fix = (
            "set kubernetes.layout: task (one pod runs kubernetes.iterations_per_task "
            "iterations), or compile fewer --iterations"
        )
    raise ReplayRLError(
        f"{name} for {iterations} iterations would be {size // 1024} KiB, more than the "
        f"{MAX_SPEC_BYTES // 1024} KiB a KFP backend can run (its Argo Workflow must fit 1 MiB "
        f"with the run's status): {fix}. A recurring replay_iteration run has no such limit."
    )
