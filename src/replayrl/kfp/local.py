"""The `kfp-local` engine: the Kubeflow pipelines run on this machine with `kfp.local`.

Each component runs in its own Python subprocess (`SubprocessRunner(use_venv=False)`:
kfp.local substitutes the `python3` of the component's command with this process's
`sys.executable`, so the subprocess uses the same environment, with replayrl and kfp
installed). Pod settings (GPUs, tolerations, secrets, volumes) do not apply here, and the
pipeline is built without the two that would reach the subprocesses' environment (see
`local_pods`); everything else is the pipeline a cluster runs: the same components, control
flow, lease and commit point.

Knows nothing about the steps; it builds a pipeline, runs it and reads the result back from
the lineage's state and MLflow, as the inline engine reports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path

from replayrl import storage
from replayrl.config import KubernetesConfig, RunConfig
from replayrl.engine.inline import IterationSummary, RunSummary
from replayrl.errors import ReplayRLError

log = logging.getLogger(__name__)


def outputs_dir_for(cfg: RunConfig) -> Path:
    """Where kfp.local keeps task outputs (metrics, reports): beside the lineage for a local
    run root, in a temporary folder for an S3 one."""
    root = storage.normalize_root(cfg.storage.run_root)
    if storage.is_s3(root):
        return Path(tempfile.mkdtemp(prefix="replayrl-kfp-local-"))
    return Path(root) / ".kfp-local" / cfg.lineage


def local_pods(k8s: KubernetesConfig) -> KubernetesConfig:
    """The pod settings as they apply on this machine. kfp.local passes a task's container
    environment to its subprocess, so the pipeline requests no GPUs (an accelerator step's
    `REPLAYRL_REQUIRE_GPU` would stop it where CUDA is missing; torch takes this machine's
    GPU when it has one either way) and no scratch volume (its `REPLAYRL_CACHE` path exists
    only in a pod)."""
    return dataclasses.replace(k8s, generate_gpus=0, train_gpus=0, evaluate_gpus=0, scratch_size="")


def refuse_async(cfg: RunConfig) -> None:
    """kfp.local cannot run an asynchronous lineage: its pipeline (`async_segment`) runs the
    generation workers, the trainer and the evaluator as parallel tasks, and kfp.local runs
    tasks one after another, so the trainer would wait forever for rows from workers that
    have not started."""
    if cfg.asynchronous.enabled:
        raise ReplayRLError(
            "kfp.local cannot run an asynchronous lineage (asynchronous.enabled: true): its "
            "pipeline, async_segment, runs the workers, the trainer and the evaluator as "
            "parallel tasks, and kfp.local runs tasks one after another. Run it with "
            "`replayrl run --engine async` on this machine, or run the async_segment pipeline "
            "(pipelines/compiled/async_segment.yaml) on a Kubeflow cluster."
        )


def run_kfp_local(
    cfg: RunConfig,
    *,
    pipeline: str = "loop",
    outputs_dir: Path | None = None,
    quiet: bool = False,
) -> RunSummary:
    """Run the lineage to `cfg.iterations` with `replay_loop` (pipeline="loop"), or its next
    iteration with `replay_iteration` (pipeline="iteration"), under kfp.local.

    `quiet` keeps kfp.local's per-task logs off the terminal (they are still in the task
    folders under `outputs_dir`); a failure raises ReplayRLError naming the failed task.
    An asynchronous config is refused (`refuse_async`).
    """
    refuse_async(cfg)
    from kfp import local

    from replayrl.kfp.pipelines import replay_iteration_pipeline, replay_loop_pipeline

    start = time.perf_counter()
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    state = storage.read_state(paths)
    resumed_from = 1 if state is None else state.next_iteration
    remaining = cfg.iterations - resumed_from + 1
    if pipeline == "loop":
        if remaining <= 0:
            raise ReplayRLError(
                f"Lineage '{cfg.lineage}' already ran its {cfg.iterations} iterations; raise "
                f"--iterations to extend it."
            )
        built = replay_loop_pipeline(iterations=remaining, k8s=local_pods(cfg.kubernetes))
    elif pipeline == "iteration":
        built = replay_iteration_pipeline(k8s=local_pods(cfg.kubernetes))
    else:
        raise ReplayRLError(f"Unknown pipeline '{pipeline}'; use 'loop' or 'iteration'.")
    outputs_dir = outputs_dir or outputs_dir_for(cfg)
    outputs_dir.mkdir(parents=True, exist_ok=True)
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(outputs_dir),
        raise_on_error=True,
    )
    sink = io.StringIO()
    quiet_output = contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext()
    with warnings.catch_warnings(), quiet_output:
        # kfp.local warns when an image name lacks "python"; the image is not used here.
        warnings.filterwarnings("ignore", message=".*non-Python base image.*")
        # Pod settings (GPUs, requests) are for the cluster; kfp.local says it ignores them.
        warnings.filterwarnings("ignore", message=".*no effect in the current local runner.*")
        # Its tasks (each under `sh -c`) exit when this process ends, however it ends.
        from replayrl.engine.children import EXIT_WITH_ENV

        previous = os.environ.get(EXIT_WITH_ENV)
        os.environ[EXIT_WITH_ENV] = str(os.getpid())
        try:
            built(config=cfg.to_yaml(), run_root_s3_uri=cfg.storage.run_root)
        except RuntimeError as e:
            detail = _last_error_line(sink.getvalue()) if quiet else ""
            raise ReplayRLError(
                f"The kfp-local pipeline failed: {e}{' ' + detail if detail else ''} "
                f"Task logs and outputs: {outputs_dir}."
            ) from None
        finally:
            if previous is None:
                os.environ.pop(EXIT_WITH_ENV, None)
            else:
                os.environ[EXIT_WITH_ENV] = previous
    return _summary(cfg, paths, resumed_from, time.perf_counter() - start)


def _last_error_line(logs: str) -> str:
    lines = [ln.strip() for ln in logs.splitlines() if "replayrl: error:" in ln]
    return lines[-1] if lines else ""


def _summary(cfg: RunConfig, paths, resumed_from: int, wall_seconds: float) -> RunSummary:
    from replayrl.engine.tracking import Tracker

    state = storage.read_state(paths)
    if state is None:
        raise ReplayRLError(f"The pipeline finished but {paths.state} does not exist.")
    tracker = Tracker(state.tracking_uri, cfg.tracking.experiment)

    def history(key: str) -> dict[int, float]:
        return {
            m.step: m.value for m in tracker.client.get_metric_history(state.mlflow_run_id, key)
        }

    pass1, tokens, seconds = (
        history("eval/pass1"),
        history("cumulative/generated_tokens"),
        history("cumulative/seconds"),
    )
    s = cfg.train.steps_per_iteration  # MLflow steps are gradient steps: iteration t's is t·S
    rows = [
        IterationSummary(step // s, pass1[step], tokens.get(step, 0.0), seconds.get(step, 0.0))
        for step in sorted(pass1)
        if resumed_from <= step // s < state.next_iteration
    ]
    return RunSummary(
        lineage=cfg.lineage,
        arm=cfg.arm,
        run_root=paths.root,
        mlflow_run_id=state.mlflow_run_id,
        tracking_uri=tracker.uri,
        initial_pass1=pass1.get(0),
        rows=rows,
        wall_seconds=wall_seconds,
        resumed_from=resumed_from,
    )
