"""The experience replay buffer: two Delta Lake tables under one root URI.

`<root>/rollouts` holds one row per completion (`replayrl.buffer.schema.ROLLOUT_SCHEMA`);
`<root>/usage` holds one row per use of a rollout in a gradient step (`USAGE_SCHEMA`).
Generation appends an iteration's rows in one commit (a retried iteration replaces its own
rows, so retries are idempotent); `compact` applies retention (`replayrl.buffer.retention`),
bin-packs small files and vacuums old ones; training pins the version `compact` returns and
samples from that snapshot only, so later appends and compactions never change what a
pinned version holds until its files are vacuumed (after `vacuum_grace_s`).

`ReplayBuffer` is the tables themselves: opening them, appending, reading, versions, the
usage log and the translation of delta-rs errors. Its `sample` delegates to
`replayrl.buffer.sampling`; `compact`, `vacuum`, `restore`, `check` and `repair` to
`replayrl.buffer.maintenance`; the conventions every read and write shares (row groups,
commit retries) are in `replayrl.buffer.delta`.

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
import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import DeltaError, TableNotFoundError

from replayrl.buffer import fenced, maintenance, sampling
from replayrl.buffer.delta import (
    CANONICAL_ORDER,
    READ_ERRORS,
    STORAGE_ERRORS,
    commit_properties,
    data_filesystem,
    sql_str,
    writer_properties,
)
from replayrl.buffer.delta import ROW_GROUP_ROWS as ROW_GROUP_ROWS  # re-exported
from replayrl.buffer.maintenance import CompactReport as CompactReport  # re-exported
from replayrl.buffer.repair import (
    QUARANTINE_DIR,
    DamagedFile,
    LogDamage,
    damaged_files,
    log_damage,
    log_entry_exists,
    set_aside_log,
)
from replayrl.buffer.schema import ROLLOUT_SCHEMA, USAGE_SCHEMA, validate_rollouts, validate_usage
from replayrl.errors import ReplayRLError
from replayrl.storage import fencing, objects
from replayrl.storage.s3 import classify, explain

log = logging.getLogger(__name__)


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
            if not log_entry_exists(
                table.table_uri, table.version(), storage_options=self.storage_options
            ):  # not damaged files: the whole table went while this process used it
                return self._vanished_error(
                    table.table_uri.rstrip("/"), table.version(), action=action
                )
        except READ_ERRORS:
            pass
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

    @staticmethod
    def _name(uri: str) -> str:
        """The table name of `uri` under the buffer root ("rollouts" or "usage")."""
        return uri.rstrip("/").rsplit("/", 1)[-1]

    def _log_damage(self, uri: str) -> LogDamage | None:
        """What in the transaction log of table `uri` stops it from loading (None: nothing)."""
        try:
            return log_damage(uri, name=self._name(uri), storage_options=self.storage_options)
        except READ_ERRORS as e:
            raise self._explain(e, action="read the Delta log of", uri=uri) from e

    def _log_error(self, uri: str, e: BaseException, *, action: str) -> ReplayRLError | None:
        """When `e` comes from a damaged transaction log of table `uri`, an error naming the
        damage and the fix; None when the log is fine (the failure is something else)."""
        if classify(e) not in ("other", "missing"):
            return None  # credentials, bucket or an unreachable store: the log cannot be read
        try:
            damage = log_damage(uri, name=self._name(uri), storage_options=self.storage_options)
        except READ_ERRORS:  # the look itself failed: report the original error instead
            return None
        return None if damage is None else ReplayRLError(self._log_message(damage, action=action))

    def _log_message(self, damage: LogDamage, *, action: str) -> str:
        """What is wrong with a table's log and what can be done, in one sentence or three."""
        uri = f"{self.root_uri}/{damage.table}"
        new_lineage = (
            "or start a new --lineage (this one's checkpoints keep its weights: --set "
            "model.source=<a checkpoint folder>)"
        )
        if damage.data_files:
            return (
                f"cannot {action} {uri}: it holds {damage.data_files} data file(s) but no Delta "
                f"log ({uri}/_delta_log/ is missing or empty), so which rows it holds is "
                f"unknown. Put _delta_log/ back from a backup, {new_lineage}; `replayrl buffer "
                f"repair` cannot rebuild a log"
            )
        faults = [d for d in damage.damaged if "so it goes with it" not in d.problem]
        listed = "; ".join(f"{d.path} {d.problem}" for d in faults[:3])
        if not damage.recoverable:
            return (
                f"cannot {action} {uri}: its Delta log is damaged ({listed}), so no version of "
                f"the table can be read. Put the file(s) back from a backup, {new_lineage}"
            )
        readable, latest = damage.readable_version, damage.latest_version
        later = len(damage.damaged) - len(faults)
        if latest is not None and readable is not None and readable < latest:
            versions = (
                f"version {latest}"
                if latest == readable + 1
                else (f"versions {readable + 1}-{latest}")
            )
            loss = (
                f"; the table then reads as version {readable} again, without what {versions} wrote"
            )
            moved = f"the damaged entry{f' and the {later} after it' if later else ''}"
        else:
            loss = f"; nothing is lost: the table reads as version {readable}, its latest"
            moved = "the damaged shortcut(s) of the log"
        return (
            f"cannot {action} {uri}: its Delta log is damaged ({listed}). Run `replayrl buffer "
            f"repair` for this lineage (ReplayBuffer.repair(); --dry-run lists the files): it "
            f"moves {moved} to {self.root_uri}/{QUARANTINE_DIR}/{damage.table}/{loss}. Or put "
            f"the original file(s) back from a backup"
        )

    def _check_present(self, uri: str, table: DeltaTable, *, action: str) -> None:
        """Refuse to write to table `uri` when the log entry of the version this process
        loaded is gone: the table (or the run root above it) was deleted or moved while this
        process used it, and delta-rs would write a new table's files into its place."""
        version = table.version()
        try:
            present = log_entry_exists(uri, version, storage_options=self.storage_options)
        except READ_ERRORS as e:
            raise self._explain(e, action=action, uri=uri) from e
        if not present:
            self._latest.pop(uri, None)
            raise self._vanished_error(uri, version, action=action)

    @staticmethod
    def _vanished_error(uri: str, version: int, *, action: str) -> ReplayRLError:
        return ReplayRLError(
            f"Cannot {action} {uri}: its Delta log entry for version {version}, there when "
            f"this run loaded it, is gone: the run root or the lineage folder was deleted or "
            f"moved while this run used it. Nothing was written; put it back and rerun the "
            f"same command to resume, or start a new --lineage"
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

    def check_versions(self, *, rollouts_version: int | None, usage_version: int | None) -> None:
        """Raise a ReplayRLError naming the fix when either table's log does not reach the
        version given (None: nothing to check): the table is gone (its log deleted, with or
        without its data files), its newest entries were deleted back past that version, or
        its log is damaged. A lineage resumed from a checkpoint that pairs with those
        versions must stop then, not carry on with a table started anew."""
        for uri, version in (
            (self.rollouts_uri, rollouts_version),
            (self.usage_uri, usage_version),
        ):
            if version is not None:
                self._check_reaches(uri, version)

    def _check_reaches(self, uri: str, version: int) -> None:
        latest = self._latest_version(uri)  # a damaged log raises here, with its fix
        if latest is not None and version <= latest:
            return
        new_lineage = (
            "or start a new --lineage (this one's checkpoints keep its weights: --set "
            "model.source=<a checkpoint folder>)"
        )
        if latest is None:
            damage = self._log_damage(uri)
            if damage is not None:
                raise ReplayRLError(
                    self._log_message(damage, action=f"go back to version {version} of")
                )
            raise ReplayRLError(
                f"Cannot go back to version {version} of {uri}: the table is gone (no Delta log "
                f"and no data files), though the lineage's last full checkpoint pairs with that "
                f"version. Put {uri} back from a backup, {new_lineage}. Nothing was changed"
            )
        raise ReplayRLError(
            f"Cannot go back to version {version} of {uri}: its Delta log ends at version {latest} "
            f"(the entries after it, {uri}/_delta_log/{latest + 1:020d}.json on, were deleted), "
            f"though the lineage's last full checkpoint pairs with version {version}. Put them "
            f"back from a backup, {new_lineage}. Nothing was changed"
        )

    def check(self) -> list[DamagedFile]:
        """Damaged files of the latest version of either table (empty when the buffer is
        healthy): entries of a transaction log that stop the table from loading (see
        `replayrl.buffer.repair.log_damage`), and data files that are missing, truncated or
        not Parquet (one footer read per file) of the tables whose log loads."""
        damages = self._log_damages()
        if not damages:
            return maintenance.check(self)
        out = [d for damage in damages.values() for d in damage.damaged]
        return out + self._data_damage(skip=set(damages))

    def _log_damages(self) -> dict[str, LogDamage]:
        """Table URI -> what stops its log from loading, for the tables where something does."""
        out = {}
        for uri in (self.rollouts_uri, self.usage_uri):
            damage = self._log_damage(uri)
            if damage is not None:
                out[uri] = damage
        return out

    def _data_damage(self, *, skip: set[str]) -> list[DamagedFile]:
        """Damaged data files of the tables that exist, but those in `skip`."""
        out = []
        try:
            for uri in (self.rollouts_uri, self.usage_uri):
                if uri not in skip and self._latest_version(uri) is not None:
                    out += damaged_files(
                        self._open(uri), name=self._name(uri), storage_options=self.storage_options
                    )
        except STORAGE_ERRORS as e:
            raise self._explain(e, action="check", uri=self.root_uri) from e
        return out

    def repair(self, *, dry_run: bool = False) -> list[DamagedFile]:
        """Set damaged files (see `check`) aside under `<root>/quarantine/<table>/` so reads
        work again, and return them (with the rows each data file held); `dry_run` only
        lists them. A damaged log goes first: its damaged entry and every later one (with
        the data files those added) move to `quarantine/<table>/_delta_log.<time>/` and the
        table reads as the version before the damage (`replayrl.buffer.repair`); then
        damaged data files are moved and their removal committed, every other row staying.
        A log from which no version can be read is refused with a ReplayRLError (nothing is
        moved: only a backup brings it back). Running it again after a crash finishes it."""
        damages = self._log_damages()
        if not damages:
            return maintenance.repair(self, dry_run=dry_run)
        for damage in damages.values():
            if not damage.recoverable or damage.data_files:
                raise ReplayRLError(self._log_message(damage, action="repair"))
        listed = [d for damage in damages.values() for d in damage.damaged]
        if dry_run:
            return listed + self._data_damage(skip=set(damages))
        self.check_fence("repair")
        for uri, damage in damages.items():
            try:
                set_aside_log(
                    root_uri=self.root_uri, damage=damage, storage_options=self.storage_options
                )
            except READ_ERRORS as e:
                raise self._explain(
                    e,
                    action="repair the Delta log of",
                    uri=uri,
                    hint="Nothing was deleted: files already moved are under quarantine/; rerun "
                    "repair",
                ) from e
            # Snapshots of versions that are no longer in the log.
            self._latest.pop(uri, None)
            self._expected.pop(uri, None)
        return listed + maintenance.repair(self, dry_run=False)
