"""Opening a lineage, and rewinding it to its last full checkpoint.

`open_lineage` creates (or resumes) a lineage: run root checked writable (on S3, also that
the store honours the conditional writes the commit relies on), config stored,
checkpoint v0 published, one MLflow run created with the flattened config as params (a
lineage's run is its run root's, lineage's and config's: lineages of one name in two run
roots never share one) and the warm-start evaluation logged at step 0
(`log_initial_evaluation`; the Kubeflow pipelines run it as a GPU task of its own, after opening on a CPU pod). `rewind` brings a resumed lineage back to its
last full checkpoint: the buffer's tables are restored to the versions recorded with it
(Delta restore) and `state.json` to its iteration, so the iterations after it are redone
and end where an uninterrupted run ends. Both engines call these.

Closing an iteration (`record_iteration`, the commit point) and the lineage's end are
`replayrl.engine.iteration`'s: opening a lineage only calls its `flush_metrics` and
`log_checkpoint_model` for what a run that died after its last commit left unlogged.

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
from dataclasses import replace

from replayrl import logs, storage
from replayrl.config import RunConfig, config_from_dict
from replayrl.engine import metric_schema
from replayrl.engine.inputs import (
    initial_policy,
    pin_task_inputs,
    publish_hub_inputs,
    publish_initial_policy,
    replay_buffer,
    task_splits,
)
from replayrl.engine.iteration import flush_metrics, log_checkpoint_model
from replayrl.engine.metric_schema import eval_metrics
from replayrl.engine.record import checkpoint_record
from replayrl.engine.resources import TaskResources
from replayrl.engine.steps import evaluate
from replayrl.engine.stores import follow_moved_root, lineage_store, make_tracker, tracking_uri
from replayrl.engine.tracking import Tracker
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
