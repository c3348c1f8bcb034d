"""How the buffer writes and reads its Delta tables, shared by `table`, `sampling`,
`maintenance` and `mirror`: the Parquet settings of every data file it writes, the retry of
a commit that lost a race with a concurrent writer, the fencing epoch every commit is
stamped with (`commit_properties`, `commit_epochs`), the errors a read or a write raises,
and the canonical row order (independent of file layout).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, WriterProperties
from deltalake.exceptions import CommitFailedError, DeltaError

from replayrl.storage import objects

T = TypeVar("T")

# Rows per Parquet row group in every file the buffer writes (append, delete, bin-pack).
# delta-rs's default is ~1M rows, so a compacted file is one huge row group, and a scan
# decodes (and pre-buffers) a whole row group of every column it reads at once: sampling
# 4,096 rows from a 1M-row buffer then peaked at ~270 MB over the open buffer; with 8k-row
# groups, ~100 MB (bench/bench_sampling.py). Small enough to stream, large enough that
# the per-group footer and statistics stay negligible.
ROW_GROUP_ROWS = 8192
# A commit that lost a race with a concurrent writer is redone this many times, after a short
# randomised pause, before the conflict is reported.
COMMIT_ATTEMPTS = 8
# Canonical row order for sampling, independent of file layout.
CANONICAL_ORDER = [("iteration", "ascending"), ("rollout_id", "ascending")]

STORAGE_ERRORS = (DeltaError, OSError)
# A damaged Parquet file surfaces from pyarrow's reader as ArrowInvalid (a ValueError).
READ_ERRORS = (DeltaError, OSError, pa.ArrowException)


def data_filesystem(table_uri: str, storage_options: dict[str, str] | None) -> pafs.FileSystem:
    """The file system a table's data files are read through (datasets and fragments take
    paths relative to the table): pyarrow's own, with the buffer's S3 settings, never
    delta-rs's Python `DeltaStorageHandler`, whose calls from pyarrow's IO threads abort a
    process that exits just after a read (`storage.objects.folder_filesystem`)."""
    return objects.folder_filesystem(table_uri, storage_options)


def retry_conflicts(commit: Callable[[], T], *, refresh: Callable[[], object] | None = None) -> T:
    """`commit()`, redone after `refresh()` when a concurrent writer's commit won the race
    (`CommitFailedError`); the callers' writes are idempotent (replace-where, delete by key)."""
    for attempt in range(COMMIT_ATTEMPTS):
        try:
            return commit()
        except CommitFailedError:
            if attempt == COMMIT_ATTEMPTS - 1:
                raise
            time.sleep(random.uniform(0.01, 0.05) * (attempt + 1))
            if refresh is not None:
                refresh()
    raise AssertionError("unreachable: the last attempt returns or raises")


def writer_properties() -> WriterProperties:
    """The Parquet writer settings of every data file the buffer writes."""
    return WriterProperties(max_row_group_size=ROW_GROUP_ROWS)


def sql_str(value: str) -> str:
    """`value` as a SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


# The commitInfo key every fenced commit carries: the fencing epoch of the writer's lease.
EPOCH_KEY = "replayrl.epoch"


def commit_properties(epoch: int) -> CommitProperties:
    """Properties of a commit made under fencing `epoch`: stamped with the epoch, and never
    rebased by delta-rs onto a version it did not read (`max_commit_retries=0`): a commit
    whose next version another writer took fails, and the caller decides (its own epoch's
    writer: retry; a stale owner's: undo it; a newer owner's: stop)."""
    return CommitProperties(custom_metadata={EPOCH_KEY: str(epoch)}, max_commit_retries=0)


def commit_epochs(table: DeltaTable, *, after: int) -> list[tuple[int, int | None]]:
    """(version, fencing epoch or None when unstamped) of each commit of `table` (a snapshot
    at its latest version) after version `after`, oldest first."""
    newer = table.version() - after
    if newer <= 0:
        return []
    out = []
    for entry in table.history(limit=newer):
        raw = entry.get(EPOCH_KEY)
        try:
            epoch = None if raw is None else int(raw)
        except (TypeError, ValueError):
            epoch = None
        out.append((int(entry["version"]), epoch))
    return sorted(out)
