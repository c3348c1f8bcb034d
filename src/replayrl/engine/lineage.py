"""Opening a lineage, rewinding it to its last full checkpoint, and closing an iteration.

`open_lineage` creates (or resumes) a lineage: run root checked writable (on S3, also that
the store honours the conditional writes the commit relies on), config stored,
checkpoint v0 published, one MLflow run created with the flattened config as params (a
lineage's run is its run root's, lineage's and config's: lineages of one name in two run
roots never share one) and the warm-start evaluation logged at step 0
(`log_initial_evaluation`; the Kubeflow pipelines run it as a GPU task of its own, after opening on a CPU pod). `rewind` brings a resumed lineage back to its
last full checkpoint: the buffer's tables are restored to the versions recorded with it
(Delta restore) and `state.json` to its iteration, so the iterations after it are redone
and end where an uninterrupted run ends. `record_iteration` advances `state.json` with a
compare-and-swap (the commit point of an iteration), carrying the iteration's metrics and,
when the iteration wrote one, the new full checkpoint; it then logs the metrics to MLflow
in one batch with the timestamp stored in the state. A run that loses the swap logs
nothing; a run that dies after the swap has its metrics logged when the lineage is next
opened (`flush_metrics`), a repeated batch is dropped by MLflow as a duplicate, and an
iteration redone after a rewind is not logged again, so each iteration's metrics appear
exactly once. Both engines call these.

Credentials in the tracking URI (`http://user:password@host`) are used to connect and never
stored: config.yaml, the MLflow params, the config artifact and `state.json` hold the URI
without them (`public_config`), and a resumed lineage takes them again from its config or
$MLFLOW_TRACKING_URI (`stores.make_tracker`).

A resumed lineage's store is the one its state records, or the default store of the run root
given now when that root was moved or copied (`stores.lineage_store`), never one recreated
outside the run root; a store that lost the lineage's run gets a new run for it, logged with
what the lineage keeps (`_resume_tracking`, docs/mlflow-and-ledger.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from replayrl import logs, storage
from replayrl.config import RunConfig, config_from_dict
from replayrl.core.ledger import IterationCost, iteration_metrics
from replayrl.engine import metric_schema, models
from replayrl.engine.inputs import (
    initial_policy,
    pin_task_inputs,
    publish_hub_inputs,
    publish_initial_policy,
    replay_buffer,
    task_splits,
)
from replayrl.engine.metric_schema import eval_metrics, finite
from replayrl.engine.record import after_checkpoint, checkpoint_record
from replayrl.engine.resources import TaskResources
from replayrl.engine.steps import (
    CompactResult,
    GenerateResult,
    TrainResult,
    evaluate,
)
from replayrl.engine.stores import follow_moved_root, lineage_store, make_tracker, tracking_uri
from replayrl.engine.tracking import Tracker, TrackingUnavailable
from replayrl.errors import ReplayRLError
from replayrl.policy.evaluation import EvalResult
from replayrl.storage import LineagePaths, LineageState

log = logging.getLogger(__name__)


def open_lineage(
    cfg: RunConfig,
    *,
    resources: TaskResources | None = None,
    hold=None,
    evaluate_initial: bool = True,
) -> tuple[LineagePaths, LineageState, Tracker]:
    """Create the lineage, or resume it (rewound to its last full checkpoint).

    `hold()`, when given, takes the lineage's lease: it is called before an existing
    lineage is touched (a rewind must never pull a lineage from under another run) and, for
    a new one, after every input is checked and before its first byte is written (so bad
    input leaves nothing behind). Without it the caller holds the lease already.

    `evaluate_initial`: evaluate v0 and log it at step 0 when that is not logged yet. The
    Kubeflow pipelines pass False: opening runs on a CPU pod, and the evaluation is a GPU
    task of its own (`log_initial_evaluation`, when `initial_evaluation_due`)."""
    check_memory_fits(cfg)
    paths = storage.paths_of(cfg)
    storage.ensure_writable(storage.normalize_root(cfg.storage.run_root))
    storage.ensure_folder_or_absent(paths.root, what=f"Lineage '{cfg.lineage}'")
    state = storage.read_state(paths)
    if state is not None:
        # Task data rewritten under the lineage is refused before anything is touched.
        task_splits(cfg, resources)
    opened = _resume if state is not None else _create
    result = opened(
        cfg, paths, state, resources=resources, hold=hold, evaluate_initial=evaluate_initial
    )
    pin_task_inputs(cfg, resources)
    return result


def check_memory_fits(cfg: RunConfig) -> None:
    """On a machine with CUDA, refuse (with the plan's numbers) a config whose memory plan
    does not fit this machine's GPUs, before anything is read or downloaded; nothing on CPU
    or for a model whose shape the plan cannot know without a download."""
    from replayrl.policy import gpu, memory_plan

    seen = gpu.visible_gpu_memory()
    if seen is not None:
        memory_plan.check_fits(cfg, gpu_bytes=seen[1])


def _resume(
    cfg: RunConfig,
    paths: LineagePaths,
    state: LineageState,
    *,
    resources,
    hold,
    evaluate_initial: bool,
) -> tuple[LineagePaths, LineageState, Tracker]:
    """An existing lineage: the same config, its pending metrics logged, rewound."""
    # A changed config is refused before the lease is taken: it touches nothing, not even the
    # fencing epoch (the config hash of a lineage never changes, so the state read is enough).
    if state.config_hash != cfg.config_hash():
        stored = config_from_dict_safe(paths)
        diff = _diff(stored, cfg) if stored else "unknown"
        raise ReplayRLError(
            f"Lineage '{cfg.lineage}' at {paths.root} was started with a different config "
            f"(changed: {diff}). Resume it with its original config, or start a new --lineage."
        )
    if hold is not None:
        hold()
    tracker, state = _resume_tracking(cfg, paths, state)
    flush_metrics(tracker, state)
    log_checkpoint_model(cfg, paths, tracker, state)  # a crash after its commit
    if not cfg.asynchronous.enabled:
        # The asynchronous engine never rewinds the buffer: its workers' committed rows
        # stay, and its trainer resumes from the newest published weights.
        state = rewind(cfg, paths, state, resources=resources)
    if evaluate_initial and initial_evaluation_due(tracker, state.mlflow_run_id):
        # Opened by a pipeline whose evaluation task never ran (it failed, or the run
        # was stopped): log it now.
        log_initial_evaluation(cfg, paths, tracker, state.mlflow_run_id, resources=resources)
    return paths, state, tracker


def _resume_tracking(
    cfg: RunConfig, paths: LineagePaths, state: LineageState
) -> tuple[Tracker, LineageState]:
    """The tracker of a resumed lineage and its state, recording in state.json (at once, a
    compare-and-swap that changes nothing else) a store or run that changed:

    - the store is `stores.lineage_store`'s: the recorded one, or the default store of
      the run root given now when the root was moved or copied with it (whose paths then
      follow the root: `stores.follow_moved_root`); never one recreated outside the root;
    - a store that no longer holds the lineage's run (its `mlflow.db` deleted, a server's
      run garbage-collected) gets a new run for the lineage (`_replace_lost_run`);
    - a URI recorded with credentials (a state from before they were kept out) is recorded
      without them."""
    root = storage.normalize_root(cfg.storage.run_root)
    uri, moved_from = lineage_store(cfg, state.tracking_uri, state.mlflow_run_id)
    if moved_from is not None:
        follow_moved_root(uri, moved_from, root)
    tracker = make_tracker(cfg, uri)
    run_id = state.mlflow_run_id
    if run_id and not tracker.has_run(run_id):
        run_id = _replace_lost_run(cfg, paths, state, tracker)
    if (run_id, tracker.uri) == (state.mlflow_run_id, state.tracking_uri):
        return tracker, state
    new = replace(state, mlflow_run_id=run_id, tracking_uri=tracker.uri)
    try:
        storage.advance_state(paths, new, expected_next_iteration=state.next_iteration)
    except ReplayRLError:
        if run_id != state.mlflow_run_id:
            tracker.drop_run(run_id)  # the lineage moved on without this run
        raise
    return tracker, new


def _replace_lost_run(
    cfg: RunConfig, paths: LineagePaths, state: LineageState, tracker: Tracker
) -> str:
    """A new MLflow run for a lineage whose store lost its run, with what the lineage keeps:
    the identity tags (so a crash before state.json records it finds it again), the params
    and the config artifact; `_resume` then logs the last committed iteration (the metrics
    state.json carries), the state's full checkpoint as a logged model and v0's evaluation
    (v0 is always kept), as for any resumed lineage. The metrics of earlier iterations were
    only in the lost store: the run's `replayrl.history_from_iteration` tag says from which
    iteration on it holds the lineage's history, `replayrl.replaces_run` which run it
    replaces."""
    lost = state.mlflow_run_id
    pending = state.last_metrics
    first = int(pending["iteration"]) if pending else state.next_iteration
    public = public_config(cfg)
    run_id = tracker.start(
        run_root=storage.normalize_root(cfg.storage.run_root),
        lineage=cfg.lineage,
        config_hash=cfg.config_hash(),
        tags={
            "arm": cfg.arm,
            "seed": str(cfg.seed),
            "engine": "async" if cfg.asynchronous.enabled else "sync",
            "replayrl.replaces_run": str(lost),
            "replayrl.history_from_iteration": str(first),
        },
        params=public.flat() | _recorded_hub_params(paths),
    )
    tracker.log_text(run_id, public.to_yaml(), "config.yaml")
    lost_iterations = f"iterations 1-{first - 1}" if first > 2 else "iteration 1"
    log.warning(
        "MLflow run %s of lineage '%s' is not in the tracking store %s (deleted or replaced): "
        "the lineage now logs to a new run %s, with its config, v0's evaluation, its last "
        "committed iteration and its checkpoint%s.",
        lost,
        cfg.lineage,
        tracker.uri,
        run_id,
        f"; the metrics of {lost_iterations} were only in the lost store" if first > 1 else "",
    )
    return run_id


def _recorded_hub_params(paths: LineagePaths) -> dict[str, str]:
    """The hub revisions the lineage recorded when it was opened (`publish_hub_inputs`)."""
    from replayrl.policy import hub

    if not storage.exists(paths.hub_record):
        return {}
    return hub.params(json.loads(storage.read_bytes(paths.hub_record)))


def _create(
    cfg: RunConfig, paths: LineagePaths, _: None, *, resources, hold, evaluate_initial: bool
) -> tuple[LineagePaths, LineageState, Tracker]:
    """A new lineage: inputs checked, then config, hub inputs, v0, its MLflow run and
    `state.json` (put-if-absent: the commit point of opening)."""
    # Everything a user can get wrong (data, model path, tracking store) is checked before
    # the first byte of the lineage is written.
    task_splits(cfg, resources)
    local_v0 = initial_policy(cfg, resources)
    uri = tracking_uri(cfg)
    tracker = make_tracker(cfg, uri)
    if hold is not None:
        hold()
    public = public_config(cfg)
    storage.write_bytes_atomic(paths.config, public.to_yaml().encode())
    hub_params = publish_hub_inputs(cfg, paths)
    publish_initial_policy(cfg, paths, local_v0)
    # Found by run root, lineage and config hash, so a lineage named like one in another run
    # root on the same tracking server gets a run of its own; a resumed lineage never
    # searches (its state holds the run id).
    run_id = tracker.start(
        run_root=storage.normalize_root(cfg.storage.run_root),
        lineage=cfg.lineage,
        config_hash=cfg.config_hash(),
        tags={
            "arm": cfg.arm,
            "seed": str(cfg.seed),
            "engine": "async" if cfg.asynchronous.enabled else "sync",
        },
        params=public.flat() | hub_params | _template_params(cfg, local_v0),
    )
    tracker.log_text(run_id, public.to_yaml(), "config.yaml")
    if evaluate_initial and initial_evaluation_due(tracker, run_id):
        log_initial_evaluation(cfg, paths, tracker, run_id, resources=resources)
    state = LineageState(
        lineage=cfg.lineage,
        arm=cfg.arm,
        seed=cfg.seed,
        config_hash=cfg.config_hash(),
        next_iteration=1,
        policy_version=0,
        mlflow_run_id=run_id,
        tracking_uri=tracker.uri,
        ledger={},
        checkpoint=checkpoint_record(iteration=0, policy_version=0, ledger={}),
    )
    try:
        # Put-if-absent: this write makes `run_id` the lineage's run.
        storage.advance_state(paths, state, expected_next_iteration=None)
    except ReplayRLError:
        winner = storage.read_state(paths)
        if winner is not None and winner.mlflow_run_id != run_id:
            tracker.drop_run(run_id)  # another opener's run is the lineage's
        raise
    log_checkpoint_model(cfg, paths, tracker, state)  # v0
    return paths, state, tracker


@contextlib.contextmanager
def system_metrics_of(cfg: RunConfig, paths: LineagePaths, *, node_id: str) -> Iterator[None]:
    """System metrics of this process, as series `system/<node_id>/<metric>` of the lineage's
    MLflow run, while the block runs (`Tracker.system_metrics`): for a process that logs
    nothing else to the run (an asynchronous worker or evaluator, a Kubeflow step's pod).
    Nothing when the lineage has no run yet or `tracking.system_metrics` is off."""
    state = storage.read_state(paths) if cfg.tracking.system_metrics else None
    if state is None or not state.mlflow_run_id:
        yield
        return
    tracker = make_tracker(cfg, lineage_store(cfg, state.tracking_uri, state.mlflow_run_id)[0])
    with tracker.system_metrics(
        state.mlflow_run_id,
        enabled=True,
        interval_s=cfg.tracking.system_metrics_interval_s,
        node_id=node_id,
    ):
        yield


def _template_params(cfg: RunConfig, local_v0) -> dict[str, str]:
    """With chat prompts, the hash of v0's chat template as a run parameter: a template that
    changes between tokenizer versions shows in the params."""
    if cfg.task.prompt_format != "chat":
        return {}
    from transformers import AutoTokenizer

    from replayrl.policy.tokenizer import chat_template_hash

    digest = chat_template_hash(AutoTokenizer.from_pretrained(str(local_v0)))
    return {} if digest is None else {"task.chat_template_hash": digest}


def public_config(cfg: RunConfig) -> RunConfig:
    """`cfg` as it may be stored or logged: its tracking URI without credentials (the tracking
    section is not in the config hash, so the hash is the same)."""
    if not cfg.tracking.uri:
        return cfg
    return replace(
        cfg, tracking=replace(cfg.tracking, uri=logs.without_credentials(cfg.tracking.uri))
    )


def initial_evaluation_due(tracker: Tracker, run_id: str) -> bool:
    """Whether v0's evaluation (step 0 of the lineage's MLflow run) is still to be logged."""
    return 0 not in tracker.logged_steps(run_id)


def log_initial_evaluation(
    cfg: RunConfig,
    paths: LineagePaths,
    tracker: Tracker,
    run_id: str,
    *,
    resources: TaskResources | None = None,
) -> EvalResult:
    """Evaluate checkpoint v0 (the warm start, or the user's model) and log it at step 0, in
    one batch with its marker: a crash logs all of step 0 or none of it."""
    result = evaluate(cfg, paths, policy_version=0, resources=resources)
    d, k = result.as_dict(), result.k
    tracker.log_groups(
        run_id,
        [
            [0, {"iteration": 0, **eval_metrics(d, k=k, prefix="eval/")}],
            [0, eval_metrics(d, k=k, prefix="eval_by_ktokens/")],
        ],
        timestamp_ms=int(time.time() * 1000),
        engine=metric_schema.INLINE,
    )
    return result


def rewind(
    cfg: RunConfig,
    paths: LineagePaths,
    state: LineageState,
    *,
    resources: TaskResources | None = None,
) -> LineageState:
    """Bring the lineage back to its last full checkpoint, when anything happened after it.

    The buffer's tables are restored to the versions the checkpoint recorded (rows of
    uncommitted or uncheckpointed iterations go; rows retention deleted come back), then
    `state.json` is swapped back to the checkpoint's iteration, policy version and ledger.
    Both are idempotent, so a crash half-way is finished by the next rewind. States written
    before checkpoint cadence existed checkpointed every iteration: nothing to restore."""
    ck = state.checkpoint
    buf = replay_buffer(paths, resources)
    if ck is None:
        # A state from before checkpoint cadence: its last iteration has its checkpoint.
        # Record it (with the buffer as it is: a crashed iteration's rows are replaced
        # when it is redone, as they always were) so later rewinds have a target.
        ck = checkpoint_record(
            iteration=state.next_iteration - 1,
            policy_version=state.policy_version,
            ledger=state.ledger or {},
            rollouts_version=buf.version(),
            usage_version=buf.usage_version(),
        )
        updated = replace(state, checkpoint=ck)
        storage.advance_state(paths, updated, expected_next_iteration=state.next_iteration)
        return updated
    if buf.restore(rollouts_version=ck["rollouts_version"], usage_version=ck["usage_version"]):
        log.info(
            "rewound the buffer of %s to its checkpoint at iteration %d",
            cfg.lineage,
            ck["iteration"],
        )
        if resources is not None:
            resources.forget_buffer()
    if state.next_iteration == ck["iteration"] + 1:
        return state
    log.warning(
        "lineage %s: iterations %d-%d ran after its last full checkpoint (iteration %d) and "
        "are redone; their metrics stay as first logged",
        cfg.lineage,
        ck["iteration"] + 1,
        state.next_iteration - 1,
        ck["iteration"],
    )
    rewound = replace(
        state,
        next_iteration=ck["iteration"] + 1,
        policy_version=ck["policy_version"],
        ledger=dict(ck["ledger"]),
        last_metrics=None,
    )
    storage.advance_state(paths, rewound, expected_next_iteration=state.next_iteration)
    return rewound


def config_from_dict_safe(paths: LineagePaths) -> RunConfig | None:
    import yaml

    try:
        return config_from_dict(yaml.safe_load(storage.read_bytes(paths.config)))
    except Exception:  # the stored config is only used to explain a mismatch
        return None


def _diff(a: RunConfig, b: RunConfig) -> str:
    fa, fb = a.flat(), b.flat()
    keys = [
        k
        for k in fb
        if fa.get(k) != fb.get(k)
        and not k.startswith(("storage.", "tracking."))
        and k != "iterations"
    ]
    return ", ".join(f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in keys[:5]) or "unknown"


def adopt_buffer_versions(paths: LineagePaths) -> None:
    """Pair the lineage's last full checkpoint with the buffer as it is now, after a repair
    set damaged files aside: a rewind must not restore a version that references them.
    Refused while iterations after the checkpoint are committed (their rows would stay)."""
    state = storage.read_state(paths)
    if state is None or state.checkpoint is None:
        return
    ck = state.checkpoint
    if state.next_iteration != ck["iteration"] + 1:
        raise ReplayRLError(
            f"The buffer was repaired, but lineage state '{paths.state}' has iterations "
            f"{ck['iteration'] + 1}-{state.next_iteration - 1} after its last full checkpoint; "
            f"a resume would restore the damaged files. Start a new --lineage from checkpoint "
            f"v{ck['policy_version']} (--set model.source=<that checkpoint>)."
        )
    buf = replay_buffer(paths)
    adopted = replace(
        state,
        checkpoint={**ck, "rollouts_version": buf.version(), "usage_version": buf.usage_version()},
    )
    storage.advance_state(paths, adopted, expected_next_iteration=state.next_iteration)


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
