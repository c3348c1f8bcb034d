"""Sampling the replay buffer: batches of rows drawn from one pinned version of the rollouts
table (`ReplayBuffer.sample` delegates to `sample`).

`draw` turns a row count and a seed into canonical row indices, the same for every reader:
`sample` reads the key columns of every row, draws, then fetches only the drawn rows;
`replayrl.buffer.mirror.BufferMirror.sample` makes the same draw from memory. Rows are
indexed in canonical order (iteration, then rollout_id), so a bin-pack or any other file
layout change never changes what a seed draws.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from replayrl.buffer.delta import CANONICAL_ORDER
from replayrl.errors import ReplayRLError

if TYPE_CHECKING:
    from replayrl.buffer.table import ReplayBuffer

SAMPLE_MODES = ("uniform", "epoch")


def check_sample_args(*, batch_size: int, num_batches: int, mode: str, replace: bool) -> None:
    """The argument checks `sample` makes before touching any data."""
    if mode not in SAMPLE_MODES:
        raise ReplayRLError(f"unknown sample mode {mode!r}: use one of {list(SAMPLE_MODES)}")
    if batch_size < 1 or num_batches < 1:
        raise ReplayRLError(
            f"batch_size and num_batches must be >= 1, got {batch_size} and {num_batches}"
        )
    if replace and mode == "epoch":
        raise ReplayRLError("replace=True contradicts mode='epoch' (each row at most once)")


def draw(
    n_rows: int,
    *,
    batch_size: int,
    num_batches: int,
    seed: int,
    mode: str,
    replace: bool,
    where: str,
) -> np.ndarray:
    """(num_batches, batch_size) canonical row indices of a sample of `n_rows` rows (see
    `ReplayBuffer.sample`), from `np.random.default_rng(seed)`: every reader of the buffer
    draws the same rows for the same version and seed. `where` names the version in errors."""
    if n_rows == 0:
        raise ReplayRLError(
            f"{where} holds no rollouts: append rows (generate) before training, or pin a "
            f"version that has some"
        )
    rng = np.random.default_rng(seed)
    if mode == "epoch":
        if batch_size > n_rows:
            raise ReplayRLError(
                f"epoch sampling needs batch_size ({batch_size}) <= the {n_rows} rows of "
                f"{where}: one batch has no repeats; lower batch_size, generate more rows, or "
                f"use mode='uniform' with replace=True"
            )
        return epoch_draw(rng, n_rows, batch_size=batch_size, num_batches=num_batches)
    if batch_size > n_rows and not replace:
        raise ReplayRLError(
            f"batch_size {batch_size} exceeds the {n_rows} rows of {where}: lower batch_size "
            f"or pass replace=True"
        )
    return np.stack(
        [rng.choice(n_rows, size=batch_size, replace=replace) for _ in range(num_batches)]
    )  # (num_batches, batch_size)


def epoch_draw(
    rng: np.random.Generator, n_rows: int, *, batch_size: int, num_batches: int
) -> np.ndarray:
    """(num_batches, batch_size) row indices drawn without replacement across batches: passes
    over a fresh permutation of the n rows, each row once per pass, a new pass when one runs
    out. A batch that straddles two passes takes the new pass's rows it does not hold yet
    first, so no batch repeats a row (batch_size <= n_rows). With batch_size·num_batches <=
    n_rows it is one permutation cut into batches. n = 5, B = 2, 3 batches: [[a, b],
    [c, d], [e, x]] with x one of a..d, from the second pass."""
    chosen = np.empty((num_batches, batch_size), dtype=np.int64)
    pool, at = rng.permutation(n_rows), 0  # (n_rows,), the current pass and its next row
    for j in range(num_batches):
        k = 0
        while k < batch_size:
            if at == n_rows:
                fresh = rng.permutation(n_rows)
                held = np.isin(fresh, chosen[j, :k])
                pool, at = np.concatenate([fresh[~held], fresh[held]]), 0
            m = min(batch_size - k, n_rows - at)
            chosen[j, k : k + m] = pool[at : at + m]
            k, at = k + m, at + m
    return chosen


def sample(
    buf: ReplayBuffer,
    *,
    version: int,
    batch_size: int,
    num_batches: int,
    seed: int,
    mode: str,
    replace: bool,
    columns: list[str] | None,
) -> list[pa.Table]:
    """`ReplayBuffer.sample`: `num_batches` batches of `batch_size` rows of `version` of
    `buf`'s rollouts table. Only the key columns of all rows are read; the chosen rows are
    then fetched."""
    check_sample_args(batch_size=batch_size, num_batches=num_batches, mode=mode, replace=replace)
    buf._check_columns(columns)
    table = buf._open(buf.rollouts_uri, version=version)
    keys = buf._scan(table, columns=["iteration", "rollout_id"])
    # Canonical row i is keys[order[i]]; only the drawn rows are ever taken (a full
    # reordering take of a 1M-row key table costs as much as the sort).
    order = pc.sort_indices(keys, sort_keys=CANONICAL_ORDER)  # (rows,)
    where = f"version {version} of {buf.rollouts_uri}"
    chosen = draw(
        keys.num_rows,
        batch_size=batch_size,
        num_batches=num_batches,
        seed=seed,
        mode=mode,
        replace=replace,
        where=where,
    )  # (num_batches, batch_size) canonical row indices

    unique = np.unique(chosen)  # (distinct rows,) sorted, i.e. canonical order
    wanted = keys.take(order.take(pa.array(unique)))
    fetched = _fetch(buf, table, wanted, columns=columns, where=where)
    # Row i of `fetched` is canonical row unique[i]; map each draw to its position.
    positions = np.searchsorted(unique, chosen)  # (num_batches, batch_size)
    return [fetched.take(pa.array(batch)) for batch in positions]


def _fetch(
    buf: ReplayBuffer,
    table: DeltaTable,
    wanted: pa.Table,
    *,
    columns: list[str] | None,
    where: str,
) -> pa.Table:
    """`columns` (all when None) of the rows of `table` whose keys are `wanted` (distinct,
    canonical order), in that order."""
    # Files are pruned by iteration (int64 statistics); the ids are matched in memory.
    # A string filter cannot be pushed down: files a Delta delete rewrote store
    # rollout_id as string_view, and pyarrow cannot compare their statistics with a
    # string ("greater_equal has no kernel matching (string, string_view)").
    in_iterations = pc.field("iteration").isin(pc.unique(wanted.column("iteration")))
    needed_columns = None if columns is None else sorted(set(columns) | {"iteration", "rollout_id"})
    fetched = buf._scan(
        table,
        columns=needed_columns,
        filter=in_iterations,
        keep_ids=wanted.column("rollout_id"),
    )
    fetched = fetched.take(pc.sort_indices(fetched, sort_keys=CANONICAL_ORDER))
    if fetched.num_rows != wanted.num_rows:
        raise ReplayRLError(
            f"{where} has duplicate rollout_ids ({fetched.num_rows} rows fetched for "
            f"{wanted.num_rows} ids): rewrite the affected iterations with append(), which "
            f"keeps ids unique"
        )
    return fetched if columns is None else fetched.select(columns)
