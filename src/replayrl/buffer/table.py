"""The experience replay buffer: two Delta Lake tables under one root URI.

`<root>/rollouts` holds one row per completion (`replayrl.buffer.schema.ROLLOUT_SCHEMA`);
`<root>/usage` holds one row per use of a rollout in a gradient step (`USAGE_SCHEMA`).
Generation appends an iteration's rows in one commit (a retried iteration replaces its own
rows, so retries are idempotent); `compact` applies retention (`replayrl.buffer.retention`),
bin-packs small files and vacuums old ones; training pins the version `compact` returns and
samples from that snapshot only, so later appends and compactions never change what a
pinned version holds until its files are vacuumed (after `vacuum_grace_s`).

`ReplayBuffer` is the tables themselves: opening them, appending, reading, versions and the
usage log. Its `sample` delegates to `replayrl.buffer.sampling`; `stats` is
`replayrl.buffer.stats`; `compact`, `vacuum` and `restore` delegate to
`replayrl.buffer.maintenance`; `check`, `repair` and `check_versions` are
`replayrl.buffer.integrity` (a damaged or shortened Delta log first, then the data files
through `maintenance`); the translation of delta-rs and storage errors into errors that
name the fix (`_explain`, `_damage_error`, ...) is `replayrl.buffer.failures`; fenced
commits are `replayrl.buffer.fenced`; the conventions every read and write shares (row
groups, commit retries) are in `replayrl.buffer.delta`.

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

import logging
import os

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import DeltaError, TableNotFoundError

from replayrl.buffer import failures, fenced, integrity, maintenance, sampling
from replayrl.buffer import stats as buffer_stats
from replayrl.buffer.delta import (
    CANONICAL_ORDER,
    READ_ERRORS,
    commit_properties,
    data_filesystem,
    sql_str,
    writer_properties,
)
from replayrl.buffer.delta import ROW_GROUP_ROWS as ROW_GROUP_ROWS  # re-exported
from replayrl.buffer.maintenance import CompactReport as CompactReport  # re-exported
from replayrl.buffer.schema import ROLLOUT_SCHEMA, USAGE_SCHEMA, validate_rollouts, validate_usage
from replayrl.buffer.stats import BufferStats as BufferStats  # re-exported
from replayrl.errors import ReplayRLError
from replayrl.storage import fencing, objects

log = logging.getLogger(__name__)


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
        # Under a fence: per table, the version this process last saw as the lineage's own
        # (first load, then each of its commits); a commit found after it is inspected
        # (`_settle`) before this process commits again.
        self._expected: dict[str, int] = {}

    # ---- opening (the errors it raises: replayrl.buffer.failures) ----------------------

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
                self._first_seen(uri, table.version())
                return table
            return DeltaTable(uri, version=version, storage_options=self.storage_options)
        except TableNotFoundError as e:
            damage = self._log_error(uri, e, action="read")
            if damage is not None:
                raise damage from e
            raise ReplayRLError(
                f"no Delta table at {uri}: append rows first (ReplayBuffer.append / "
                f"log_usage), or check the root URI and storage credentials: {e}"
            ) from e
        except READ_ERRORS as e:
            damage = self._log_error(uri, e, action="read")
            if damage is not None:
                raise damage from e
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
            self._first_seen(uri, table.version())
            return table.version()
        except TableNotFoundError:
            return None
        except READ_ERRORS as e:
            damage = self._log_error(uri, e, action="read")
            if damage is not None:
                raise damage from e
            raise self._explain(e, action="read the Delta table", uri=uri) from e

    # Fenced commits (replayrl.buffer.fenced): every write below goes through `_commit`.
    _first_seen = fenced.first_seen
    check_fence = fenced.check_fence
    _commit = fenced.commit

    # Failures turned into errors that name the fix (replayrl.buffer.failures).
    _explain = failures.explain_failure
    _damage_error = failures.damage_error
    _log_error = failures.log_error
    _log_message = failures.log_message
    _check_present = failures.check_present
    _vanished_error = staticmethod(failures.vanished_error)

    @staticmethod
    def _name(uri: str) -> str:
        """The table name of `uri` under the buffer root ("rollouts" or "usage")."""
        return uri.rstrip("/").rsplit("/", 1)[-1]

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

        def scan() -> pa.Table:
            # pyarrow's own file system, not delta-rs's Python one (`data_filesystem`).
            dataset = table.to_pyarrow_dataset(
                filesystem=data_filesystem(table.table_uri, self.storage_options)
            )
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

        try:
            return objects.retried_on_s3("read", table.table_uri, scan)
        except READ_ERRORS as e:
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
                # Never create a table inside a run root or lineage folder that vanished.
                objects.check_not_vanished(uri)
                fence = fencing.for_uri(uri)
                if fence is not None:
                    fence.check(f"create {uri}")
                try:
                    write_deltalake(
                        uri,
                        rows,
                        mode="overwrite",
                        predicate=predicate,
                        storage_options=self.storage_options,
                        writer_properties=writer_properties(),
                        commit_properties=None if fence is None else commit_properties(fence.epoch),
                    )
                    return self._open(uri).version()
                except DeltaError:
                    # Another process created the table at the same moment: write onto it.
                    if self._latest_version(uri) is None:
                        raise

            def write(table: DeltaTable, props: CommitProperties | None) -> None:
                write_deltalake(
                    table,
                    rows,
                    mode="overwrite",
                    predicate=predicate,
                    writer_properties=writer_properties(),
                    commit_properties=props,
                )

            return self._commit(uri, write, action=f"write iteration {iteration} to")
        except READ_ERRORS as e:
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
        predicate = f"rollout_id IN ({', '.join(sql_str(str(r)) for r in rollout_ids)})"
        try:
            return self._commit(
                self.rollouts_uri,
                lambda t, props: t.delete(
                    predicate, writer_properties=writer_properties(), commit_properties=props
                ),
                action="delete used rows from",
            )
        except READ_ERRORS as e:
            raise self._explain(
                e,
                action="delete used rows from",
                uri=self.rollouts_uri,
                hint="The rows stay in place; the next discard deletes them",
            ) from e

    def version(self) -> int | None:
        """Latest rollouts table version, or None when nothing was appended yet."""
        return self._latest_version(self.rollouts_uri)

    def usage_version(self) -> int | None:
        """Latest usage table version, or None when nothing was logged yet."""
        return self._latest_version(self.usage_uri)

    # ---- reading -----------------------------------------------------------------------

    def read(self, *, version: int | None = None, columns: list[str] | None = None) -> pa.Table:
        """All rows of the rollouts table at `version` (latest when None), in canonical order
        (iteration, then rollout_id)."""
        self._check_columns(columns)
        table = self._open(self.rollouts_uri, version=version)
        needed = None if columns is None else sorted(set(columns) | {"iteration", "rollout_id"})
        rows = self._scan(table, columns=needed)
        rows = rows.take(pc.sort_indices(rows, sort_keys=CANONICAL_ORDER))
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
        return sampling.sample(
            self,
            version=version,
            batch_size=batch_size,
            num_batches=num_batches,
            seed=seed,
            mode=mode,
            replace=replace,
            columns=columns,
        )

    # Rows, files, ages and reuse of a version, for logging (replayrl.buffer.stats).
    stats = buffer_stats.stats

    # ---- maintenance (replayrl.buffer.maintenance) ---------------------------------------

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
        return maintenance.compact(
            self,
            capacity=capacity,
            positive_bias=positive_bias,
            max_staleness=max_staleness,
            current_policy_version=current_policy_version,
            target_file_bytes=target_file_bytes,
            min_files_to_compact=min_files_to_compact,
            vacuum_grace_s=vacuum_grace_s,
        )

    def vacuum(
        self,
        *,
        grace_s: float,
        dry_run: bool = False,
        keep_versions: dict[str, int | None] | None = None,
    ) -> dict[str, list[str]]:
        """Delete data files that no table version newer than `grace_s` seconds references
        (rounded up to whole hours, delta-rs's unit; 0 = every unreferenced file, which breaks
        readers pinned to older versions), except the files of the version `keep_versions`
        names per table ("rollouts", "usage": what a rewind restores), whatever the grace.
        Returns the files per table; `dry_run` only lists."""
        return maintenance.vacuum(
            self, grace_s=grace_s, dry_run=dry_run, keep_versions=keep_versions
        )

    def restore(self, *, rollouts_version: int | None, usage_version: int | None) -> bool:
        """Bring both tables back to what they held at the given versions (None: no rows),
        each in one commit (Delta's restore, or a delete of every row), so rows written
        after those versions are gone and the data files of those versions are referenced
        again. A table that already holds exactly those files is left alone. Returns True
        when anything changed. A crash leaves each table at its old or restored state;
        running it again finishes the job. Fails with a ReplayRLError when a data file of
        the target version was vacuumed meanwhile, or when the log no longer reaches that
        version (a table gone, its newest log entries deleted): nothing is changed then."""
        self.check_versions(rollouts_version=rollouts_version, usage_version=usage_version)
        return maintenance.restore(
            self, rollouts_version=rollouts_version, usage_version=usage_version
        )

    # Damaged or shortened Delta logs, then data files (replayrl.buffer.integrity).
    check_versions = integrity.check_versions
    _check_reaches = integrity.check_reaches
    check = integrity.check
    _log_damages = integrity.log_damages
    _log_damage = integrity.log_damage_of
    _data_damage = integrity.data_damage
    repair = integrity.repair
