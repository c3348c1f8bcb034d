"""The experience replay buffer: two Delta Lake tables under one root URI.

`<root>/rollouts` holds one row per completion (`replayrl.buffer.schema.ROLLOUT_SCHEMA`);
`<root>/usage` holds one row per use of a rollout in a gradient step (`USAGE_SCHEMA`).
Generation appends an iteration's rows in one commit (a retried iteration replaces its own
rows, so retries are idempotent); `compact` applies retention (`replayrl.buffer.retention`),
bin-packs small files and vacuums old ones; training pins the version `compact` returns and
samples from that snapshot only, so later appends and compactions never change what a
pinned version holds until its files are vacuumed (after `vacuum_grace_s`).

Concurrency and failure, from delta-rs's transaction log: every write is one atomic commit.
A crashed `append` leaves the previous version intact (its half-written Parquet files are
unreferenced and removed by a later vacuum). A crashed `compact` leaves the rows it meant
to delete in place; the next `compact` deletes them. Writers are serialised by the log: a
commit that conflicts with a concurrent one (the asynchronous engine's workers append while
its trainer deletes) is retried on the newer version, a few times, then fails with a
`ReplayRLError`; every write here is idempotent, so a retry never duplicates a row.
On S3 a commit is a put-if-absent of the next log entry, so concurrent writers from several
processes or machines never overwrite each other's commits; requests to an unreachable
store are retried by delta-rs as `storage_options` say (see `storage.delta_storage_options`).

A data file that is missing, truncated or not Parquet makes reads fail with a
`ReplayRLError` naming the file; `check` lists such files and `repair` moves them to
`<root>/quarantine/` and drops them from the table (`replayrl.buffer.repair`), keeping every
other row. `vacuum` removes files no version newer than the grace period needs.

This module knows nothing about models, rewards or how rows are generated; it knows the
storage URI it is given and passes `storage_options` to delta-rs untouched. delta-rs is
not fork-safe: use the "spawn" start method for any multiprocessing after importing this.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, WriterProperties, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from replayrl.buffer.repair import DamagedFile, damaged_files, quarantine
from replayrl.buffer.retention import retention_parts
from replayrl.buffer.schema import ROLLOUT_SCHEMA, USAGE_SCHEMA, validate_rollouts, validate_usage
from replayrl.errors import ReplayRLError
from replayrl.storage.s3 import classify, explain

SAMPLE_MODES = ("uniform", "epoch")
# Columns retention needs; compact never reads prompts, completions or token ids.
_RETENTION_COLUMNS = ["iteration", "rollout_id", "policy_version", "correct"]
# Canonical row order for sampling, independent of file layout.
_CANONICAL_ORDER = [("iteration", "ascending"), ("rollout_id", "ascending")]
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


def _retry_conflicts(commit, *, refresh=None):
    """`commit()`, redone after `refresh()` when a concurrent writer's commit won the race
    (`CommitFailedError`); the callers' writes are idempotent (replace-where, delete by key)."""
    import random

    for attempt in range(COMMIT_ATTEMPTS):
        try:
            return commit()
        except CommitFailedError:
            if attempt == COMMIT_ATTEMPTS - 1:
                raise
            time.sleep(random.uniform(0.01, 0.05) * (attempt + 1))
            if refresh is not None:
                refresh()


def writer_properties() -> WriterProperties:
    """The Parquet writer settings of every data file the buffer writes."""
    return WriterProperties(max_row_group_size=ROW_GROUP_ROWS)


_STORAGE_ERRORS = (DeltaError, OSError)
# A damaged Parquet file surfaces from pyarrow's reader as ArrowInvalid (a ValueError).
_READ_ERRORS = (DeltaError, OSError, pa.ArrowException)


@dataclass(frozen=True)
class CompactReport:
    """What one `compact` did. `version` is the rollouts table version to pin for training."""

    version: int
    rows_before: int
    rows_after: int
    rows_deleted: int
    files_before: int
    files_after: int
    files_compacted: int  # data files rewritten by the bin-pack; 0 when it was skipped
    files_vacuumed: int  # rollouts data files removed from storage by vacuum
    usage_files_compacted: int
    usage_files_vacuumed: int
    seconds: float
    # The rows kept only for the positive bias (correct rows older than the FIFO part):
    # how many, and their generating policy versions' oldest and mean (None and NaN when
    # there are none).
    bias_rows: int = 0
    bias_oldest_policy_version: int | None = None
    bias_mean_policy_version: float = math.nan

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


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


def _sql_str(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _delete_predicate(
    *, iteration: np.ndarray, rollout_id: np.ndarray, correct: np.ndarray, keep: np.ndarray
) -> str:
    """One SQL predicate matching exactly the rows with keep=False, kept short: whole
    iterations as `iteration IN (...)`; an iteration whose incorrect rows all go (positive
    bias) as `(iteration = k AND (correct IS NULL OR NOT correct))`; other partly dropped iterations list the
    shorter of the dropped ids (`IN`) and the kept ids (`NOT IN`).

    Args:
        iteration: (rows,) int. rollout_id: (rows,) str. correct: (rows,) bool, null as
            False. keep: (rows,) bool, from `retained_mask`.
    """
    whole: list[int] = []
    partial: list[str] = []
    for it in np.unique(iteration[~keep]):
        in_iteration = iteration == it  # (rows,)
        dropped = in_iteration & ~keep  # (rows,)
        kept = in_iteration & keep  # (rows,)
        if not kept.any():
            whole.append(int(it))
        elif np.array_equal(dropped, in_iteration & ~correct):
            partial.append(f"(iteration = {int(it)} AND (correct IS NULL OR NOT correct))")
        else:
            listed, op = (dropped, "IN") if dropped.sum() <= kept.sum() else (kept, "NOT IN")
            ids = ", ".join(_sql_str(str(r)) for r in rollout_id[listed])
            partial.append(f"(iteration = {int(it)} AND rollout_id {op} ({ids}))")
    clauses = ([f"iteration IN ({', '.join(map(str, whole))})"] if whole else []) + partial
    return " OR ".join(clauses)


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
        needed = batch_size * num_batches
        if needed > n_rows:
            raise ReplayRLError(
                f"epoch sampling needs batch_size * num_batches = {needed} rows but {where} "
                f"holds {n_rows}: lower either, generate more rows, or use mode='uniform'"
            )
        return rng.permutation(n_rows)[:needed].reshape(num_batches, batch_size)
    if batch_size > n_rows and not replace:
        raise ReplayRLError(
            f"batch_size {batch_size} exceeds the {n_rows} rows of {where}: lower batch_size "
            f"or pass replace=True"
        )
    return np.stack(
        [rng.choice(n_rows, size=batch_size, replace=replace) for _ in range(num_batches)]
    )  # (num_batches, batch_size)


class ReplayBuffer:
    """Rollouts and their usage log as Delta tables under `root_uri`.

    `root_uri` is a local path, a `file://` URI or `s3://bucket/prefix`; `storage_options`
    (endpoint, credentials, ...) go to delta-rs untouched. Nothing is created until the
    first `append` / `log_usage`.
    """

    def __init__(self, root_uri: str, *, storage_options: dict[str, str] | None = None):
        root = os.fspath(root_uri)
        if not root:
            raise ReplayRLError("buffer root URI is empty: pass a path, file:// or s3:// URI")
        self.root_uri = root.rstrip("/")
        self.storage_options = storage_options
        self.rollouts_uri = f"{self.root_uri}/rollouts"
        self.usage_uri = f"{self.root_uri}/usage"
        # Latest snapshot per table, refreshed with update_incremental (reads only new log
        # entries) instead of replaying the log on every call: opening costs ~20 ms.
        self._latest: dict[str, DeltaTable] = {}

    # ---- opening and error translation -------------------------------------------------

    def _open(self, uri: str, *, version: int | None = None) -> DeltaTable:
        """Open `uri` at `version` (latest when None), translating delta-rs errors."""
        try:
            cached = self._latest.get(uri)
            if cached is not None:
                cached.update_incremental()
                if version is None or cached.version() == version:
                    return cached
            if version is None:
                table = DeltaTable(uri, storage_options=self.storage_options)
                self._latest[uri] = table
                return table
            return DeltaTable(uri, version=version, storage_options=self.storage_options)
        except TableNotFoundError as e:
            raise ReplayRLError(
                f"no Delta table at {uri}: append rows first (ReplayBuffer.append / "
                f"log_usage), or check the root URI and storage credentials: {e}"
            ) from e
        except _STORAGE_ERRORS as e:
            if version is not None:
                latest = self._latest_version(uri)
                raise ReplayRLError(
                    f"version {version} of {uri} cannot be loaded (latest is {latest}): pin a "
                    f"version returned by append() or compact(): {e}"
                ) from e
            raise self._explain(e, action="read the Delta table", uri=uri) from e

    def _latest_version(self, uri: str) -> int | None:
        try:
            cached = self._latest.get(uri)
            if cached is not None:
                cached.update_incremental()
                return cached.version()
            table = DeltaTable(uri, storage_options=self.storage_options)
            self._latest[uri] = table
            return table.version()
        except TableNotFoundError:
            return None
        except _STORAGE_ERRORS as e:
            raise self._explain(e, action="read the Delta table", uri=uri) from e

    def _explain(self, e: BaseException, *, action: str, uri: str, hint: str = "") -> ReplayRLError:
        """A ReplayRLError for a delta-rs/pyarrow failure: wrong credentials, a missing bucket
        and an unreachable store get their own fix; anything else keeps `hint`."""
        options = self.storage_options or {}
        secrets = [options.get("AWS_SECRET_ACCESS_KEY", ""), options.get("AWS_SESSION_TOKEN", "")]
        if classify(e) in ("credentials", "bucket", "transient") or not hint:
            return explain(
                e, action=action, uri=uri, endpoint=options.get("AWS_ENDPOINT_URL"), secrets=secrets
            )
        detail = explain(e, action=action, uri=uri, endpoint=None, secrets=secrets)
        return ReplayRLError(f"{detail}. {hint}")

    def _damage_error(
        self, table: DeltaTable, e: BaseException, *, action: str
    ) -> ReplayRLError | None:
        """When `e` comes from damaged data files of `table`, an error naming them and the
        fix; None when every file is fine (the failure is something else)."""
        if classify(e) not in ("other", "missing"):
            return None  # credentials, bucket or an unreachable store: checking files cannot help
        try:
            name = table.table_uri.rstrip("/").rsplit("/", 1)[-1]
            damaged = damaged_files(table, name=name, storage_options=self.storage_options)
        except Exception:  # the check itself failed: report the original error instead
            return None
        if not damaged:
            return None
        latest = self._latest_version(table.table_uri)
        if table.version() != latest and all(d.problem == "missing" for d in damaged):
            return ReplayRLError(
                f"cannot {action} version {table.version()} of {table.table_uri}: "
                f"{len(damaged)} of its files were vacuumed (e.g. {damaged[0].path}); pin a newer "
                f"version (from compact()) or raise vacuum_grace_s"
            )
        listed = "; ".join(f"{d.path} {d.problem}" for d in damaged[:3])
        rows = sum(d.rows or 0 for d in damaged)
        return ReplayRLError(
            f"cannot {action} {table.table_uri}: {len(damaged)} data file(s) are damaged "
            f"({listed}). Run `replayrl buffer repair` for this lineage (ReplayBuffer.repair()): "
            f"it moves them to {self.root_uri}/quarantine/ and drops their {rows} row(s) from the "
            f"table; every other row is kept"
        )

    def _scan(
        self,
        table: DeltaTable,
        *,
        columns: list[str] | None,
        filter: pc.Expression | None = None,
        keep_ids: pa.Array | pa.ChunkedArray | None = None,
    ) -> pa.Table:
        """Read `columns` of `table`'s loaded version; missing files become a ReplayRLError.
        With `keep_ids`, only rows whose rollout_id is among them are kept, batch by batch, so
        memory holds the kept rows and one batch, never the whole table."""
        try:
            dataset = table.to_pyarrow_dataset()
            if keep_ids is None:
                return dataset.to_table(columns=columns, filter=filter)
            # Small batches and little read-ahead: a draw touches most files, and pyarrow's
            # defaults (batches of 128k rows, 16 batches and 4 files ahead) hold hundreds of MB
            # of a 1M-row table to save little time.
            scanner = dataset.scanner(
                columns=columns,
                filter=filter,
                batch_size=8192,
                batch_readahead=2,
                fragment_readahead=1,
            )
            kept = [
                batch.filter(pc.is_in(batch.column("rollout_id"), value_set=keep_ids))
                for batch in scanner.to_batches()
            ]
            return pa.Table.from_batches(kept, schema=scanner.projected_schema)
        except _READ_ERRORS as e:
            damage = self._damage_error(table, e, action="read")
            if damage is not None:
                raise damage from e
            raise self._explain(
                e,
                action=f"read version {table.version()} of",
                uri=table.table_uri,
                hint="If its files were vacuumed, pin a newer version (from compact()) or raise "
                "vacuum_grace_s",
            ) from e

    def _write_iteration(
        self, uri: str, rows: pa.Table, *, iteration: int, last_iteration: int | None = None
    ) -> int:
        """Replace the rows of iterations `iteration` .. `last_iteration` (default: just
        `iteration`) of table `uri` with `rows` in one commit; new version."""
        last = iteration if last_iteration is None else last_iteration
        if rows.num_rows:
            iterations = rows.column("iteration")
            outside = pc.or_(pc.less(iterations, iteration), pc.greater(iterations, last))
            wrong = pc.sum(pc.fill_null(outside, True)).as_py()
            if wrong:
                if last == iteration:
                    raise ReplayRLError(
                        f"{wrong} row(s) have an iteration other than {iteration}: write one "
                        f"iteration per call, with iteration={iteration} on every row"
                    )
                raise ReplayRLError(
                    f"{wrong} row(s) have an iteration outside {iteration}..{last}: write "
                    f"those iterations per call, with the iteration on every row"
                )
        if last == iteration:
            predicate = f"iteration = {int(iteration)}"
        else:
            predicate = f"iteration >= {int(iteration)} AND iteration <= {int(last)}"
        try:
            if self._latest_version(uri) is None:
                try:
                    write_deltalake(
                        uri,
                        rows,
                        mode="overwrite",
                        predicate=predicate,
                        storage_options=self.storage_options,
                        writer_properties=writer_properties(),
                    )
                    return self._open(uri).version()
                except DeltaError:
                    # Another process created the table at the same moment: write onto it.
                    if self._latest_version(uri) is None:
                        raise

            def write() -> int:
                table = self._open(uri)
                write_deltalake(
                    table,
                    rows,
                    mode="overwrite",
                    predicate=predicate,
                    writer_properties=writer_properties(),
                )
                return table.version()

            return _retry_conflicts(write)
        except _READ_ERRORS as e:
            cached = self._latest.get(uri)
            damage = None if cached is None else self._damage_error(cached, e, action="rewrite")
            if damage is not None:
                raise damage from e
            raise self._explain(
                e,
                action=f"write iteration {iteration} to",
                uri=uri,
                hint="Check the root URI is writable (permissions, credentials, bucket exists); "
                "the previous version is intact, so retrying is safe",
            ) from e

    # ---- writing -----------------------------------------------------------------------

    def append(self, rows: pa.Table, *, iteration: int) -> int:
        """Store `rows` (all of `iteration`) in one commit, replacing rows already stored for
        that iteration, so a retried generation leaves no duplicates. Returns the new
        rollouts table version. A crash leaves the previous version intact."""
        return self._write_iteration(
            self.rollouts_uri, validate_rollouts(rows), iteration=iteration
        )

    def log_usage(
        self, usage: pa.Table, *, iteration: int, last_iteration: int | None = None
    ) -> int:
        """Record which rollouts `iteration`'s gradient steps used (`USAGE_SCHEMA` rows),
        replacing what a previous attempt of that iteration logged; with `last_iteration`,
        the uses of iterations `iteration` .. `last_iteration` in one commit (the
        asynchronous trainer logs the gradient steps since its last publication so). Returns
        the new usage table version."""
        return self._write_iteration(
            self.usage_uri,
            validate_usage(usage),
            iteration=iteration,
            last_iteration=last_iteration,
        )

    def discard(self, rollout_ids: list[str]) -> int:
        """Delete the rows with these ids in one commit (the asynchronous on-policy queue
        drops the rows it used); retried after a concurrent append. Returns the new version."""
        table = self._open(self.rollouts_uri)
        if not rollout_ids:
            return table.version()
        predicate = f"rollout_id IN ({', '.join(_sql_str(str(r)) for r in rollout_ids)})"
        try:
            _retry_conflicts(
                lambda: table.delete(predicate, writer_properties=writer_properties()),
                refresh=table.update_incremental,
            )
        except _READ_ERRORS as e:
            raise self._explain(
                e,
                action="delete used rows from",
                uri=self.rollouts_uri,
                hint="The rows stay in place; the next discard deletes them",
            ) from e
        return self._open(self.rollouts_uri).version()

    def version(self) -> int | None:
        """Latest rollouts table version, or None when nothing was appended yet."""
        return self._latest_version(self.rollouts_uri)

    def usage_version(self) -> int | None:
        """Latest usage table version, or None when nothing was logged yet."""
        return self._latest_version(self.usage_uri)

    def restore(self, *, rollouts_version: int | None, usage_version: int | None) -> bool:
        """Bring both tables back to what they held at the given versions (None: no rows),
        each in one commit (Delta's restore, or a delete of every row), so rows written
        after those versions are gone and the data files of those versions are referenced
        again. A table that already holds exactly those files is left alone. Returns True
        when anything changed. A crash leaves each table at its old or restored state;
        running it again finishes the job. Fails with a ReplayRLError when a data file of
        the target version was vacuumed meanwhile."""
        changed = False
        for uri, version in (
            (self.rollouts_uri, rollouts_version),
            (self.usage_uri, usage_version),
        ):
            latest = self._latest_version(uri)
            if latest is None or latest == version:
                continue
            table = self._open(uri)
            try:
                if version is None:
                    if table.file_uris():
                        table.delete()
                        changed = True
                    continue
                target = DeltaTable(uri, version=version, storage_options=self.storage_options)
                if set(target.file_uris()) == set(table.file_uris()):
                    continue
                table.restore(version)
                changed = True
            except _STORAGE_ERRORS as e:
                raise self._explain(
                    e,
                    action=f"restore version {version} of",
                    uri=uri,
                    hint="Its data files may have been vacuumed (buffer.vacuum_grace_s); the "
                    "table is unchanged",
                ) from e
        return changed

    # ---- health and repair -------------------------------------------------------------

    def _tables(self) -> list[tuple[str, DeltaTable]]:
        return [
            (uri.rsplit("/", 1)[-1], self._open(uri))
            for uri in (self.rollouts_uri, self.usage_uri)
            if self._latest_version(uri) is not None
        ]

    def check(self) -> list[DamagedFile]:
        """Data files of the latest version of either table that are missing, truncated
        or not Parquet (empty when the buffer is healthy). Reads one footer per file."""
        try:
            return [
                d
                for name, table in self._tables()
                for d in damaged_files(table, name=name, storage_options=self.storage_options)
            ]
        except _STORAGE_ERRORS as e:
            raise self._explain(e, action="check", uri=self.root_uri) from e

    def repair(self, *, dry_run: bool = False) -> list[DamagedFile]:
        """Move damaged data files (see `check`) to `<root>/quarantine/<table>/` and commit
        their removal from the table, so reads work again; every other row stays. Returns
        the files set aside (with the rows each held). `dry_run` only lists them."""
        damaged = self.check()
        if dry_run or not damaged:
            return damaged
        try:
            for name, table in self._tables():
                mine = [d for d in damaged if d.table == name]
                if mine:
                    quarantine(
                        root_uri=self.root_uri,
                        table=table,
                        damaged=mine,
                        storage_options=self.storage_options,
                    )
        except _STORAGE_ERRORS as e:
            raise self._explain(
                e,
                action="repair",
                uri=self.root_uri,
                hint="Nothing was deleted: files already moved are under quarantine/; rerun repair",
            ) from e
        return damaged

    def vacuum(self, *, grace_s: float, dry_run: bool = False) -> dict[str, list[str]]:
        """Delete data files that no table version newer than `grace_s` seconds references
        (rounded up to whole hours, delta-rs's unit; 0 = every unreferenced file, which breaks
        readers pinned to older versions). Returns the files per table; `dry_run` only lists."""
        if grace_s < 0:
            raise ReplayRLError(f"grace_s must be >= 0 seconds, got {grace_s}")
        out = {}
        try:
            for name, table in self._tables():
                out[name] = list(
                    table.vacuum(
                        retention_hours=math.ceil(grace_s / 3600.0),
                        dry_run=dry_run,
                        enforce_retention_duration=False,
                    )
                )
        except _STORAGE_ERRORS as e:
            raise self._explain(e, action="vacuum", uri=self.root_uri) from e
        return out

    # ---- retention and maintenance -----------------------------------------------------

    def _pack_and_vacuum(
        self,
        table: DeltaTable,
        *,
        target_file_bytes: int,
        min_files_to_compact: int,
        vacuum_grace_s: float | None,
    ) -> tuple[int, int]:
        """Bin-pack small files when there are enough, then vacuum files unreferenced for
        longer than the grace period. Returns (files rewritten, files vacuumed)."""
        files_compacted = 0
        if len(table.file_uris()) >= min_files_to_compact:
            metrics = _retry_conflicts(
                lambda: table.optimize.compact(
                    target_size=target_file_bytes, writer_properties=writer_properties()
                ),
                refresh=table.update_incremental,
            )
            files_compacted = int(metrics.get("numFilesRemoved", 0))
        if vacuum_grace_s is None:
            return files_compacted, 0
        # delta-rs counts retention in whole hours: round up, so no file goes sooner than asked.
        retention_hours = math.ceil(vacuum_grace_s / 3600.0)
        vacuumed = table.vacuum(
            retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False
        )
        return files_compacted, len(vacuumed)

    def compact(
        self,
        *,
        capacity: int,
        positive_bias: float = 0.0,
        max_staleness: int | None = None,
        current_policy_version: int,
        target_file_bytes: int = 64 * 2**20,
        min_files_to_compact: int = 8,
        vacuum_grace_s: float | None = 3600.0,
    ) -> CompactReport:
        """Apply retention (`replayrl.buffer.retention.retention_parts`) in one delete commit (none when
        nothing is dropped), bin-pack the rollouts and usage tables to about
        `target_file_bytes` per file once they have `min_files_to_compact` files, and vacuum
        data files unreferenced for more than `vacuum_grace_s` (rounded up to whole hours,
        delta-rs's unit; 0 removes them now and breaks readers pinned to older versions;
        None skips the vacuum, e.g. while an older version must stay restorable).
        The usage table is never deleted from. A crash mid-way leaves every row in place or
        deleted as one commit; the next compact finishes the job.
        """
        if vacuum_grace_s is not None and vacuum_grace_s < 0:
            raise ReplayRLError(f"vacuum_grace_s must be >= 0 seconds, got {vacuum_grace_s}")
        if target_file_bytes < 1 or min_files_to_compact < 1:
            raise ReplayRLError(
                "target_file_bytes and min_files_to_compact must be >= 1, got "
                f"{target_file_bytes} and {min_files_to_compact}"
            )
        start = time.perf_counter()
        table = self._open(self.rollouts_uri)
        files_before = len(table.file_uris())
        keys = self._scan(table, columns=_RETENTION_COLUMNS)
        iteration = keys.column("iteration").to_numpy()  # (rows,)
        rollout_ids = keys.column("rollout_id").to_numpy()  # (rows,) str objects
        correct = keys.column("correct").fill_null(False).to_numpy()  # (rows,)
        # Dense ranks order like the id strings but let numpy sort integers, not objects.
        id_rank = pc.rank(keys.column("rollout_id"), tiebreaker="dense").to_numpy()  # (rows,)
        try:
            policy_version = keys.column("policy_version").fill_null(-(2**62)).to_numpy()
            fifo, bias = retention_parts(
                iteration=iteration,
                tiebreak=id_rank,
                policy_version=policy_version,
                correct=correct,
                capacity=capacity,
                positive_bias=positive_bias,
                max_staleness=max_staleness,
                current_policy_version=current_policy_version,
            )
        except ValueError as e:
            raise ReplayRLError(f"invalid buffer retention setting: {e}") from e
        keep = fifo | bias  # (rows,)
        bias_versions = policy_version[bias & (policy_version > -(2**62))]  # (bias rows,)
        try:
            if not keep.all():
                predicate = _delete_predicate(
                    iteration=iteration, rollout_id=rollout_ids, correct=correct, keep=keep
                )
                # By key: redone after a concurrent append, it deletes exactly these rows.
                _retry_conflicts(
                    lambda: table.delete(predicate, writer_properties=writer_properties()),
                    refresh=table.update_incremental,
                )
            files_compacted, files_vacuumed = self._pack_and_vacuum(
                table,
                target_file_bytes=target_file_bytes,
                min_files_to_compact=min_files_to_compact,
                vacuum_grace_s=vacuum_grace_s,
            )
            usage_compacted = usage_vacuumed = 0
            if self._latest_version(self.usage_uri) is not None:
                usage_compacted, usage_vacuumed = self._pack_and_vacuum(
                    self._open(self.usage_uri),
                    target_file_bytes=target_file_bytes,
                    min_files_to_compact=min_files_to_compact,
                    vacuum_grace_s=vacuum_grace_s,
                )
            final = self._open(self.rollouts_uri)
            rows_after = final.count()
            files_after = len(final.file_uris())
        except _READ_ERRORS as e:
            damage = self._damage_error(self._open(self.rollouts_uri), e, action="compact")
            if damage is None and self._latest_version(self.usage_uri) is not None:
                damage = self._damage_error(self._open(self.usage_uri), e, action="compact")
            if damage is not None:
                raise damage from e
            raise self._explain(
                e,
                action="compact",
                uri=self.root_uri,
                hint="Rows not yet deleted stay in place and the next compact deletes them "
                "(rerun it, or check the store is writable)",
            ) from e
        return CompactReport(
            version=final.version(),
            rows_before=keys.num_rows,
            rows_after=rows_after,
            rows_deleted=keys.num_rows - rows_after,
            files_before=files_before,
            files_after=files_after,
            files_compacted=files_compacted,
            files_vacuumed=files_vacuumed,
            usage_files_compacted=usage_compacted,
            usage_files_vacuumed=usage_vacuumed,
            seconds=time.perf_counter() - start,
            bias_rows=int(bias.sum()),
            bias_oldest_policy_version=int(bias_versions.min()) if bias_versions.size else None,
            bias_mean_policy_version=(
                float(bias_versions.mean()) if bias_versions.size else math.nan
            ),
        )

    # ---- reading -----------------------------------------------------------------------

    def read(self, *, version: int | None = None, columns: list[str] | None = None) -> pa.Table:
        """All rows of the rollouts table at `version` (latest when None), in canonical order
        (iteration, then rollout_id)."""
        self._check_columns(columns)
        table = self._open(self.rollouts_uri, version=version)
        needed = None if columns is None else sorted(set(columns) | {"iteration", "rollout_id"})
        rows = self._scan(table, columns=needed)
        rows = rows.take(pc.sort_indices(rows, sort_keys=_CANONICAL_ORDER))
        return rows if columns is None else rows.select(columns)

    def read_usage(self) -> pa.Table:
        """Every logged use of a row (empty when nothing was trained yet), by iteration."""
        if self._latest_version(self.usage_uri) is None:
            return USAGE_SCHEMA.empty_table()
        rows = self._scan(self._open(self.usage_uri), columns=None)
        return rows.take(
            pc.sort_indices(
                rows, sort_keys=[("iteration", "ascending"), ("train_step", "ascending")]
            )
        )

    def usage_of(
        self, rollout_ids: pa.Array, *, first_iteration: int, before_iteration: int
    ) -> pa.Table:
        """The logged uses (`USAGE_SCHEMA` rows) of `rollout_ids` by iterations
        `first_iteration` .. `before_iteration` - 1, in no particular order; empty when
        nothing was logged. A row cannot be used before the iteration that generated it, so
        `first_iteration` = the oldest drawn row's iteration skips older files by their
        statistics; `before_iteration` = the current iteration leaves out what an earlier
        attempt of it logged."""
        if self._latest_version(self.usage_uri) is None or not len(rollout_ids):
            return USAGE_SCHEMA.empty_table()
        window = (pc.field("iteration") >= int(first_iteration)) & (
            pc.field("iteration") < int(before_iteration)
        )
        rows = self._scan(
            self._open(self.usage_uri), columns=None, filter=window, keep_ids=rollout_ids
        )
        return rows.select(USAGE_SCHEMA.names)

    @staticmethod
    def _check_columns(columns: list[str] | None) -> None:
        unknown = [c for c in columns or [] if c not in ROLLOUT_SCHEMA.names]
        if unknown:
            raise ReplayRLError(
                f"unknown rollout column(s) {unknown}: choose from {ROLLOUT_SCHEMA.names}"
            )

    def sample(
        self,
        *,
        version: int,
        batch_size: int,
        num_batches: int,
        seed: int,
        mode: str = "uniform",
        replace: bool = False,
        columns: list[str] | None = None,
    ) -> list[pa.Table]:
        """Draw `num_batches` batches of `batch_size` rows from the pinned `version`.

        mode "uniform": each batch is drawn uniformly from all rows, independently of the
        other batches (without replacement inside a batch unless `replace`), so a row can be
        used several times in one iteration (the paper's sampling, §3.1). mode "epoch": one random
        permutation split into batches, each row used at most once (strict on-policy).

        Deterministic for a seed and independent of file layout: rows are indexed in
        canonical order (iteration, then rollout_id), so a bin-pack does not change the
        draw. Only the key columns of all rows are read; the chosen rows are then fetched.
        """
        check_sample_args(
            batch_size=batch_size, num_batches=num_batches, mode=mode, replace=replace
        )
        self._check_columns(columns)
        table = self._open(self.rollouts_uri, version=version)
        keys = self._scan(table, columns=["iteration", "rollout_id"])
        # Canonical row i is keys[order[i]]; only the drawn rows are ever taken (a full
        # reordering take of a 1M-row key table costs as much as the sort).
        order = pc.sort_indices(keys, sort_keys=_CANONICAL_ORDER)  # (rows,)
        chosen = draw(
            keys.num_rows,
            batch_size=batch_size,
            num_batches=num_batches,
            seed=seed,
            mode=mode,
            replace=replace,
            where=f"version {version} of {self.rollouts_uri}",
        )  # (num_batches, batch_size) canonical row indices

        unique = np.unique(chosen)  # (distinct rows,) sorted, i.e. canonical order
        wanted = keys.take(order.take(pa.array(unique)))
        # Files are pruned by iteration (int64 statistics); the ids are matched in memory.
        # A string filter cannot be pushed down: files a Delta delete rewrote store
        # rollout_id as string_view, and pyarrow cannot compare their statistics with a
        # string ("greater_equal has no kernel matching (string, string_view)").
        in_iterations = pc.field("iteration").isin(pc.unique(wanted.column("iteration")))
        needed_columns = (
            None if columns is None else sorted(set(columns) | {"iteration", "rollout_id"})
        )
        fetched = self._scan(
            table,
            columns=needed_columns,
            filter=in_iterations,
            keep_ids=wanted.column("rollout_id"),
        )
        fetched = fetched.take(pc.sort_indices(fetched, sort_keys=_CANONICAL_ORDER))
        if fetched.num_rows != len(unique):
            raise ReplayRLError(
                f"version {version} of {self.rollouts_uri} has duplicate rollout_ids "
                f"({fetched.num_rows} rows fetched for {len(unique)} ids): rewrite the affected "
                f"iterations with append(), which keeps ids unique"
            )
        if columns is not None:
            fetched = fetched.select(columns)
        # Row i of `fetched` is canonical row unique[i]; map each draw to its position.
        positions = np.searchsorted(unique, chosen)  # (num_batches, batch_size)
        return [fetched.take(pa.array(batch)) for batch in positions]

    def stats(
        self, *, current_policy_version: int, version: int | None = None, include_reuse: bool = True
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
        age_values, age_counts = np.unique(
            ages[~np.isnan(ages)].astype(np.int64), return_counts=True
        )

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
