"""Closing an iteration: its cost for the ledger (`iteration_cost`, with the inline engine's
clocks, `IterationClock`), what it logs at its step (`iteration_record_metrics`), its commit
(`record_iteration`), and the lineage's end (`finish_lineage`).

`record_iteration` advances `state.json` with a compare-and-swap (the commit point of an
iteration), carrying the iteration's metrics and, when the iteration wrote one, the new full
checkpoint; it then logs the metrics to MLflow in one batch with the timestamp stored in the
state. A run that loses the swap logs nothing; a run that dies after the swap has its metrics
logged when the lineage is next opened (`flush_metrics`), a repeated batch is dropped by MLflow
as a duplicate, and an iteration redone after a rewind is not logged again, so each
iteration's metrics appear exactly once. A full checkpoint the state points at is recorded as
a logged model of the lineage's run, once (`log_checkpoint_model`). The inline and Kubeflow
engines call these; the asynchronous trainer calls `log_checkpoint_model` and
`finish_lineage`.

Knows nothing about opening, resuming or rewinding a lineage (`replayrl.engine.lineage`, which
calls `flush_metrics` and `log_checkpoint_model` when it opens one), nor about which store the
lineage logs to: it is given the lineage's `Tracker`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from replayrl import storage
from replayrl.config import RunConfig
from replayrl.core.ledger import IterationCost, iteration_metrics
from replayrl.engine import metric_schema, models
from replayrl.engine.metric_schema import eval_metrics, finite
from replayrl.engine.record import after_checkpoint, checkpoint_record
from replayrl.engine.resources import TaskResources
from replayrl.engine.steps import CompactResult, GenerateResult, TrainResult
from replayrl.engine.tracking import Tracker, TrackingUnavailable
from replayrl.errors import ReplayRLError
from replayrl.policy.evaluation import EvalResult
from replayrl.storage import LineagePaths, LineageState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IterationClock:
    """How the inline engine measured an iteration's clocks, for its ledger. Without one (the
    per-step Kubeflow layout) the wall clock runs from the start of generate until the
    record, gaps between pods counting as wall time no part explains, and the CPU clock is
    the sum of the steps' parts (each ran in a process of its own).

    `wall_seconds` is the iteration's, with its share of the task's start-up and the previous
    commit given in `overheads` by ledger part name; `cpu_seconds` and `cpu_overheads` the
    same on the process-CPU clock (`replayrl.core.clock`); `startup_detail` the start-up
    split further (engine start, trainer load) for μ_effective."""

    wall_seconds: float
    overheads: dict[str, float]
    cpu_seconds: float
    cpu_overheads: dict[str, float]
    startup_detail: dict[str, float] = field(default_factory=dict)


def iteration_cost(
    *,
    gen: GenerateResult,
    comp: CompactResult,
    tr: TrainResult,
    ev: EvalResult | None,
    clock: IterationClock | None = None,
) -> IterationCost:
    """The ledger's view of one iteration, from its steps' results."""
    parts = {
        **(clock.overheads if clock else {}),
        "generation": gen.generation_seconds,
        "rewards": gen.scoring_seconds,
        "buffer_append": gen.append_seconds,
        "buffer_compact": comp.seconds,
        "buffer_sample": tr.sample_seconds,
        "training": tr.training_seconds,
        "usage_log": tr.usage_seconds,
        "checkpoint": tr.checkpoint_seconds,
        "evaluation": ev.seconds if ev is not None else 0.0,
    }
    cpu_parts = {
        **(clock.cpu_overheads if clock else {}),
        **gen.cpu_seconds,
        **comp.cpu_seconds,
        **tr.cpu_seconds,
        "evaluation": ev.cpu_seconds if ev is not None else 0.0,
    }
    if not (gen.cpu_seconds and tr.cpu_seconds):
        cpu_parts = {}  # results from before the CPU clock was read (a retried KFP step)
    device_parts = {
        **gen.device_seconds,
        **tr.device_seconds,
        **(
            {"evaluation": ev.device_seconds}
            if ev is not None and ev.device_seconds is not None
            else {}
        ),
    }
    return IterationCost(
        rollouts_generated=gen.rows,
        rollouts_trained=tr.rollouts_trained,
        prompt_tokens=gen.prompt_tokens,
        generated_tokens=gen.generated_tokens,
        trained_tokens=tr.trained_tokens,
        generation_seconds=gen.generation_seconds,
        training_seconds=tr.training_seconds,
        num_params=tr.num_params,
        parts=parts,
        wall_seconds=clock.wall_seconds if clock else time.time() - gen.started_at,
        startup_detail=clock.startup_detail if clock else {},
        cpu_parts=cpu_parts,
        cpu_seconds=clock.cpu_seconds if clock else sum(cpu_parts.values()),
        device_parts=device_parts,
    )


def iteration_record_metrics(
    *, gen: GenerateResult, comp: CompactResult, tr: TrainResult, ledger: dict[str, float]
) -> dict[str, float]:
    """Everything an iteration logs at its step but the evaluation (metric_schema names)."""
    return {
        "iteration": gen.iteration,
        **ledger,
        "rollout/mean_reward": gen.mean_reward,
        "rollout/frac_correct": gen.frac_correct,
        "rollout/frac_unparsed": gen.frac_unparsed,
        "rollout/frac_truncated": gen.frac_truncated,
        "rollout/mean_completion_tokens": gen.mean_completion_tokens,
        "buffer/rows": comp.rows,
        "buffer/files": comp.files,
        "buffer/bytes": comp.bytes,
        "buffer/rows_deleted": comp.rows_deleted,
        "buffer/version": comp.buffer_version,
        "buffer/bias_rows": comp.bias_rows,
        "buffer/bias_age_mean": comp.bias_age_mean,
        "buffer/bias_age_max": comp.bias_age_max,
        "replay/ratio": tr.rollouts_trained / max(gen.rows, 1),
        "replay/unique_rollouts": tr.unique_rollouts,
        # Ages and steps since last use in gradient steps (replayrl.core.staleness), built
        # by metric_schema.replay_metrics as the asynchronous engine's.
        "replay/sample_age_p50": tr.age_p50,
        "replay/sample_age_p95": tr.age_p95,
        "replay/sample_age_mean": tr.age_mean,
        "replay/sample_age_max": tr.age_max,
        "replay/steps_since_last_use_mean": tr.since_last_use_mean,
        "replay/steps_since_last_use_p50": tr.since_last_use_p50,
        "replay/frac_first_use": tr.frac_first_use,
        "train/loss": tr.loss,
        "train/clip_fraction": tr.clip_fraction,
        "train/mean_ratio": tr.mean_ratio,
        "train/grad_norm": tr.grad_norm,
        "train/sample_reward": tr.mean_sample_reward,
        "train/checkpoint_written": float(tr.checkpoint_written),
    }


def record_iteration(
    cfg: RunConfig,
    paths: LineagePaths,
    state: LineageState,
    tracker: Tracker,
    *,
    gen: GenerateResult,
    comp: CompactResult,
    tr: TrainResult,
    ev: EvalResult | None,
    clock: IterationClock | None = None,
    logged_steps: set[int] | None = None,
    extra_metrics: dict[str, float] | None = None,
    resources: TaskResources | None = None,
) -> tuple[LineageState, dict[str, float]]:
    """Log iteration `gen.iteration` once and advance the state (the commit point); after a
    full checkpoint, prune old checkpoints and vacuum the buffer. `clock`: see
    `IterationClock`; `extra_metrics`: more metric_schema names to log at the step."""
    t = gen.iteration
    cost = iteration_cost(gen=gen, comp=comp, tr=tr, ev=ev, clock=clock)
    ledger, totals = iteration_metrics(cost, state.ledger)
    metrics = iteration_record_metrics(gen=gen, comp=comp, tr=tr, ledger=ledger)
    metrics |= extra_metrics or {}
    if ev is not None:
        metrics.update(eval_metrics(ev.as_dict(), k=ev.k, prefix="eval/"))
    # MLflow's step is the gradient step the iteration ends on (metric_schema's convention).
    groups = [[t * cfg.train.steps_per_iteration, finite(metrics)]]
    if ev is not None:
        ktokens = int(round(totals["generated_tokens"] / 1000.0))
        by_ktokens = eval_metrics(ev.as_dict(), k=ev.k, prefix="eval_by_ktokens/")
        groups.append([ktokens, finite(by_ktokens)])
    checkpoint = state.checkpoint
    if tr.checkpoint_written:
        checkpoint = checkpoint_record(
            iteration=t,
            policy_version=tr.policy_version,
            ledger=totals,
            rollouts_version=comp.buffer_version,
            usage_version=tr.usage_version,
        )
    new_state = replace(
        state,
        next_iteration=t + 1,
        policy_version=tr.policy_version,
        ledger=totals,
        last_metrics={"iteration": t, "timestamp_ms": int(time.time() * 1000), "groups": groups},
        checkpoint=checkpoint,
    )
    storage.advance_state(paths, new_state, expected_next_iteration=t)
    flush_metrics(tracker, new_state, logged_steps=logged_steps)
    tracker.record_accelerator(new_state.mlflow_run_id, gen.accelerator, gen.accelerators)
    if tr.checkpoint_written:
        log_checkpoint_model(cfg, paths, tracker, new_state)
        after_checkpoint(cfg, paths, checkpoint=checkpoint, resources=resources)
    return new_state, metrics


def flush_metrics(tracker: Tracker, state: LineageState, *, logged_steps: set[int] | None = None):
    """Log the metrics of the state's last committed iteration unless the run has them (its
    "iteration" marker is at that iteration's step). Idempotent: they carry the timestamp
    stored in the state, and MLflow keeps one copy of a metric with the same key, step, time
    and value."""
    pending = state.last_metrics
    if not pending or not state.mlflow_run_id:
        return
    step = int(pending["groups"][0][0])
    already = (
        logged_steps if logged_steps is not None else tracker.logged_steps(state.mlflow_run_id)
    )
    if step in already:
        return
    tracker.log_groups(
        state.mlflow_run_id,
        pending["groups"],
        timestamp_ms=int(pending["timestamp_ms"]),
        engine=metric_schema.INLINE,
    )
    already.add(step)


def log_checkpoint_model(
    cfg: RunConfig, paths: LineagePaths, tracker: Tracker, state: LineageState
) -> None:
    """Record the state's full checkpoint as a logged model of the lineage's run
    (`replayrl.engine.models`), once: called after the commit that points at it and again
    when the lineage is opened. Its step is the gradient step it was written at: the
    iteration's last (inline and Kubeflow), the published version (asynchronous)."""
    ck = state.checkpoint
    if ck is None or not state.mlflow_run_id:
        return
    if cfg.asynchronous.enabled:
        step = int(ck["policy_version"])
    else:
        step = int(ck["iteration"]) * cfg.train.steps_per_iteration
    try:
        models.log_checkpoint_model(
            tracker,
            paths,
            run_id=state.mlflow_run_id,
            checkpoint=ck,
            step=step,
            copy=cfg.tracking.copy_models,
        )
    except TrackingUnavailable:
        raise  # the store, not the checkpoint: the run stops (a rerun logs the model)
    except ReplayRLError as e:
        # The model is a pointer for the MLflow UI: a checkpoint it cannot describe (gone,
        # damaged) is for the resume or the rewind to report, not for this record to fail.
        log.warning("checkpoint v%s is not recorded as a logged model: %s", ck["policy_version"], e)


def finish_lineage(
    cfg: RunConfig, paths: LineagePaths, tracker: Tracker, state: LineageState
) -> None:
    """The lineage reached its last iteration: register its last full checkpoint when
    `tracking.register_model_name` is set (`replayrl.engine.models.register`), then mark
    its MLflow run finished."""
    if cfg.tracking.register_model_name:
        models.register(
            tracker,
            paths,
            state,
            name=cfg.tracking.register_model_name,
            alias=cfg.tracking.register_alias or None,
        )
    tracker.set_terminated(state.mlflow_run_id)
