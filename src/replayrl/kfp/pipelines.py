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

Pipeline parameters (the same for all): `config` (YAML text or a URI), `arm`, `lineage`,
`run_root`; empty strings keep the config's values. Pod settings are compile-time: they come
from the `kubernetes:` section of the config given to `replayrl compile --config`.
"""

# No `from __future__ import annotations`: KFP reads the pipelines' real annotations.
import json
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import yaml
from kfp import compiler, dsl

from replayrl import logs
from replayrl.config import KubernetesConfig, RunConfig, load_config
from replayrl.kfp import DEFAULT_IMAGE, DEFAULT_ITERATIONS
from replayrl.kfp.async_pipeline import async_default_config, async_segment_pipeline
from replayrl.kfp.components import (
    compact,
    compare,
    evaluate,
    evaluate_initial,
    generate,
    record_iteration,
    run_iterations,
    train,
)
from replayrl.kfp.tasks import exit_task, on_accelerators, on_cpu, open_task, pod_settings

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


class IterationOutputs(NamedTuple):
    next_iteration: int
    policy_version: int


def iteration_pipeline(*, image: str, k8s: KubernetesConfig):
    """One iteration as a sub-pipeline with outputs (next_iteration, policy_version)."""

    @dsl.pipeline(
        name="replayrl-iteration",
        description="generate -> compact -> train -> evaluate (when due) -> record",
    )
    def iteration(
        config: str, owner: str, iteration: int, policy_version: int, release: bool
    ) -> IterationOutputs:
        def gpu(task, gpus):
            return on_accelerators(task, k8s, image, gpus)

        gen = gpu(
            generate(
                config=config, owner=owner, iteration=iteration, policy_version=policy_version
            ),
            k8s.generate_gpus,
        )
        comp = on_cpu(
            compact(
                config=config, owner=owner, iteration=iteration, policy_version=policy_version
            ).after(gen),
            k8s,
            image,
            retry=True,
        )
        tr = gpu(
            train(
                config=config,
                owner=owner,
                iteration=iteration,
                policy_version=policy_version,
                buffer_version=comp.outputs["buffer_version"],
            ),
            k8s.train_gpus,
        )
        common = dict(
            config=config,
            owner=owner,
            generated=gen.outputs["result"],
            compacted=comp.outputs["result"],
            trained=tr.outputs["result"],
            release=release,
        )
        with dsl.If(tr.outputs["eval_due"] == True, name="evaluation-due"):  # noqa: E712
            ev = gpu(
                evaluate(config=config, owner=owner, policy_version=tr.outputs["policy_version"]),
                k8s.evaluate_gpus,
            )
            # The commit point is not retried: a retry after a committed swap would fail.
            with_eval = on_cpu(
                record_iteration(evaluated=ev.outputs["result"], **common), k8s, image, retry=False
            )
        with dsl.Else(name="no-evaluation"):
            without_eval = on_cpu(record_iteration(evaluated="", **common), k8s, image, retry=False)
        return IterationOutputs(
            next_iteration=dsl.OneOf(
                with_eval.outputs["next_iteration"], without_eval.outputs["next_iteration"]
            ),
            policy_version=dsl.OneOf(
                with_eval.outputs["policy_version"], without_eval.outputs["policy_version"]
            ),
        )

    return iteration


def _task_gpus(k8s: KubernetesConfig) -> int:
    """Accelerators of a task pod: it generates, trains and evaluates."""
    return max(k8s.generate_gpus, k8s.train_gpus, k8s.evaluate_gpus)


def _task(k8s: KubernetesConfig, image: str, **params):
    """One `run_iterations` pod. Retried: a retry rewinds to the task's last full checkpoint
    and redoes what follows it."""
    return on_accelerators(run_iterations(**params), k8s, image, _task_gpus(k8s))


def _chain(
    opened, *, after, iterations: int, k8s: KubernetesConfig, image: str, one, label: str = ""
):
    """`iterations` iterations after `opened` (and the task `after`), in the layout of
    `k8s`: tasks of `iterations_per_task`, or one sub-pipeline per iteration. Returns the
    last task."""
    cursor, version = opened.outputs["iteration"], opened.outputs["policy_version"]
    common = dict(config=opened.outputs["config"], owner=opened.outputs["owner"])
    if k8s.layout == "task":
        per_task = k8s.iterations_per_task
        tasks = -(-iterations // per_task)
        for i in range(tasks):
            count = min(per_task, iterations - i * per_task)
            task = _task(
                k8s, image, iteration=cursor, count=count, release=i == tasks - 1, **common
            ).set_display_name(f"{label}iterations +{i * per_task + 1}..+{i * per_task + count}")
            if i == 0:
                task.after(after)
            cursor = task.outputs["next_iteration"]
        return task
    for i in range(iterations):
        task = one(
            iteration=cursor, policy_version=version, release=i == iterations - 1, **common
        ).set_display_name(f"{label}iteration +{i + 1}")
        if i == 0:
            task.after(after)
        cursor, version = task.outputs["next_iteration"], task.outputs["policy_version"]
    return task


def initial_evaluation_pipeline(*, image: str, k8s: KubernetesConfig):
    """v0's evaluation on an accelerator when `due`, as a sub-pipeline: the condition is on
    one of its inputs because kfp.local (2.17.3) cannot resolve a condition on a named
    output of a sibling task (it skips the branch), while one on an input works there as on
    a cluster. No pod starts when the lineage already has it."""

    @dsl.pipeline(name="replayrl-initial-evaluation")
    def initial_evaluation(config: str, owner: str, due: bool):
        with dsl.If(due == True, name="initial-evaluation-due"):  # noqa: E712
            on_accelerators(
                evaluate_initial(config=config, owner=owner), k8s, image, k8s.evaluate_gpus
            ).set_display_name("evaluate v0")

    return initial_evaluation


def _evaluate_v0(initial_evaluation, opened, label: str = ""):
    return initial_evaluation(
        config=opened.outputs["config"],
        owner=opened.outputs["owner"],
        due=opened.outputs["evaluate_initial"],
    ).set_display_name(f"{label}initial evaluation")


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

    @dsl.pipeline(
        name="replay-loop",
        pipeline_root=k8s.pipeline_root,
        description=(
            f"replayrl: {iterations} RL iterations with experience replay (generate, compact, "
            "train, evaluate), continuing the lineage where it stands."
        ),
    )
    def replay_loop(
        config: str = default_config, arm: str = "", lineage: str = "", run_root: str = ""
    ):
        """Run iterations of one lineage.

        Args:
            config: Run config, one line: the JSON `replayrl config json FILE` prints, or the URI of a YAML file (s3://..., file://...). A multi-line YAML pasted into this one-line field is refused. Empty: the library defaults (the tiny CPU demo).
            arm: replay, replay-plain or on-policy. Empty: the config's arm.
            lineage: Name of the training run to create or continue. Empty: <task>-<arm>-s<seed>.
            run_root: Where lineages live, s3://bucket/prefix. Empty: the config's storage.run_root.
        """
        release = exit_task(
            k8s, image, config=config, run_root=run_root, arms=[arm], lineages=[lineage]
        )
        with dsl.ExitHandler(release, name="release-lineage-at-exit"):
            opened = open_task(
                k8s, image, iterations, config=config, arm=arm, lineage=lineage, run_root=run_root
            )
            v0 = _evaluate_v0(initial_evaluation, opened)
            _chain(opened, after=v0, iterations=iterations, k8s=k8s, image=image, one=one)

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
                _task(
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
                )

    @dsl.pipeline(
        name="replay-iteration",
        pipeline_root=k8s.pipeline_root,
        description=(
            "replayrl: the next RL iteration of a lineage, read from its state and committed "
            "with a compare-and-swap; schedule it as a recurring run (max concurrency 1)."
        ),
    )
    def replay_iteration(
        config: str = default_config, arm: str = "", lineage: str = "", run_root: str = ""
    ):
        """Run the next iteration of one lineage; nothing when it has reached `iterations`.

        Args:
            config: Run config, one line: the JSON `replayrl config json FILE` prints, or the URI of a YAML file (s3://..., file://...). A multi-line YAML pasted into this one-line field is refused. Empty: the library defaults (the tiny CPU demo).
            arm: replay, replay-plain or on-policy. Empty: the config's arm.
            lineage: Name of the training run to create or continue. Empty: <task>-<arm>-s<seed>.
            run_root: Where lineages live, s3://bucket/prefix. Empty: the config's storage.run_root.
        """
        release = exit_task(
            k8s, image, config=config, run_root=run_root, arms=[arm], lineages=[lineage]
        )
        with dsl.ExitHandler(release, name="release-lineage-at-exit"):
            opened = open_task(
                k8s, image, 0, config=config, arm=arm, lineage=lineage, run_root=run_root
            )
            v0 = _evaluate_v0(initial_evaluation, opened)
            unless_finished(
                config=opened.outputs["config"],
                owner=opened.outputs["owner"],
                iteration=opened.outputs["iteration"],
                policy_version=opened.outputs["policy_version"],
                remaining=opened.outputs["remaining"],
            ).set_display_name("iteration").after(v0)

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

    @dsl.pipeline(
        name="compare-arms",
        pipeline_root=k8s.pipeline_root,
        description=(
            f"replayrl: a replay and an on-policy lineage side by side ({iterations} iterations "
            "each), then pass@1 against generation compute, as a table and plot."
        ),
    )
    def compare_arms(
        config: str = default_config,
        run_root: str = "",
        replay_lineage: str = "",
        on_policy_lineage: str = "",
    ):
        """Train both arms of one config, then compare them.

        Args:
            config: Run config, one line: the JSON `replayrl config json FILE` prints, or the URI of a YAML file (s3://..., file://...). A multi-line YAML pasted into this one-line field is refused. Both arms and the comparison use its tracking.experiment. Empty: the library defaults (the tiny CPU demo).
            run_root: Where lineages live, s3://bucket/prefix. Empty: the config's storage.run_root.
            replay_lineage: Name of the replay lineage. Empty: <task>-replay-s<seed>.
            on_policy_lineage: Name of the on-policy lineage. Empty: <task>-on-policy-s<seed>.
        """
        arms = (("replay", replay_lineage), ("on-policy", on_policy_lineage))
        release = exit_task(
            k8s,
            image,
            config=config,
            run_root=run_root,
            arms=[arm for arm, _ in arms],
            lineages=[lineage for _, lineage in arms],
        )
        with dsl.ExitHandler(release, name="release-lineages-at-exit"):
            last, opened = [], {}
            for arm, lineage in arms:
                opened[arm], end = _arm_branch(
                    k8s,
                    image,
                    iterations,
                    one=one,
                    initial_evaluation=initial_evaluation,
                    config=config,
                    arm=arm,
                    lineage=lineage,
                    run_root=run_root,
                )
                last.append(end)
            # Each arm's resolved config names the lineage it opened: those two are compared.
            _compare_task(opened, last, k8s, image)

    return compare_arms


def _arm_branch(
    k8s: KubernetesConfig,
    image: str,
    iterations: int,
    *,
    one,
    initial_evaluation,
    config,
    arm: str,
    lineage,
    run_root,
):
    """One arm of `compare_arms`: open its lineage, evaluate v0 when due, then `iterations`
    iterations. Returns (the open task, the last task)."""
    opened = open_task(
        k8s, image, iterations, config=config, arm=arm, lineage=lineage, run_root=run_root
    ).set_display_name(f"open {arm}")
    v0 = _evaluate_v0(initial_evaluation, opened, label=f"{arm} ")
    last = _chain(
        opened, after=v0, iterations=iterations, k8s=k8s, image=image, one=one, label=f"{arm} "
    )
    return opened, last


def _compare_task(opened: dict, last, k8s: KubernetesConfig, image: str):
    """The comparison step after the arms' `last` tasks, of the two lineages the arms' open
    tasks (`opened`, by arm) resolved. Idempotent (one comparison run per KFP run id), so
    retried like the other steps."""
    comparison = compare(
        replay_config=opened["replay"].outputs["config"],
        on_policy_config=opened["on-policy"].outputs["config"],
        key=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
    )
    return on_cpu(comparison.after(*last), k8s, image, retry=True).set_display_name("compare arms")


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
    """Write replay_loop.yaml, replay_iteration.yaml, compare_arms.yaml (both arms with
    `iterations` each) and async_segment.yaml to `out_dir`. With `config_path`, its text is
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
    segment = async_segment_pipeline(
        workers=cfg.asynchronous.workers,
        trainers=cfg.asynchronous.trainers,
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
