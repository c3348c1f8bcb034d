"""The asynchronous engine's trainer role: one gradient step at a time on B rows of the newest
buffer version (its in-memory mirror), drawn uniformly (replay), or the oldest B rows no step
has used, each row used once (the on-policy queue). It waits while the buffer holds fewer than
`async_min_rows` rows (or, on the queue, fewer than B unused ones), counted as idle time.

It is the buffer's only deleter: the shared retention (`replayrl.engine.record.retain`) every S
steps, or, on the queue, the rows it used. Every `publish_every` steps (and at evaluation
steps and the end) it logs the steps' usage (`replayrl.buffer.schema.usage_rows`, as every
engine), publishes its weights (weights only, then the version pointer), writes a full
checkpoint when due (`replayrl.engine.record`: `checkpoint_record`, `after_checkpoint`), and
logs metrics built by `replayrl.engine.metric_schema`: it is the lineage's only MLflow writer.
Only its cadence differs from the inline engine's record path: a record per publication, at
step = the published gradient step.

This module is the loop and what it carries between steps (`_TrainerRun`, the row uses and
the window since the last publication, batches, retention, full checkpoints, pruning of
published weights); what it logs to MLflow (a publication's metrics, the evaluator's
results, the wait for the last evaluations) is `replayrl.engine.asynchronous.trainer_metrics`.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replayrl import storage
from replayrl.buffer.mirror import BufferMirror
from replayrl.buffer.schema import USAGE_SCHEMA, usage_rows
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import RunConfig, async_min_rows, default_cache_dir
from replayrl.engine import children
from replayrl.engine.asynchronous import board, devices
from replayrl.engine.asynchronous.peers import Peers
from replayrl.engine.asynchronous.roles import (
    MIRROR_COLUMNS,
    POLL_S,
    buffer_of,
    eval_due_versions,
    set_threads,
)
from replayrl.engine.asynchronous.trainer_metrics import (
    _await_evaluations,
    _log,
    _log_evals,
    _logged_versions,
)
from replayrl.engine.asynchronous.weights import TrainerWeights, broadcasting
from replayrl.errors import ReplayRLError
from replayrl.policy.training import NonFiniteStepError
from replayrl.storage import LineagePaths, fencing

# How often the trainer checks that its segment is still the lineage's running one (seconds).
SEGMENT_CHECK_S = 1.0


class _Uses:
    """Every use of every row so far: counts and the step of the last use, from the usage
    table (steps that ended at most at version `up_to`) and the trainer's own steps since.

    A use's step is the version the gradient step starts from (the usage log's
    `policy_version_at_use`; its `iteration` is the version it ends at), as in the ages: the
    paper's App. 10.3 counts steps since last use between batches, so uses in batches 3 and 5
    are 2 apart, not 1."""

    def __init__(self, usage: pa.Table, *, up_to: int):
        self.count: dict[str, int] = defaultdict(int)
        self.last: dict[str, int] = {}
        keep = usage.column("iteration").to_numpy() <= up_to
        for rid, step in zip(
            usage.column("rollout_id").to_numpy(zero_copy_only=False)[keep],
            usage.column("policy_version_at_use").to_numpy()[keep],
            strict=True,
        ):
            self.add(str(rid), int(step))

    def add(self, rollout_id: str, step: int) -> None:
        self.count[rollout_id] += 1
        self.last[rollout_id] = max(step, self.last.get(rollout_id, step))

    def draw(self, rollout_ids: list[str], *, step: int) -> list[int]:
        """Steps since the last use of each of one batch's draws (-1: never used), the
        batch counted as uses at `step` (the version the gradient step starts from). A row
        drawn twice in the batch (with replacement) was last used by its first draw: 0."""
        gaps = []
        for rid in rollout_ids:
            gaps.append(step - self.last[rid] if rid in self.last else -1)
            self.add(rid, step)
        return gaps


class _Unused:
    """The trainer's part of the workers' back-pressure count (`roles.unused_rows` adds the
    rows appended after the mirrored version): rows of the mirrored version no step has used.
    Counted in full only when the mirror moves to another version (which also forgets the uses
    of rows that left the buffer: deleted rows never come back), else lowered by each step's
    first uses."""

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
        self.gaps: list[float] = []  # steps since each use's row was last used; -1: never
        self.first_uses = 0
        self.uses = 0


def trainer_loop(
    cfg: RunConfig, paths: LineagePaths, *, segment_id: str, threads: int | None = 1
) -> int:
    """Train until segment `segment_id`'s end step or deadline; returns the final step."""
    set_threads(threads)
    segment = board.read_segment(paths)
    if segment is None or segment.id != segment_id:
        raise ReplayRLError(f"segment {segment_id} is not the lineage's running segment")
    # Before loading anything: say the trainer started, and stop if the segment was given up.
    peers = Peers(cfg, paths, segment_id=segment_id, role="trainer").start()
    run = _TrainerRun(cfg, paths, segment, threads=threads, peers=peers)
    with run.tracker.system_metrics(
        run.state.mlflow_run_id,
        enabled=cfg.tracking.system_metrics,
        interval_s=cfg.tracking.system_metrics_interval_s,
        node_id="trainer",
    ):
        return run.run()


def _load_trainer(cfg: RunConfig, paths: LineagePaths, state, *, threads: int | None):
    """The trainer at the newest published weights, with AdamW's moments of the last full
    checkpoint (at most train.checkpoint_every x S steps older): published versions never go
    back. T > 1: this process is rank 0 of T data-parallel replicas (the same interface).
    On GPUs shared with vLLM engines, loaded under their start lock
    (`devices.trainer_load_lock`)."""
    with devices.trainer_load_lock():
        return _load_trainer_now(cfg, paths, state, threads=threads)


def _load_trainer_now(cfg: RunConfig, paths: LineagePaths, state, *, threads: int | None):
    import torch

    from replayrl.engine.resources import Trainer
    from replayrl.engine.steps import step_settings
    from replayrl.engine.trainer_group import sharded, start_trainers
    from replayrl.policy.models import load_policy

    pointer = board.latest(paths)
    if sharded(cfg):  # every rank loads its own shards (train.distributed: fsdp)
        return start_trainers(
            cfg,
            None,
            checkpoint_version=state.policy_version,
            threads=threads,
            weights_version=max(state.policy_version, pointer.version if pointer else -1),
        )
    trainer = Trainer.load(cfg, paths, version=state.policy_version, settings=step_settings(cfg))
    if pointer.version > trainer.version:
        local = storage.checkpoint_local_dir(
            board.weights_uri(paths, pointer.version), default_cache_dir(cfg), weights_only=True
        )
        published, _ = load_policy(Path(local), dtype=torch.float32)
        trainer.model.load_state_dict(published.state_dict())
        trainer.version = pointer.version
        del published
    return start_trainers(cfg, trainer, checkpoint_version=state.policy_version, threads=threads)


class _TrainerRun:
    """One trainer process's part of a segment: what it carries between steps and
    publications."""

    def __init__(
        self, cfg: RunConfig, paths: LineagePaths, segment, *, threads: int | None, peers: Peers
    ):
        from replayrl.engine.stores import make_tracker

        self.cfg, self.paths, self.segment, self.peers = cfg, paths, segment, peers
        self.state = storage.read_state(paths)
        self.tracker = make_tracker(cfg, self.state.tracking_uri)
        self.trainer = _load_trainer(cfg, paths, self.state, threads=threads)
        self.on_policy = cfg.arm == "on-policy"
        self.buf = buffer_of(paths)
        self.mirror = BufferMirror(self.buf, columns=MIRROR_COLUMNS)
        self.uses = _Uses(self.buf.read_usage(), up_to=self.trainer.version)
        self.status = board.read_trainer(paths)
        self.status.pid = os.getpid()
        self.status.gradient_step = self.trainer.version
        self.last_logged_step = self.trainer.version
        self.logged_evals = _logged_versions(self.tracker, self.state.mlflow_run_id, cfg)
        self.window = _Window()
        self.unused = _Unused()
        self.drawn: set[str] = set()  # rows drawn in the current pass (buffer.sample_mode epoch)
        self.segment_checked = time.monotonic()
        self.weights = None  # the weight group's sender (asynchronous.weight_transfer)
        if broadcasting(cfg) and cfg.asynchronous.workers > 0:
            self.weights = TrainerWeights(cfg, paths, segment_id=segment.id)
        self.send_seconds = 0.0  # of the publication in progress
        # (publication, record) of weights whose files are still uploading in the background:
        # announced (`point_to`) once complete, before any newer one.
        self.pending: tuple[storage.Publication, board.Published] | None = None

    def cumulative_seconds(self) -> float:
        return self.segment.cumulative_seconds_at_start + (time.time() - self.segment.started_at)

    def over(self) -> bool:
        return self.trainer.version >= self.segment.end_step or (
            self.segment.deadline is not None and time.time() >= self.segment.deadline
        )

    def run(self) -> int:
        from replayrl.engine.trainer_group import close_trainers

        cfg, s = self.cfg, self.cfg.train.steps_per_iteration
        every_eval = cfg.eval.every * s
        while not self.over():
            children.beat()
            self.check_segment()
            start = time.perf_counter()
            version = self.buf.version()
            if version is not None:
                self.mirror.sync(version)
            batch = self._next_batch(version)
            if batch is None:
                self._wait(version, start)
                continue
            g = self._step(batch, version)
            self._announce_pending(wait=False)
            if not self.on_policy and g % s == 0:
                _retain(cfg, self.buf, current_step=g)
            self.status.busy_seconds += time.perf_counter() - start
            if (
                g % cfg.asynchronous.publish_every == 0
                or (every_eval and g % every_eval == 0)
                or self.over()
            ):
                self.publish(final=self.over())
            else:
                board.write_trainer(self.paths, self.status)
        g = self.trainer.version
        if self.last_logged_step != g or self.state.policy_version != g:
            # The deadline passed between publications, or while waiting: the segment still
            # ends with its usage logged, its weights published and a full checkpoint.
            self.publish(final=True)
        self._announce_pending(wait=True)
        close_trainers(self.trainer)
        if self.weights is not None:
            self.weights.close()
        board.write_segment(
            self.paths, board.Segment(**{**self.segment.__dict__, "done": True, "final_step": g})
        )
        run_id = self.state.mlflow_run_id
        _await_evaluations(
            cfg, self.paths, self.tracker, run_id, self.logged_evals, g, check=self.peers.check
        )
        if g >= cfg.total_gradient_steps:
            from replayrl.engine.iteration import finish_lineage

            finish_lineage(cfg, self.paths, self.tracker, self.state)
        return g

    def _announce_pending(self, *, wait: bool) -> None:
        """Move the version pointer to the publication whose files were uploading, once they
        are complete (`wait`: block until then; a failed upload raises its one line): a
        version is announced only once every path can deliver it."""
        if self.pending is None:
            return
        publication, record = self.pending
        if not wait and not publication.done():
            return
        publication.wait()
        board.point_to(self.paths, record)
        self.pending = None

    def check_segment(self) -> None:
        """Raise `children.Superseded` when the lineage's running segment is no longer this
        one (a newer run began its own): read at most every SEGMENT_CHECK_S; and
        `peers.PeersMissing` when the segment was given up or a role has not started in
        time."""
        self.peers.check()
        now = time.monotonic()
        if now - self.segment_checked < SEGMENT_CHECK_S:
            return
        self.segment_checked = now
        current = board.read_segment(self.paths)
        if current is None or current.id != self.segment.id:
            raise children.Superseded(
                f"segment {self.segment.id} is no longer the running segment of "
                f"{self.paths.root} (now {current.id if current else 'none'}): a newer run "
                "took the lineage over, and this trainer stops"
            )

    def _next_batch(self, version: int | None) -> pa.Table | None:
        """B rows to train on from the mirrored `version`, or None to wait."""
        from replayrl.engine.steps import derive_seed

        cfg = self.cfg
        if version is None:
            return None
        if self.on_policy:
            return _queue_batch(self.mirror, self.uses, cfg.train.batch_size)
        if self.mirror.num_rows < async_min_rows(cfg):
            return None
        if cfg.buffer.sampling(cfg.arm) == "epoch":
            rng = np.random.default_rng(derive_seed(cfg.seed, "sample", self.trainer.version + 1))
            rows = self.mirror.rows(MIRROR_COLUMNS)
            return pass_batch(rows, self.drawn, cfg.train.batch_size, rng)
        return self.mirror.sample(
            version=version,
            batch_size=cfg.train.batch_size,
            num_batches=1,
            seed=derive_seed(cfg.seed, "sample", self.trainer.version + 1),
            mode="uniform",
            replace=cfg.buffer.sample_with_replacement,
            columns=MIRROR_COLUMNS,
        )[0]

    def _wait(self, version: int | None, start: float) -> None:
        if version is not None:
            self.status.buffer_version = version
            self.status.unused_rows = self.unused.refresh(self.mirror, self.uses)
        board.write_trainer(self.paths, self.status)
        time.sleep(POLL_S)
        self.status.idle_seconds += time.perf_counter() - start

    def _step(self, batch: pa.Table, version: int) -> int:
        """One gradient step on `batch`, its uses counted; returns the new step g."""
        from replayrl.engine.steps import derive_seed

        window, uses, status = self.window, self.uses, self.status
        status.unused_rows = self.unused.refresh(self.mirror, uses)
        step_before = self.trainer.version
        s = self.cfg.train.steps_per_iteration
        try:
            stats = self.trainer.train(
                [batch],
                seed=derive_seed(self.cfg.seed, "train", step_before + 1),
                iteration=step_before // s + 1,
            )
        except NonFiniteStepError as e:
            # Gradient step g = step_before + 1 is step (g - 1) % S + 1 of its iteration.
            raise e.at(step=step_before % s + 1) from None
        g = self.trainer.version
        ids = batch.column("rollout_id").to_pylist()
        row_versions = batch.column("policy_version").to_numpy()
        window.ages.append(step_before - row_versions)
        gaps = uses.draw(ids, step=step_before)
        window.gaps.extend(float(gap) for gap in gaps)
        first_uses = sum(1 for gap in gaps if gap < 0)
        window.first_uses += first_uses
        self.unused.rows -= first_uses  # sampled rows are of the mirrored version
        status.unused_rows = self.unused.rows
        status.buffer_version = version
        window.uses += len(ids)
        window.stats.extend(stats)
        window.usage.append(
            usage_rows(
                lineage=self.cfg.lineage,
                iteration=g,
                train_step=0,
                rollout_id=ids,
                policy_version_at_use=step_before,
                rollout_policy_version=row_versions,
            )
        )
        status.row_uses += len(ids)
        return g

    def publish(self, final: bool) -> None:
        """Usage of the steps since the last publication in one commit, the queue's used rows
        deleted, weights published, a full checkpoint when due, metrics and evaluations.
        Its seconds are ledger parts of their own, not busy time: sending the weights
        (`send_seconds`) and the rest (`publish_seconds`)."""
        start = time.perf_counter()
        try:
            self._publish(final)
        finally:
            self.status.publish_seconds += time.perf_counter() - start - self.send_seconds

    def _publish(self, final: bool) -> None:
        cfg, paths, g = self.cfg, self.paths, self.trainer.version
        if self.window.usage:
            usage = pa.concat_tables(self.window.usage)
        else:
            usage = USAGE_SCHEMA.empty_table()
        if self.window.usage or g > self.last_logged_step:
            self.buf.log_usage(usage, iteration=self.last_logged_step + 1, last_iteration=g)
        if self.on_policy:
            ids = self.mirror.rows(["rollout_id"]).column("rollout_id").to_pylist()
            used = [rid for rid in ids if rid in self.uses.count]
            if used:
                self.buf.discard(used)
        workers = board.read_workers(paths, cfg.asynchronous.workers)
        record = board.Published(
            version=g,
            published_at=time.time(),
            cumulative_seconds=self.cumulative_seconds(),
            cumulative_generated_tokens=sum(w.generated_tokens for w in workers),
        )
        self.send_seconds = 0.0
        if g > 0 and self.weights is not None:
            # Sent before the files are written, announced (`point_to`) only after both: a
            # worker applies it only once the pointer names this very publication.
            delivery = self.weights.send(
                g, self.trainer.named_weights(), published_at=record.published_at
            )
            self.send_seconds = delivery.seconds
            self.status.send_seconds += delivery.seconds
            self.status.sends += 1
            self.status.send_failures += int(delivery.error is not None)
        publication = None
        if g > 0 and not _published_by_this_epoch(paths, g):
            # In the background but for the segment's last: the trainer goes on training
            # while the copy is written and uploaded (at most one in flight).
            publication = self.trainer.save(
                board.weights_uri(paths, g), weights_only=True, background=not final
            )
        if final or g % (cfg.train.checkpoint_every * cfg.train.steps_per_iteration) == 0:
            self.state = _full_checkpoint(cfg, paths, self.state, self.trainer, record)
            # Its evaluation comes later, from the evaluator: the logged model links the
            # metrics the run has at its step by then (none, usually).
            from replayrl.engine.iteration import log_checkpoint_model

            log_checkpoint_model(cfg, paths, self.tracker, self.state)
        self._announce_pending(wait=True)  # the one before (its upload ended before this save)
        if publication is not None and not publication.done():
            self.pending = (publication, record)
        else:
            board.point_to(paths, record)
        self.status.gradient_step = g
        board.write_trainer(paths, self.status)
        run_id = self.state.mlflow_run_id
        for w in workers:  # what generated the rows, for `compare` (one tag, as sync runs)
            self.tracker.record_accelerator(run_id, w.accelerator, w.accelerators)
        _log(cfg, paths, self.tracker, run_id, self.window, self.uses, record, self.status, workers)
        _log_evals(cfg, paths, self.tracker, run_id, self.logged_evals, up_to=g)
        _prune_published(cfg, paths, keep_from=g)
        self.last_logged_step = g
        self.window = _Window()


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


def pass_batch(rows: pa.Table, drawn: set[str], b: int, rng: np.random.Generator) -> pa.Table:
    """buffer.sample_mode "epoch": B of the buffer's `rows` drawn uniformly among those not drawn in
    the current pass (`drawn`, updated); when fewer than B are left, they all go in and the
    rest of the batch starts a new pass, so no batch repeats a row (as `sampling.epoch_draw`
    does for the synchronous loops). Rows that left the buffer leave `drawn`."""
    ids = rows.column("rollout_id").to_pylist()
    drawn.intersection_update(ids)
    left = np.array([i for i, rid in enumerate(ids) if rid not in drawn], dtype=np.int64)
    if left.size >= b:
        pick = rng.choice(left, size=b, replace=False)
        drawn.update(ids[i] for i in pick)
        return rows.take(pa.array(pick))
    # The old pass's last rows, then a new pass's first, none of them again in this batch.
    rest = np.setdiff1d(np.arange(len(ids)), left)
    new_pass = rng.choice(rest, size=b - left.size, replace=False)
    drawn.clear()
    drawn.update(ids[i] for i in new_pass)
    return rows.take(pa.array(np.concatenate([left, new_pass])))


def _retain(cfg: RunConfig, buf: ReplayBuffer, *, current_step: int) -> None:
    """The shared retention (`record.retain`): versions are gradient steps here, so
    max_staleness (in iterations of S steps) is counted as K x S steps."""
    from replayrl.engine.record import retain

    retain(
        cfg,
        buf,
        current_policy_version=current_step,
        versions_per_iteration=cfg.train.steps_per_iteration,
        vacuum_grace_s=cfg.buffer.vacuum_grace_s,
    )


def _full_checkpoint(cfg, paths, state, trainer, record: board.Published):
    """Weights, optimizer and RNG state at checkpoints/v{g}, then state.json points at it
    (`record.checkpoint_record`), then `record.after_checkpoint`, as in the inline engine."""
    from dataclasses import replace

    from replayrl.engine.record import after_checkpoint, checkpoint_record

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
    after_checkpoint(cfg, paths, checkpoint=new.checkpoint)
    return new


def _published_by_this_epoch(paths: LineagePaths, version: int) -> bool:
    """Whether version `version` is published by this epoch's run (or a newer one): an earlier
    attempt of this trainer that died before moving the pointer. A version a stale owner
    published (a lower epoch) is published again."""
    uri = board.weights_uri(paths, version)
    if not storage.is_complete(uri):
        return False
    return storage.read_manifest(uri).epoch >= fencing.epoch_for(uri)


def _prune_published(cfg: RunConfig, paths: LineagePaths, *, keep_from: int) -> None:
    """Delete published weights older than the newest two, except versions due for
    evaluation that are not evaluated yet and versions a role is loading or generating with
    (`board.versions_in_use`: each says so before it reads a byte)."""
    fencing.check(paths.root, "prune published weights")
    versions = [v for v in board.published_versions(paths) if v < keep_from]
    due = set(eval_due_versions(cfg, up_to=keep_from))
    in_use = board.versions_in_use(paths, cfg.asynchronous.workers)
    for v in versions[:-1]:
        if v in in_use or (v in due and board.read_eval(paths, v) is None):
            continue
        storage.delete(board.weights_uri(paths, v))
