"""Segments of `replayrl.buffer.mirror.BufferMirror`: single-chunk record batches of rows
in canonical order (iteration, then rollout_id), with disjoint, ascending iteration ranges.

Pure functions of record batches: where each segment starts (`bounds`), sorting
(`canonical`), cutting at iteration boundaries (`split`) and merging neighbours the way a
binary counter carries (`coalesce`), so a run of appends copies each row O(log) times.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from replayrl.buffer.delta import CANONICAL_ORDER
from replayrl.errors import ReplayRLError


def bounds(segments: list[pa.RecordBatch]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, last, starts) of non-empty, canonically sorted segments."""
    first = np.array([s.column("iteration")[0].as_py() for s in segments], dtype=np.int64)
    last = np.array([s.column("iteration")[-1].as_py() for s in segments], dtype=np.int64)
    starts = np.zeros(len(segments) + 1, dtype=np.int64)  # (segments + 1,)
    np.cumsum([s.num_rows for s in segments], out=starts[1:])
    return first, last, starts


def one_batch(table: pa.Table | pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """`table` as one record batch (a take from a many-chunk table concatenates first)."""
    if isinstance(table, pa.RecordBatch):
        return table
    batches = table.to_batches()
    if not batches:
        return pa.RecordBatch.from_pylist([], schema=schema)
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)


def canonical(rows: pa.Table | pa.RecordBatch) -> pa.RecordBatch:
    """`rows` in canonical order, as one batch."""
    batch = one_batch(rows, rows.schema)
    return batch.take(pc.sort_indices(batch, sort_keys=CANONICAL_ORDER))


def check_unique_neighbours(batch: pa.RecordBatch, *, uri: str, version: int) -> None:
    """Raise when two adjacent rows of a canonically sorted batch share a rollout_id."""
    if batch.num_rows < 2:
        return
    ids = batch.column("rollout_id")
    same = pc.equal(ids.slice(1), ids.slice(0, batch.num_rows - 1))  # (rows - 1,)
    if pc.any(same).as_py():
        first = pc.index(same, True).as_py()
        raise ReplayRLError(
            f"version {version} of {uri} has duplicate rollout_ids (e.g. "
            f"{ids[first].as_py()!r}): rewrite the affected iterations with append(), which "
            f"keeps ids unique"
        )


def split(batch: pa.RecordBatch, cap: int) -> list[pa.RecordBatch]:
    """`batch` (canonical order) cut at iteration boundaries into pieces of at most `cap`
    rows; an iteration larger than `cap` stays whole. Slices: nothing is copied."""
    if batch.num_rows <= cap:
        return [batch]
    iteration = batch.column("iteration").to_numpy()  # (rows,)
    boundaries = np.flatnonzero(iteration[1:] != iteration[:-1]) + 1  # (changes,)
    boundaries = np.append(boundaries, batch.num_rows)
    pieces, start = [], 0
    while start < batch.num_rows:
        # The furthest boundary within cap rows of start, else the first one after start.
        i = np.searchsorted(boundaries, start + cap, side="right") - 1
        end = int(boundaries[i]) if i >= 0 and boundaries[i] > start else None
        if end is None:
            end = int(boundaries[np.searchsorted(boundaries, start, side="right")])
        pieces.append(batch.slice(start, end - start))
        start = end
    return pieces


def coalesce(segments: list[pa.RecordBatch], cap: int) -> list[pa.RecordBatch]:
    """Merge neighbours the way a binary counter carries: pushing segments left to right,
    the top two merge while together they fit in `cap` rows and the left one holds at most
    twice the rows of the right one. Neighbours left apart either fill `cap` together or
    shrink by half or more towards the end, so there are O(rows / cap + log cap) segments;
    a new iteration past the last merges with a tail of comparable size only, so its rows
    are copied O(log cap) times in all instead of the last segment being copied on every
    append. Idempotent: a list it returned comes back unchanged (and uncopied)."""
    groups: list[list[pa.RecordBatch]] = []
    sizes: list[int] = []
    for segment in segments:
        groups.append([segment])
        sizes.append(segment.num_rows)
        while len(groups) > 1 and sizes[-2] + sizes[-1] <= cap and sizes[-2] <= 2 * sizes[-1]:
            right, rows = groups.pop(), sizes.pop()
            groups[-1].extend(right)
            sizes[-1] += rows
    return [group[0] if len(group) == 1 else pa.concat_batches(group) for group in groups]
