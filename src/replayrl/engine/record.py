"""The record path's shared pieces, which every engine calls: retention, the usage log with
its staleness, and what a full checkpoint records and leaves behind.

- `retain`: FIFO capacity, positive bias and max staleness, then bin-packing;
- `log_uses`: one usage row per use of a rollout (`replayrl.buffer.schema.usage_rows`), with
  the ages and steps since last use of those uses (`replayrl.core.staleness`);
- `checkpoint_record`: what `state.json` says of a full checkpoint;
- `after_checkpoint`: pruning old checkpoints and vacuuming the buffer once the state points
  at a new one.

The inline and Kubeflow engines call them through `replayrl.engine.steps` and
`replayrl.engine.iteration.record_iteration`; the asynchronous trainer calls them directly at its
own cadence (`replayrl.engine.asynchronous.trainer`). Metric names and the statistics built from
these numbers are `replayrl.engine.metric_schema`'s.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replayrl import storage
from replayrl.buffer.schema import usage_rows
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import RunConfig
from replayrl.core import clock
from replayrl.core.staleness import gradient_step, sample_ages, steps_since_last_use
from replayrl.engine.inputs import replay_buffer
from replayrl.engine.resources import TaskResources
from replayrl.storage import LineagePaths

log = logging.getLogger(__name__)


def retain(
    cfg: RunConfig,
    buf: ReplayBuffer,
    *,
    current_policy_version: int,
    versions_per_iteration: int = 1,
    vacuum_grace_s: float | None = None,
):
    """Retention (FIFO capacity, positive bias, max staleness) and bin-packing, as every
    engine applies it. `versions_per_iteration`: policy versions per iteration, S where a
    version is a gradient step (the asynchronous engine), so max_staleness (in iterations)
    is counted as K x S versions. `vacuum_grace_s`: None = no vacuum (the synchronous
    engines vacuum only after a full checkpoint, `after_checkpoint`)."""
    b = cfg.buffer
    return buf.compact(
        capacity=b.capacity,
        positive_bias=b.positive_bias,
        max_staleness=None if b.max_staleness is None else b.max_staleness * versions_per_iteration,
        current_policy_version=current_policy_version,
        target_file_bytes=b.target_file_bytes,
        min_files_to_compact=b.compact_min_files,
        vacuum_grace_s=vacuum_grace_s,
    )


@dataclass(frozen=True)
class Uses:
    """What logging one record's uses gave: the usage table's new version, and per use its
    age and steps since its row's last use (-1: never), in gradient steps."""

    usage_version: int
    ages: np.ndarray  # (uses,)
    gaps: np.ndarray  # (uses,)
    clocks: clock.Clocks  # the seconds it took, both clocks


def log_uses(
    cfg: RunConfig,
    paths: LineagePaths,
    buf: ReplayBuffer,
    batches: list[pa.Table],
    *,
    iteration: int,
    policy_version: int,
) -> Uses:
    """Log one usage row per row drawn in `batches` (the k-th batch is the iteration's
    gradient step k), after checking that the iteration is still open."""
    start = clock.now()
    used = pa.concat_tables(batches)
    train_step = np.repeat(np.arange(len(batches)), [b.num_rows for b in batches])  # (uses,)
    ages, gaps = _staleness(
        buf,
        used,
        train_step,
        iteration=iteration,
        policy_version=policy_version,
        steps_per_iteration=cfg.train.steps_per_iteration,
    )
    usage = usage_rows(
        lineage=cfg.lineage,
        iteration=iteration,
        train_step=train_step,
        rollout_id=used.column("rollout_id"),
        policy_version_at_use=policy_version,
        rollout_policy_version=used.column("policy_version"),
    )
    storage.check_iteration_open(paths, iteration=iteration)
    usage_version = buf.log_usage(usage, iteration=iteration)
    return Uses(usage_version, ages, gaps, clock.since(start))


def _staleness(
    buf: ReplayBuffer,
    used: pa.Table,
    train_step: np.ndarray,
    *,
    iteration: int,
    policy_version: int,
    steps_per_iteration: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(ages in gradient steps of every use, steps since each use's row was last used) of this
    iteration's draws `used` (one row per use, `train_step` the step of each), with the
    earlier uses of the drawn rows read from the usage log (replayrl.core.staleness)."""
    s = steps_per_iteration
    ages = sample_ages(
        row_policy_version=used.column("policy_version").to_numpy(),
        policy_version_at_use=policy_version,
        train_step=train_step,
        steps_per_iteration=s,
    )  # (uses,)
    ids = used.column("rollout_id")
    history = buf.usage_of(
        pc.unique(ids),
        first_iteration=pc.min(used.column("iteration")).as_py(),
        before_iteration=iteration,
    )
    gaps = steps_since_last_use(
        rollout_id=ids.to_numpy(zero_copy_only=False),
        step=gradient_step(
            policy_version=policy_version, train_step=train_step, steps_per_iteration=s
        ),
        history_id=history.column("rollout_id").to_numpy(zero_copy_only=False),
        history_step=gradient_step(
            policy_version=history.column("policy_version_at_use").to_numpy(),
            train_step=history.column("train_step").to_numpy(),
            steps_per_iteration=s,
        ),
    )  # (uses,)
    return ages, gaps


def checkpoint_record(
    *,
    iteration: int,
    policy_version: int,
    ledger: dict[str, float],
    rollouts_version: int | None = None,
    usage_version: int | None = None,
) -> dict:
    """What `state.json` says of a full checkpoint (see `LineageState.checkpoint`)."""
    return {
        "iteration": iteration,
        "policy_version": policy_version,
        "rollouts_version": rollouts_version,
        "usage_version": usage_version,
        "ledger": dict(ledger),
    }


def after_checkpoint(
    cfg: RunConfig,
    paths: LineagePaths,
    *,
    checkpoint: dict,
    resources: TaskResources | None = None,
) -> float:
    """Once the state points at a new full checkpoint (`checkpoint`, its record in the
    state): delete checkpoints older than the newest `train.keep_checkpoints` (never v0 or
    this one) and vacuum buffer files unreferenced for longer than `buffer.vacuum_grace_s`.
    Earlier would be unsafe: a crash rewinds to the previous checkpoint, whose files and
    buffer version must still be there. The vacuum is skipped when either table moved past
    the version the checkpoint pairs with (another writer, e.g. a run that lost the race for
    this iteration): the rewind target's files must stay. Returns the seconds it took."""
    start = time.perf_counter()
    storage.prune_checkpoints(
        paths, keep=cfg.train.keep_checkpoints, protect={0, checkpoint["policy_version"]}
    )
    paired = (checkpoint["rollouts_version"], checkpoint["usage_version"])
    if paired == (None, None):
        # Not paired with buffer versions (the asynchronous engine: its buffer is never
        # rewound, and its retention vacuums).
        return time.perf_counter() - start
    buf = replay_buffer(paths, resources)
    if buf.version() is not None and (buf.version(), buf.usage_version()) == paired:
        buf.vacuum(
            grace_s=cfg.buffer.vacuum_grace_s,
            keep_versions={"rollouts": paired[0], "usage": paired[1]},
        )
    elif buf.version() is not None:
        log.warning(
            "buffer of %s moved past the checkpoint's versions %s: not vacuumed",
            paths.root,
            paired,
        )
    return time.perf_counter() - start
