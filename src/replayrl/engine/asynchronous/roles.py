"""The asynchronous engine's roles, each a loop for one process (or one Kubeflow task), and what
they share.

- `worker_loop`: generates batches of R rows with the newest *published* weights (checked
  between batches), appends each batch to the Delta buffer in one commit, and pauses while
  more rows than `async_max_unused_rows` wait unused, counted once over all W workers
  (back-pressure, counted as idle time; `unused_rows` states the bound).
- `trainer_loop` (`replayrl.engine.asynchronous.trainer`): one gradient step at a time on
  B rows of the newest buffer version; the buffer's only deleter and the lineage's only
  MLflow writer, recording through the same functions as the inline engine.
- `evaluator_loop`: evaluates each published version that is due (v0, every eval.every x S
  gradient steps, the lineage's last), writing the result for the trainer to log.

After each load of published weights, a worker or the evaluator drops the local copies of
the versions it will not load again (`replayrl.engine.asynchronous.cache`).

Each loop reports progress (`replayrl.engine.children.beat`: a no-op in a Kubeflow task) after
every unit of work and at every poll while it waits, which the supervisor's watchdog reads.
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
import os
import time

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import RunConfig, async_max_unused_rows
from replayrl.engine import children
from replayrl.engine.asynchronous import board, cache
from replayrl.engine.asynchronous.peers import Peers
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
    from replayrl.engine.asynchronous.weights import WorkerWeights, broadcasting
    from replayrl.engine.inputs import task_splits
    from replayrl.engine.resources import TaskResources
    from replayrl.engine.steps import make_rollouts
    from replayrl.engine.tracking import this_accelerator

    set_threads(threads)
    # Before anything slow: say this worker started, and stop if the segment was given up.
    peers = Peers(cfg, paths, segment_id=segment_id, role=f"worker{worker}").start()
    a = cfg.asynchronous
    buf = buffer_of(paths)
    status = board.read_worker(paths, worker)
    status.pid = os.getpid()
    status.accelerator, status.accelerators = this_accelerator()
    status.next_batch = max(status.next_batch, _next_batch_in_buffer(buf, worker, a.workers))
    cap = async_max_unused_rows(cfg)
    received_before = status.receive_seconds  # this worker's earlier processes'
    resources = TaskResources(cfg, paths, weights_uri=lambda v: board.weights_uri(paths, v))
    cached_for = None  # the version whose load last dropped the other cached copies
    held = None  # the version the generation backend holds now
    weights = None
    if broadcasting(cfg):
        weights = WorkerWeights(cfg, paths, worker=worker, segment_id=segment_id)
    try:
        resources.splits = task_splits(cfg)
        while not board.segment_done(paths, segment_id):
            children.beat()
            peers.check()
            waited = _wait_for_room(paths, status, cap, segment_id, peers, workers=a.workers)
            status.idle_seconds += waited
            if board.segment_done(paths, segment_id):
                break
            start = time.perf_counter()
            pointer = board.latest(paths)
            if pointer is None:
                raise ReplayRLError(f"no published weights under {board.published_dir(paths)}")
            if pointer.version != status.policy_version:
                # Say what is being loaded before reading a byte: the trainer keeps it.
                status.loading = pointer.version
                board.write_worker(paths, status)
            load_start = time.perf_counter()
            arrived = None
            if pointer.version != held:
                arrived = "broadcast"
                if weights is None or not weights.apply(resources, pointer):
                    arrived = "files"
            try:
                backend = resources.backend_at(pointer.version)
            except ReplayRLError:
                moved = board.latest(paths)
                if moved is None or moved.version == pointer.version:
                    raise
                # Pruned while this worker was stopped before it said what it loads: take
                # the newer pointer.
                log.warning(
                    "published v%d went away while worker %d loaded it; loading v%d",
                    pointer.version,
                    worker,
                    moved.version,
                )
                continue
            held = pointer.version
            if arrived is not None:
                # Weights applied between batches: a ledger part of its own, not busy time.
                took = time.perf_counter() - load_start
                status.apply_seconds += took
                start += took
                if arrived == "broadcast":
                    status.broadcast_loads += 1
                else:
                    status.file_loads += 1
            if pointer.version != cached_for:
                # Loaded: keep this version and the newest announced one, drop the others.
                newest = board.latest(paths)
                keep = {pointer.version, newest.version if newest else pointer.version}
                cache.keep_only(cfg, paths, keep, role=f"worker{worker}")
                cached_for = pointer.version
            iteration = batch_iteration(status.next_batch, worker, a.workers)
            made = make_rollouts(
                cfg, resources.splits, backend, iteration=iteration, policy_version=pointer.version
            )
            # Claim the batch before its rows land: a worker killed after the append and
            # restarted never makes it again (its rows may already be used and discarded by
            # the on-policy queue, so the buffer alone cannot tell); one killed between the
            # claim and the append skips an index whose rows never existed.
            status.next_batch += 1
            board.write_worker(paths, status)
            version = buf.append(made.table, iteration=iteration)
            status.batches += 1
            status.rows_appended += made.table.num_rows
            status.generated_tokens += made.generated_tokens
            status.policy_version = pointer.version
            status.loading = None
            status.recent_appends.append([version, made.table.num_rows])
            if weights is not None:
                status.receive_seconds = received_before + weights.received_seconds()
            status.busy_seconds += time.perf_counter() - start
            board.write_worker(paths, status)
    finally:
        if weights is not None:
            # Bounded by the receiver's own timeouts: a wait by design, not a stall.
            with children.beating():
                weights.close()
        resources.close()
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


def unused_rows(trainer: board.TrainerStatus, workers: list[board.WorkerStatus]) -> int:
    """Rows appended to the buffer that no gradient step has used, over all `workers`: the
    trainer's count at the buffer version it last saw, plus every worker's rows appended at
    later buffer versions (its `recent_appends`). Read the workers' statuses *before* the
    trainer's: a worker forgets an append only once a trainer status it read covers it, and
    the trainer's buffer version only increases, so none is missed.

    The bound (`_wait_for_room`): a worker starts a batch only when this count, with its own
    appends up to date, is at most the cap; what it cannot see is at most one batch of each
    other worker (appended, or about to be, before that worker's status says so: a worker
    writes its status after each append, before it looks again). So the rows no step has
    used never exceed cap + W x R (R: the rows of one batch), whatever W and the timing,
    not counting a batch whose worker was killed between its append and its status write."""
    seen = trainer.buffer_version if trainer.buffer_version is not None else -1
    return trainer.unused_rows + sum(n for w in workers for v, n in w.recent_appends if v > seen)


def _room(paths: LineagePaths, status: board.WorkerStatus, cap: int, workers: int) -> bool:
    """Whether at most `cap` rows wait unused (`unused_rows`), all W workers' counted. The
    trainer's count and this worker's appends alone (a lower bound) decide first, so a worker
    held back by the trainer reads no other status."""
    trainer = board.read_trainer(paths)
    seen = trainer.buffer_version if trainer.buffer_version is not None else -1
    status.recent_appends = [[v, n] for v, n in status.recent_appends if v > seen]
    if unused_rows(trainer, [status]) > cap:
        return False
    if workers == 1:
        return True
    others = [board.read_worker(paths, w) for w in range(workers) if w != status.worker]
    return unused_rows(board.read_trainer(paths), [status, *others]) <= cap


def _wait_for_room(
    paths: LineagePaths,
    status: board.WorkerStatus,
    cap: int,
    segment_id: str,
    peers: Peers,
    *,
    workers: int,
) -> float:
    """Pause while more than `cap` rows wait unused (`_room`); returns the seconds paused (0
    when there was room at once: looking is not pausing)."""
    start = time.perf_counter()
    paused = False
    while not _room(paths, status, cap, workers):
        if board.segment_done(paths, segment_id):
            break
        peers.check()
        check_trainer_alive(paths, segment_id)
        children.beat()
        time.sleep(POLL_S)
        paused = True
    return time.perf_counter() - start if paused else 0.0


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
    from replayrl.engine.inputs import task_splits
    from replayrl.engine.resources import TaskResources
    from replayrl.engine.steps import evaluate

    set_threads(threads)
    peers = Peers(cfg, paths, segment_id=segment_id, role="evaluator").start()
    status = board.read_evaluator(paths)
    status.pid = os.getpid()
    resources = TaskResources(cfg, paths, weights_uri=lambda v: board.weights_uri(paths, v))
    try:
        resources.splits = task_splits(cfg)
        while True:
            children.beat()
            peers.check()
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
            status.loading = version
            board.write_evaluator(paths, status)
            result = evaluate(cfg, paths, policy_version=version, resources=resources)
            status.loading = None
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
            # Evaluated: keep only the copies of the due versions still to evaluate.
            cache.keep_only(cfg, paths, set(pending) - {version}, role="evaluator")
    finally:
        resources.close()
    board.write_evaluator(paths, status)
    return status
