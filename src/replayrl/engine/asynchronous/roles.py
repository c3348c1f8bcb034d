"""The asynchronous engine's three roles, each a loop for one process (or one Kubeflow task).

- `worker_loop`: generates batches of R rows with the newest *published* weights (checked
  between batches), appends each batch to the Delta buffer in one commit, and pauses while
  more rows than `async_max_unused_rows` wait unused (back-pressure, counted as idle time).
- `trainer_loop`: one gradient step at a time on B rows of the newest buffer version (its
  in-memory mirror): drawn uniformly (replay), or the oldest B rows no step has used, each
  row used once (the on-policy queue). It waits while the buffer holds fewer than
  `async_min_rows` rows (or, on the queue, fewer than B unused ones), counted as idle time.
  It is the buffer's only deleter: retention (FIFO capacity, positive bias, max staleness)
  every S steps, or, on the queue, the rows it used. Every `publish_every` steps (and at
  evaluation steps and the end) it logs the steps' usage, publishes its weights (weights
  only, then the version pointer), writes a full checkpoint when due, and logs metrics to
  MLflow: it is the lineage's only MLflow writer.
- `evaluator_loop`: evaluates each published version that is due (v0, every eval.every x S
  gradient steps, the lineage's last), writing the result for the trainer to log.

They coordinate only through the buffer and the files of `replayrl.engine.asynchronous.board`, so the same
loops run as processes of `replayrl.engine.asynchronous.supervisor` on one machine and as parallel tasks of the
Kubeflow async_segment pipeline. Versions are gradient steps: a row's policy_version is the
step of the weights that generated it, a use's policy_version_at_use the trainer's step
before the update, so staleness = the difference, in gradient steps. A segment ends when the
trainer reaches its end step (or deadline) and marks it done; workers and the evaluator stop
after their current batch or evaluation.

Not bit-reproducible (which weights a batch is generated with depends on timing). What holds
instead: no committed row is lost or duplicated (appends are idempotent per batch, and a
worker resumes after the batches the buffer holds), and published versions only increase.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replayrl import storage
from replayrl.buffer.mirror import BufferMirror
from replayrl.buffer.schema import USAGE_SCHEMA
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import RunConfig, async_max_unused_rows, async_min_rows, default_cache_dir
from replayrl.engine.asynchronous import board
from replayrl.errors import ReplayRLError
from replayrl.storage import LineagePaths

log = logging.getLogger(__name__)

# How often a waiting role looks again (seconds).
POLL_S = 0.1
# Workers and the evaluator stop with an error when the trainer has written no status for
# this long (it writes one every step and every wait): a trainer that failed for good must
# not leave them waiting for a segment that never ends. Longer than a trainer pod's restart.
TRAINER_SILENT_S = 1800.0


def check_trainer_alive(paths: LineagePaths, segment_id: str) -> None:
    """Raise when segment `segment_id`'s trainer has been silent for TRAINER_SILENT_S."""
    segment = board.read_segment(paths)
    if segment is None or segment.id != segment_id:
        return
    last = max(board.read_trainer(paths).updated_at, segment.started_at)
    if time.time() - last > TRAINER_SILENT_S:
        raise ReplayRLError(
            f"the trainer of {paths.root} has written no status for {TRAINER_SILENT_S:.0f} s "
            "and the segment is not done: stopping. Committed rows are kept; start the "
            "segment again to resume."
        )


# Columns the trainer mirrors: what a gradient step reads, and what the queue orders by.
MIRROR_COLUMNS = [
    "rollout_id",
    "iteration",
    "policy_version",
    "group_id",
    "prompt_token_ids",
    "completion_token_ids",
    "behavior_logprobs",
    "reward",
    "advantage",
]


def batch_iteration(batch: int, worker: int, workers: int) -> int:
    """The buffer `iteration` of worker `worker`'s batch `batch`: batches interleave across
    workers (1, 2, ..., W for batch 0), so FIFO retention sees them in generation order."""
    return batch * workers + worker + 1


def buffer_of(paths: LineagePaths) -> ReplayBuffer:
    return ReplayBuffer(paths.buffer, storage_options=storage.delta_storage_options(paths.buffer))


def set_threads(threads: int | None) -> None:
    """One role's share of the CPU: `threads` torch threads (None leaves torch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


# ---------------------------------------------------------------- worker


def worker_loop(
    cfg: RunConfig, paths: LineagePaths, *, worker: int, segment_id: str, threads: int | None = 1
) -> board.WorkerStatus:
    """Generate batches until segment `segment_id` is done; returns the worker's status."""
    from replayrl.engine.resources import Workers
    from replayrl.engine.steps import make_rollouts, task_splits

    set_threads(threads)
    a = cfg.asynchronous
    buf = buffer_of(paths)
    status = board.read_worker(paths, worker)
    status.pid = os.getpid()
    status.next_batch = max(status.next_batch, _next_batch_in_buffer(buf, worker, a.workers))
    cap = async_max_unused_rows(cfg)
    engine = Workers(cfg, paths, weights_uri=lambda v: board.weights_uri(paths, v))
    try:
        engine.splits = task_splits(cfg)
        while not board.segment_done(paths, segment_id):
            waited = _wait_for_room(paths, status, cap, segment_id)
            status.idle_seconds += waited
            if board.segment_done(paths, segment_id):
                break
            start = time.perf_counter()
            pointer = board.latest(paths)
            if pointer is None:
                raise ReplayRLError(f"no published weights under {board.published_dir(paths)}")
            backend = engine.backend_at(pointer.version)
            iteration = batch_iteration(status.next_batch, worker, a.workers)
            made = make_rollouts(
                cfg, engine.splits, backend, iteration=iteration, policy_version=pointer.version
            )
            version = buf.append(made.table, iteration=iteration)
            status.next_batch += 1
            status.batches += 1
            status.rows_appended += made.table.num_rows
            status.generated_tokens += made.generated_tokens
            status.policy_version = pointer.version
            status.recent_appends.append([version, made.table.num_rows])
            status.busy_seconds += time.perf_counter() - start
            board.write_worker(paths, status)
    finally:
        engine.close()
    board.write_worker(paths, status)
    return status


def _next_batch_in_buffer(buf: ReplayBuffer, worker: int, workers: int) -> int:
    """One past the newest batch of `worker` the buffer holds (0 when none): a worker killed
    between its append and its status write does not generate that batch again."""
    if buf.version() is None:
        return 0
    iterations = buf.read(columns=["iteration"]).column("iteration").to_numpy()
    mine = iterations[(iterations - 1) % workers == worker]
    return int((mine.max() - 1) // workers + 1) if mine.size else 0


def unused_estimate(status: board.WorkerStatus, trainer: board.TrainerStatus) -> int:
    """Rows no gradient step has used: the trainer's count at the buffer version it last saw,
    plus this worker's rows appended after that version."""
    seen = trainer.buffer_version if trainer.buffer_version is not None else -1
    status.recent_appends = [[v, n] for v, n in status.recent_appends if v > seen]
    return trainer.unused_rows + sum(n for _, n in status.recent_appends)


def _wait_for_room(
    paths: LineagePaths, status: board.WorkerStatus, cap: int, segment_id: str
) -> float:
    """Pause while more than `cap` rows wait unused; returns the seconds paused."""
    start = time.perf_counter()
    while unused_estimate(status, board.read_trainer(paths)) > cap:
        if board.segment_done(paths, segment_id):
            break
        check_trainer_alive(paths, segment_id)
        time.sleep(POLL_S)
    return time.perf_counter() - start


# ---------------------------------------------------------------- evaluator


def eval_due_versions(cfg: RunConfig, *, up_to: int) -> list[int]:
    """Gradient steps whose weights are evaluated: 0, every eval.every x S, and the lineage's
    last step, up to `up_to`."""
    every = cfg.eval.every * cfg.train.steps_per_iteration
    total = cfg.total_gradient_steps
    due = {0, total} | (set(range(every, total + 1, every)) if every > 0 else set())
    return sorted(v for v in due if v <= up_to)


def evaluator_loop(
    cfg: RunConfig, paths: LineagePaths, *, segment_id: str, threads: int | None = 1
) -> board.EvaluatorStatus:
    """Evaluate due published versions until segment `segment_id` is done and every due
    version up to its final step is evaluated."""
    from replayrl.engine.resources import Workers
    from replayrl.engine.steps import evaluate, task_splits

    set_threads(threads)
    status = board.read_evaluator(paths)
    status.pid = os.getpid()
    engine = Workers(cfg, paths, weights_uri=lambda v: board.weights_uri(paths, v))
    try:
        engine.splits = task_splits(cfg)
        while True:
            segment = board.read_segment(paths)
            pointer = board.latest(paths)
            top = pointer.version if pointer else -1
            pending = [
                v
                for v in eval_due_versions(cfg, up_to=top)
                if board.read_eval(paths, v) is None
                and storage.is_complete(board.weights_uri(paths, v))
            ]
            if not pending:
                over = segment is None or segment.id != segment_id or segment.done
                if over:
                    break
                check_trainer_alive(paths, segment_id)
                wait = time.perf_counter()
                time.sleep(POLL_S * 5)
                status.idle_seconds += time.perf_counter() - wait
                continue
            version = pending[0]
            start = time.perf_counter()
            result = evaluate(cfg, paths, policy_version=version, workers=engine)
            record = board.published_record(paths, version)
            board.write_eval(
                paths,
                version,
                {
                    "version": version,
                    "result": result.as_dict(),
                    "k": result.k,
                    "cumulative_seconds": record.cumulative_seconds if record else 0.0,
                    "cumulative_generated_tokens": (
                        record.cumulative_generated_tokens if record else 0
                    ),
                },
            )
            status.evaluated += 1
            status.busy_seconds += time.perf_counter() - start
            board.write_evaluator(paths, status)
    finally:
        engine.close()
    board.write_evaluator(paths, status)
    return status


# ---------------------------------------------------------------- trainer


class _Uses:
    """Every use of every row so far: counts and the step of the last use, from the usage
    table (at most `up_to`) and the trainer's own steps since."""

    def __init__(self, usage: pa.Table, *, up_to: int):
        self.count: dict[str, int] = defaultdict(int)
        self.last: dict[str, int] = {}
        steps = usage.column("iteration").to_numpy()
        keep = steps <= up_to
        for rid, step in zip(
            usage.column("rollout_id").to_numpy(zero_copy_only=False)[keep],
            steps[keep],
            strict=True,
        ):
            self.add(str(rid), int(step))

    def add(self, rollout_id: str, step: int) -> None:
        self.count[rollout_id] += 1
        self.last[rollout_id] = max(step, self.last.get(rollout_id, step))


class _Unused:
    """The workers' back-pressure count: rows of the mirrored version no step has used. Counted
    in full only when the mirror moves to another version (which also forgets the uses of rows
    that left the buffer: deleted rows never come back), else lowered by each step's first uses."""

    def __init__(self):
        self.version: int | None = None
        self.rows = 0

    def refresh(self, mirror: BufferMirror, uses: _Uses) -> int:
        if mirror.version is not None and mirror.version != self.version:
            ids = mirror.rows(["rollout_id"]).column("rollout_id").to_pylist()
            present = set(ids)
            for rid in [r for r in uses.count if r not in present]:
                del uses.count[rid]
                uses.last.pop(rid, None)
            self.rows = sum(1 for rid in present if rid not in uses.count)
            self.version = mirror.version
        return self.rows


class _Window:
    """What the trainer did since its last publication, for the usage log and metrics."""

    def __init__(self):
        self.usage: list[pa.Table] = []
        self.stats: list = []
        self.ages: list[np.ndarray] = []
        self.gaps: list[float] = []
        self.first_uses = 0
        self.uses = 0


def trainer_loop(
    cfg: RunConfig, paths: LineagePaths, *, segment_id: str, threads: int | None = 1
) -> int:
    """Train until segment `segment_id`'s end step or deadline; returns the final step."""
    import torch

    from replayrl.engine.asynchronous.trainer_group import close_trainers, start_trainers
    from replayrl.engine.lineage import make_tracker
    from replayrl.engine.resources import Trainer
    from replayrl.engine.steps import derive_seed, step_settings
    from replayrl.policy.models import load_policy

    set_threads(threads)
    segment = board.read_segment(paths)
    if segment is None or segment.id != segment_id:
        raise ReplayRLError(f"segment {segment_id} is not the lineage's running segment")
    state = storage.read_state(paths)
    tracker = make_tracker(cfg, state.tracking_uri)
    pointer = board.latest(paths)
    trainer = Trainer.load(cfg, paths, version=state.policy_version, settings=step_settings(cfg))
    if pointer.version > trainer.version:
        # The newest published weights, with AdamW's moments of the last full checkpoint
        # (at most train.checkpoint_every x S steps older): published versions never go back.
        local = storage.checkpoint_local_dir(
            board.weights_uri(paths, pointer.version), default_cache_dir(cfg), weights_only=True
        )
        published, _ = load_policy(Path(local), dtype=torch.float32)
        trainer.model.load_state_dict(published.state_dict())
        trainer.version = pointer.version
        del published
    # T > 1: this process is rank 0 of T data-parallel replicas (the same interface).
    trainer = start_trainers(cfg, trainer, checkpoint_version=state.policy_version, threads=threads)
    s = cfg.train.steps_per_iteration
    a = cfg.asynchronous
    on_policy = cfg.arm == "on-policy"
    buf = buffer_of(paths)
    mirror = BufferMirror(buf, columns=MIRROR_COLUMNS)
    uses = _Uses(buf.read_usage(), up_to=trainer.version)
    status = board.read_trainer(paths)
    status.pid = os.getpid()
    status.gradient_step = trainer.version
    last_logged_step = trainer.version
    logged_evals = _logged_versions(tracker, state.mlflow_run_id, cfg)
    window = _Window()
    unused = _Unused()
    min_rows = async_min_rows(cfg)
    b = cfg.train.batch_size

    def cumulative_seconds() -> float:
        return segment.cumulative_seconds_at_start + (time.time() - segment.started_at)

    def over() -> bool:
        return trainer.version >= segment.end_step or (
            segment.deadline is not None and time.time() >= segment.deadline
        )

    def publish(final: bool) -> None:
        nonlocal last_logged_step, state
        g = trainer.version
        if window.usage:
            buf.log_usage(
                pa.concat_tables(window.usage), iteration=last_logged_step + 1, last_iteration=g
            )
        elif g > last_logged_step:
            buf.log_usage(
                USAGE_SCHEMA.empty_table(), iteration=last_logged_step + 1, last_iteration=g
            )
        if on_policy:
            used = [
                rid
                for rid in mirror.rows(["rollout_id"]).column("rollout_id").to_pylist()
                if rid in uses.count
            ]
            if used:
                buf.discard(used)
        workers = board.read_workers(paths, a.workers)
        tokens = sum(w.generated_tokens for w in workers)
        record = board.Published(
            version=g,
            published_at=time.time(),
            cumulative_seconds=cumulative_seconds(),
            cumulative_generated_tokens=tokens,
        )
        if g > 0 and not storage.is_complete(board.weights_uri(paths, g)):
            trainer.save(board.weights_uri(paths, g), weights_only=True)
        if final or g % (cfg.train.checkpoint_every * s) == 0:
            state = _full_checkpoint(cfg, paths, state, trainer, record)
        board.point_to(paths, record)
        status.gradient_step = g
        board.write_trainer(paths, status)
        _log(cfg, paths, tracker, state.mlflow_run_id, window, uses, record, status, workers)
        _log_evals(cfg, paths, tracker, state.mlflow_run_id, logged_evals, up_to=g)
        _prune_published(cfg, paths, keep_from=g)
        last_logged_step = g
        window.__init__()

    every_eval = cfg.eval.every * s
    while not over():
        start = time.perf_counter()
        version = buf.version()
        if version is not None:
            mirror.sync(version)
        if on_policy:
            batch = _queue_batch(mirror, uses, b) if version is not None else None
        else:
            enough = version is not None and mirror.num_rows >= min_rows
            batch = (
                mirror.sample(
                    version=version,
                    batch_size=b,
                    num_batches=1,
                    seed=derive_seed(cfg.seed, "sample", trainer.version + 1),
                    mode="uniform",
                    replace=cfg.buffer.sample_with_replacement,
                    columns=MIRROR_COLUMNS,
                )[0]
                if enough
                else None
            )
        if batch is None:
            if version is not None:
                status.buffer_version = version
                status.unused_rows = unused.refresh(mirror, uses)
            board.write_trainer(paths, status)
            time.sleep(POLL_S)
            status.idle_seconds += time.perf_counter() - start
            continue
        status.unused_rows = unused.refresh(mirror, uses)
        step_before = trainer.version
        stats = trainer.train([batch], seed=derive_seed(cfg.seed, "train", step_before + 1))
        g = trainer.version
        ids = batch.column("rollout_id").to_pylist()
        row_versions = batch.column("policy_version").to_numpy()
        window.ages.append(step_before - row_versions)
        for rid in ids:
            if rid in uses.last:
                window.gaps.append(float(step_before - uses.last[rid]))
            else:
                window.first_uses += 1
                unused.rows -= 1  # sampled rows are of the mirrored version
            uses.add(rid, g)
        status.unused_rows = unused.rows
        status.buffer_version = version
        window.uses += len(ids)
        window.stats.extend(stats)
        window.usage.append(
            pa.table(
                {
                    "lineage": [cfg.lineage] * len(ids),
                    "iteration": [g] * len(ids),
                    "train_step": [0] * len(ids),
                    "rollout_id": ids,
                    "policy_version_at_use": [step_before] * len(ids),
                    "rollout_policy_version": row_versions,
                }
            ).cast(USAGE_SCHEMA)
        )
        status.row_uses += len(ids)
        if not on_policy and g % s == 0:
            _retain(cfg, buf, current_step=g)
        status.busy_seconds += time.perf_counter() - start
        if g % a.publish_every == 0 or (every_eval and g % every_eval == 0) or over():
            start = time.perf_counter()
            publish(final=over())
            status.busy_seconds += time.perf_counter() - start
        else:
            board.write_trainer(paths, status)
    if last_logged_step != trainer.version or state.policy_version != trainer.version:
        # The deadline passed between publications, or while waiting: the segment still
        # ends with its usage logged, its weights published and a full checkpoint.
        publish(final=True)
    close_trainers(trainer)
    final_step = trainer.version
    board.write_segment(
        paths,
        board.Segment(**{**segment.__dict__, "done": True, "final_step": final_step}),
    )
    _await_evaluations(cfg, paths, tracker, state.mlflow_run_id, logged_evals, final_step)
    if final_step >= cfg.total_gradient_steps:
        tracker.set_terminated(state.mlflow_run_id)
    return final_step


def _queue_batch(mirror: BufferMirror, uses: _Uses, b: int) -> pa.Table | None:
    """The on-policy queue's next batch: the oldest B rows no step has used (whole groups:
    rows of one group are appended together and ordered together), or None."""
    rows = mirror.rows(MIRROR_COLUMNS)
    if rows.num_rows < b:
        return None
    fresh = pa.array([rid not in uses.count for rid in rows.column("rollout_id").to_pylist()])
    rows = rows.filter(fresh)
    if rows.num_rows < b:
        return None
    order = pc.sort_indices(
        rows,
        sort_keys=[
            ("iteration", "ascending"),
            ("group_id", "ascending"),
            ("rollout_id", "ascending"),
        ],
    )
    return rows.take(order.slice(0, b))


def _retain(cfg: RunConfig, buf: ReplayBuffer, *, current_step: int) -> None:
    """Retention, as the synchronous engine's compact: versions are gradient steps here, so
    max_staleness (in iterations of S steps) is counted as K x S steps."""
    bcfg = cfg.buffer
    s = cfg.train.steps_per_iteration
    buf.compact(
        capacity=bcfg.capacity,
        positive_bias=bcfg.positive_bias,
        max_staleness=None if bcfg.max_staleness is None else bcfg.max_staleness * s,
        current_policy_version=current_step,
        target_file_bytes=bcfg.target_file_bytes,
        min_files_to_compact=bcfg.compact_min_files,
        vacuum_grace_s=bcfg.vacuum_grace_s,
    )


def _full_checkpoint(cfg, paths, state, trainer, record: board.Published):
    """Weights, optimizer and RNG state at checkpoints/v{g}, then state.json points at it."""
    from dataclasses import replace

    from replayrl.engine.lineage import checkpoint_record

    g = trainer.version
    if g != state.policy_version:
        trainer.save(paths.checkpoint(g))
    ledger = {
        "wall_seconds": record.cumulative_seconds,
        "generated_tokens": float(record.cumulative_generated_tokens),
    }
    new = replace(
        state,
        next_iteration=g + 1,
        policy_version=g,
        ledger=ledger,
        checkpoint=checkpoint_record(iteration=g, policy_version=g, ledger=ledger),
    )
    if new != state:
        storage.advance_state(paths, new, expected_next_iteration=state.next_iteration)
    storage.prune_checkpoints(paths, keep=cfg.train.keep_checkpoints, protect={0, g})
    return new


def _prune_published(cfg: RunConfig, paths: LineagePaths, *, keep_from: int) -> None:
    """Delete published weights older than the newest two, except versions due for
    evaluation that are not evaluated yet."""
    versions = [v for v in board.published_versions(paths) if v < keep_from]
    due = set(eval_due_versions(cfg, up_to=keep_from))
    for v in versions[:-1]:
        if v in due and board.read_eval(paths, v) is None:
            continue
        storage.delete(board.weights_uri(paths, v))


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def _log(
    cfg, paths, tracker, run_id, window: _Window, uses: _Uses, record, status, workers
) -> None:
    """The publication's metrics, at step g and (async/, replay/) at step ktokens."""
    from replayrl.engine.lineage import _log_groups

    g = record.version
    a = cfg.asynchronous
    ages = np.concatenate(window.ages) if window.ages else np.array([])
    k_inf = sum(w.rows_appended for w in workers)
    k_train = status.row_uses
    gen_busy = sum(w.busy_seconds for w in workers)
    mu = (k_train / a.trainers) / (k_inf / a.workers) if k_inf else math.nan
    mu_busy = (
        (gen_busy / k_inf) / (status.busy_seconds / k_train)
        if k_inf and k_train and status.busy_seconds > 0
        else math.nan
    )
    # The replay ratio per row: uses so far of each row this window's steps used.
    used = {rid for table in window.usage for rid in table.column("rollout_id").to_pylist()}
    # (Rows retention deleted since their use have left the in-memory counts.)
    counts = np.array([uses.count[rid] for rid in used if rid in uses.count], dtype=np.float64)
    evaluator = board.read_evaluator(paths)
    grouped = {
        "async": {
            "published_version": float(g),
            "rows_generated": float(k_inf),
            "row_uses": float(k_train),
            "unused_rows": float(status.unused_rows),
            "mu": mu,
            "mu_busy": mu_busy,
            "gamma": (1 + a.workers / a.trainers) / (1 + mu) if math.isfinite(mu) else math.nan,
            "trainer_busy_seconds": status.busy_seconds,
            "trainer_idle_seconds": status.idle_seconds,
            "workers_busy_seconds": gen_busy,
            "workers_idle_seconds": sum(w.idle_seconds for w in workers),
            "evaluator_busy_seconds": evaluator.busy_seconds,
            "evaluator_idle_seconds": evaluator.idle_seconds,
            "oldest_worker_version": float(
                min(
                    (w.policy_version for w in workers if w.policy_version is not None),
                    default=math.nan,
                )
            ),
        },
        "replay": {
            "sample_age_mean": float(ages.mean()) if ages.size else math.nan,
            "sample_age_p50": _percentile(ages, 50),
            "sample_age_p95": _percentile(ages, 95),
            "sample_age_max": float(ages.max()) if ages.size else math.nan,
            "steps_since_last_use_mean": float(np.mean(window.gaps)) if window.gaps else math.nan,
            "frac_first_use": window.first_uses / window.uses if window.uses else math.nan,
            "uses_per_row_mean": float(counts.mean()) if counts.size else math.nan,
            "uses_per_row_max": float(counts.max()) if counts.size else math.nan,
        },
    }
    train = {}
    if window.stats:
        train = {
            "train/loss": float(np.mean([x.loss for x in window.stats])),
            "train/clip_fraction": float(np.mean([x.clip_fraction for x in window.stats])),
            "train/mean_ratio": float(np.mean([x.mean_ratio for x in window.stats])),
            "train/grad_norm": float(np.mean([x.grad_norm for x in window.stats])),
            "train/sample_reward": float(np.mean([x.mean_reward for x in window.stats])),
        }
    at_step = {f"{group}/{k}": v for group, values in grouped.items() for k, v in values.items()}
    at_step |= train | {
        "cumulative/wall_seconds": record.cumulative_seconds,
        "cumulative/generated_tokens": float(record.cumulative_generated_tokens),
        "cumulative/rollouts_generated": float(k_inf),
        "cumulative/rollouts_trained": float(k_train),
    }
    by_tokens = {
        f"{group}_by_ktokens/{k}": v for group, values in grouped.items() for k, v in values.items()
    }
    _log_groups(
        tracker,
        run_id,
        [[g, at_step], [record.cumulative_generated_tokens // 1000, by_tokens]],
        timestamp_ms=int(time.time() * 1000),
    )


def _logged_versions(tracker, run_id: str, cfg: RunConfig) -> set[int]:
    return {int(m.step) for m in tracker.client.get_metric_history(run_id, "eval/pass1")}


def _log_evals(cfg, paths, tracker, run_id, logged: set[int], *, up_to: int) -> list[int]:
    """Log the evaluator's results of due versions up to `up_to` not logged yet."""
    from replayrl.engine.lineage import _log_groups

    done = []
    for v in eval_due_versions(cfg, up_to=up_to):
        if v in logged:
            continue
        found = board.read_eval(paths, v)
        if found is None:
            continue
        r = found["result"]
        kt = int(found["cumulative_generated_tokens"]) // 1000
        values = {
            "pass1": r["pass1"],
            f"pass_at_{found['k']}": r["pass_at_k"],
            "sample_accuracy": r["mean_sample_correct"],
            "entropy": r["entropy"],
            "response_length": r["response_length"],
            "unparsed": r["unparsed"],
            "pass1_sampled": r["pass1_sampled"],
        }
        at_step = {f"eval/{k}": x for k, x in values.items()} | {
            "accuracy/pass1": r["pass1"],
            "eval/cumulative_wall_seconds": found["cumulative_seconds"],
        }
        at_tokens = {f"eval_by_ktokens/{k}": x for k, x in values.items()} | {
            "accuracy/pass1_by_ktokens": r["pass1"]
        }
        _log_groups(
            tracker, run_id, [[v, at_step], [kt, at_tokens]], timestamp_ms=int(time.time() * 1000)
        )
        logged.add(v)
        done.append(v)
    return done


def _await_evaluations(
    cfg, paths, tracker, run_id, logged: set[int], final_step: int, *, timeout_s: float = 3600.0
) -> None:
    """After the segment's last publication: log every due evaluation up to `final_step`
    once the evaluator has written it (it stops after the last one)."""
    deadline = time.time() + timeout_s
    due = set(eval_due_versions(cfg, up_to=final_step))
    while True:
        _log_evals(cfg, paths, tracker, run_id, logged, up_to=final_step)
        missing = [v for v in due - logged if storage.is_complete(board.weights_uri(paths, v))]
        if not missing or time.time() > deadline:
            if missing:
                log.warning("evaluations of versions %s did not arrive in time", sorted(missing))
            return
        time.sleep(POLL_S * 5)
