"""A snapshot of the buffer at one version, for logging: `BufferStats`, and `stats`, which is
`ReplayBuffer.stats` (`self` is the buffer): rows, files and bytes of the rollouts table, the
age histogram of its rows, how often each was used (from the usage log), mean reward and
fraction correct.

Only reads, through the buffer's own `_open` and `_scan`; knows nothing about where the
numbers are logged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from replayrl.buffer.table import ReplayBuffer


@dataclass(frozen=True)
class BufferStats:
    """A snapshot of the buffer at one version, for logging."""

    version: int
    rows: int
    files: int
    bytes: int  # sum of the data file sizes of that version
    age_histogram: dict[int, int]  # age in policy versions -> rows
    reuse_counts: dict[int, int]  # times used in a gradient step -> rows (0 included)
    mean_reward: float  # NaN when the buffer is empty
    frac_correct: float  # NaN when the buffer is empty

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _mean(column: pa.ChunkedArray) -> float:
    """Mean of the non-null values, NaN when there are none."""
    value = pc.mean(column).as_py()
    return math.nan if value is None else float(value)


def stats(
    self: ReplayBuffer,
    *,
    current_policy_version: int,
    version: int | None = None,
    include_reuse: bool = True,
) -> BufferStats:
    """Rows, files, bytes, age histogram, reuse counts (from the usage log), mean reward
    and fraction correct of the rollouts table at `version` (latest when None).
    `include_reuse=False` skips reading the usage log (reuse_counts is then empty)."""
    table = self._open(self.rollouts_uri, version=version)
    rows = self._scan(
        table, columns=["rollout_id", "iteration", "policy_version", "reward", "correct"]
    )
    actions = pa.table(table.get_add_actions(flatten=True))
    ages = current_policy_version - rows.column("policy_version").to_numpy(zero_copy_only=False)
    age_values, age_counts = np.unique(ages[~np.isnan(ages)].astype(np.int64), return_counts=True)

    uses = np.zeros(rows.num_rows, dtype=np.int64)  # (rows,)
    if include_reuse and rows.num_rows and self._latest_version(self.usage_uri) is not None:
        # A row cannot be used before it was generated: usage files of older iterations
        # are skipped by their statistics instead of scanning the whole log.
        oldest = pc.min(rows.column("iteration")).as_py()
        usage = self._scan(
            self._open(self.usage_uri),
            columns=["rollout_id"],
            filter=pc.field("iteration") >= oldest,
        )
        per_id = usage.group_by("rollout_id").aggregate([("rollout_id", "count")])
        where = pc.index_in(rows.column("rollout_id"), value_set=per_id.column("rollout_id"))
        counts = per_id.column("rollout_id_count").take(where)
        uses = pc.fill_null(counts, 0).to_numpy(zero_copy_only=False).astype(np.int64)
    use_values, use_counts = np.unique(uses, return_counts=True)

    return BufferStats(
        version=table.version(),
        rows=rows.num_rows,
        files=actions.num_rows,
        bytes=int(pc.sum(actions.column("size_bytes")).as_py() or 0),
        age_histogram={int(a): int(c) for a, c in zip(age_values, age_counts, strict=True)},
        reuse_counts=(
            {int(u): int(c) for u, c in zip(use_values, use_counts, strict=True)}
            if include_reuse
            else {}
        ),
        mean_reward=_mean(rows.column("reward")),
        frac_correct=_mean(pc.cast(rows.column("correct"), pa.float64())),
    )
