"""A long-lived in-memory mirror of the rollouts table, moved version to version.

`ReplayBuffer.sample` reads the key columns of every row from Parquet on every call (1.5 s
for 4,096 rows of a 1M-row buffer). A `BufferMirror` lives for the whole run: it holds the
chosen columns of every row of one table version in memory, in canonical order (iteration,
then rollout_id), and `sync` moves it to another version by the difference of the two
versions' data files (Delta add actions): the rows of removed files are dropped, only added
files are read, and of those only the rows it does not already hold are decoded. A
bin-pack or a retention delete rewrites files whose rows are already mirrored: their
`rollout_id` and `iteration` columns are read and the held rows stay where they are.
`sample` then returns exactly what `ReplayBuffer.sample` returns for the same arguments
(same draw, rows, order, values and schema) at the cost of the drawn rows only.

A held row stands for a rewritten one only when no commit between the two versions can have
written that row anew: a retried append of iteration k replaces k's rows under the same
rollout ids, with new values. The commits in between are read from the Delta log
(`_delta_log/<version>.json`, through delta-rs's storage, so S3 options apply): OPTIMIZE,
DELETE, VACUUM and FSCK only copy or drop rows, the buffer's own `WRITE` with predicate
`iteration = k` marks iteration k as written anew, and any other operation (RESTORE, MERGE,
a plain append, a log entry that is gone) makes every row of the added files be decoded.
A data file never changes once written, so rows of files both versions reference are kept
as they are. Moving to an older version works the same way.

Rows live in segments: single-chunk record batches sorted canonically, with disjoint,
ascending iteration ranges, each at most `segment_rows` rows unless one iteration is larger.
A new iteration past the last becomes a segment of its own, merged with its neighbours
the way a binary counter carries (`replayrl.buffer.segments.coalesce`: few segments, each
row copied O(log) times over all appends); rows inserted into an existing iteration range
merge only the segments they overlap; a delete filters only the segments holding its rows. A sync of one appended
iteration costs O(new rows) amortised and a sample O(drawn rows + segments), never
O(buffer).

What it does not know about: the usage log, models, or anything it does not read. It never
writes. It checks that the rows of one sync have unique rollout ids and that inserted rows
do not repeat an id of their iteration range, but not across distant iterations (the
buffer's ids hash the iteration, so that cannot happen through `ReplayBuffer.append`). A
version it already mirrors is answered from memory, so files vacuumed after the sync do not
make its `sample` fail as `ReplayBuffer.sample` would.

Failure: a sync builds the new mirror aside and swaps it in only when complete, so a failed
sync (unreachable store, a damaged or vacuumed file, a version that does not exist) raises
a `ReplayRLError` (the buffer's own messages) and leaves the previous mirror intact and
usable. Not thread-safe: one mirror per trainer process.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError
from deltalake.fs import DeltaStorageHandler

from replayrl.buffer.delta import READ_ERRORS, data_filesystem
from replayrl.buffer.sampling import check_sample_args, draw
from replayrl.buffer.schema import ROLLOUT_SCHEMA
from replayrl.buffer.segments import bounds, canonical, check_unique_neighbours, coalesce, split
from replayrl.buffer.table import ReplayBuffer
from replayrl.errors import ReplayRLError
from replayrl.storage import objects

# Rows per segment (a merge never goes beyond it; one iteration larger than it stays whole).
# 1M rows are then ~16-40 segments: a 4,096-row draw is that many small takes (~10 ms).
SEGMENT_ROWS = 65_536
_KEYS = ["rollout_id", "iteration"]
# Operations that only copy rows unchanged into new files or drop rows and files.
_COPYING_OPERATIONS = frozenset({"OPTIMIZE", "DELETE", "VACUUM START", "VACUUM END", "FSCK"})
# The predicate of ReplayBuffer.append's overwrite: it writes iteration k's rows anew.
_ITERATION_PREDICATE = re.compile(r"\s*iteration\s*=\s*(-?\d+)\s*")


@dataclass(frozen=True)
class SyncReport:
    """What one `sync` did. `rows_decoded` counts rows whose mirrored columns were decoded
    from Parquet; rows of rewritten files that the mirror already held are not."""

    version: int
    rows: int  # rows mirrored after the sync
    files_added: int  # data files the new version has and the old one had not
    files_removed: int  # and the other way round
    files_read: int  # data files opened (key columns, mirrored columns or both)
    rows_decoded: int
    rows_dropped: int
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class _Mirror:
    """One mirrored table version. Never changed in place: a sync builds a new one."""

    version: int | None
    schema: pa.Schema  # of the mirrored columns, as delta-rs's dataset has them
    files: dict[str, pa.Table]  # data file path -> its rows' keys (rollout_id, iteration)
    segments: tuple[pa.RecordBatch, ...]  # canonical order, disjoint ascending iterations
    first: np.ndarray  # (segments,) int64, first iteration of each segment
    last: np.ndarray  # (segments,) int64, last iteration of each segment
    starts: np.ndarray  # (segments + 1,) int64, canonical index of each segment's first row

    @property
    def num_rows(self) -> int:
        return int(self.starts[-1])


class BufferMirror:
    """The `columns` of every row of one version of `buffer`'s rollouts table, in memory.

    `columns` are rollout columns (the trainer passes `replayrl.engine.steps.TRAIN_COLUMNS`);
    `iteration` and `rollout_id` are always kept. Nothing is read until the first `sync`
    or `sample`.
    """

    def __init__(
        self, buffer: ReplayBuffer, *, columns: list[str], segment_rows: int = SEGMENT_ROWS
    ):
        ReplayBuffer._check_columns(list(columns))
        if segment_rows < 1:
            raise ReplayRLError(f"segment_rows must be >= 1, got {segment_rows}")
        self.buffer = buffer
        wanted = set(columns) | set(_KEYS)
        self.columns = [name for name in ROLLOUT_SCHEMA.names if name in wanted]
        self._cap = segment_rows
        self._mirror: _Mirror | None = None

    @property
    def version(self) -> int | None:
        """The mirrored table version; None before the first sync."""
        return None if self._mirror is None else self._mirror.version

    @property
    def num_rows(self) -> int:
        return 0 if self._mirror is None else self._mirror.num_rows

    def rows(self, columns: list[str] | None = None) -> pa.Table:
        """Every mirrored row (`columns` of them; all mirrored ones when None) of the synced
        version, in canonical order (iteration, then rollout_id); empty before a sync."""
        wanted = self.columns if columns is None else list(columns)
        missing = [c for c in wanted if c not in self.columns]
        if missing:
            raise ReplayRLError(f"column(s) {missing} are not mirrored (this holds {self.columns})")
        if self._mirror is None or not self._mirror.segments:
            return pa.table({c: pa.array([], ROLLOUT_SCHEMA.field(c).type) for c in wanted})
        return pa.Table.from_batches(self._mirror.segments).select(wanted)

    # ---- syncing -------------------------------------------------------------------------

    def sync(self, version: int | None = None) -> SyncReport:
        """Bring the mirror to exactly `version` of the rollouts table (latest when None),
        reading only the data files the mirrored version does not have. A failure raises a
        `ReplayRLError` and leaves the previous mirror as it was."""
        start = time.perf_counter()
        if version is not None and self._mirror is not None and self._mirror.version == version:
            return self._report(version, self._mirror, start)
        uri = self.buffer.rollouts_uri
        table = self.buffer._open(uri, version=version)
        try:
            target = table.version()
            # The types ReplayBuffer.sample returns: delta-rs's dataset schema (lists of
            # "element", not pyarrow's "item"), which every file is cast to.
            table_schema = pa.schema(table.schema().to_arrow())
            schema = pa.schema([table_schema.field(name) for name in self.columns])
            old = self._mirror
            if old is None or not old.schema.equals(schema):  # first sync, or a new schema
                old = _Mirror(
                    version=None,
                    schema=schema,
                    files={},
                    segments=(),
                    first=np.zeros(0, np.int64),
                    last=np.zeros(0, np.int64),
                    starts=np.zeros(1, np.int64),
                )
            actions = pa.table(table.get_add_actions()).select(["path", "size_bytes"])
            paths = actions.column("path").to_pylist()
            wanted = set(paths)
            removed = [p for p in old.files if p not in wanted]
            added = [p for p in dict.fromkeys(paths) if p not in old.files]
            if not removed and not added and old.version is not None:
                # Same data files (a vacuum, a restore to the same content): nothing to read.
                self._mirror = replace(old, version=target)
                return self._report(target, self._mirror, start)
            sizes = dict(zip(paths, actions.column("size_bytes").to_pylist(), strict=True))

            def apply():  # reads only: retried whole on S3 like every object read
                fragments = self._fragments(table, sizes, added)
                return self._apply(table, old, target, removed, fragments)

            new, read, decoded, dropped = objects.retried_on_s3("read", table.table_uri, apply)
        except READ_ERRORS as e:
            raise self._read_error(table, e) from e
        self._mirror = new
        return SyncReport(
            version=target,
            rows=new.num_rows,
            files_added=len(added),
            files_removed=len(removed),
            files_read=read,
            rows_decoded=decoded,
            rows_dropped=dropped,
            seconds=time.perf_counter() - start,
        )

    def _report(self, target: int, mirror: _Mirror, start: float) -> SyncReport:
        return SyncReport(
            version=target,
            rows=mirror.num_rows,
            files_added=0,
            files_removed=0,
            files_read=0,
            rows_decoded=0,
            rows_dropped=0,
            seconds=time.perf_counter() - start,
        )

    def _read_error(self, table: DeltaTable, e: BaseException) -> ReplayRLError:
        """The error `ReplayBuffer` raises for the same failed read."""
        damage = self.buffer._damage_error(table, e, action="read")
        if damage is not None:
            return damage
        return self.buffer._explain(
            e,
            action=f"read version {table.version()} of",
            uri=table.table_uri,
            hint="If its files were vacuumed, pin a newer version (from compact()) or raise "
            "vacuum_grace_s",
        )

    def _apply(
        self,
        table: DeltaTable,
        old: _Mirror,
        target: int,
        removed: list[str],
        fragments: dict,
    ) -> tuple[_Mirror, int, int, int]:
        """The mirror of `target`: `old` less the rows of `removed` files, plus the rows of
        the added files (`fragments`, by path) it does not hold. Returns it with (files read,
        rows decoded, rows dropped)."""
        uri = self.buffer.rollouts_uri
        added = list(fragments)
        schema = old.schema
        key_schema = pa.schema([schema.field(name) for name in _KEYS])
        removed_keys = pa.concat_tables(
            [old.files[p] for p in removed] or [key_schema.empty_table()]
        )
        gone = set(removed)
        files = {p: keys for p, keys in old.files.items() if p not in gone}
        fresh_rows: list[pa.Table] = []  # rows to insert, mirrored columns
        reused_ids: list[pa.ChunkedArray] = []  # ids of removed files that added files repeat
        # Rows of removed files can stand for rows of added ones only when no commit in
        # between wrote their iteration anew (None: any iteration may have been).
        written: set[int] | None = None
        if removed_keys.num_rows and fragments:
            # A mirror that holds files was synced to a version (only the first is None).
            assert old.version is not None
            low, high = sorted((old.version, target))
            written = self._written_iterations(table, first=low + 1, last=high)
        for path in added:
            keys, rows, repeated = self._read_added(
                fragments[path],
                schema,
                removed_ids=removed_keys.column("rollout_id"),
                written=written,
            )
            files[path] = keys
            if rows is not None:
                fresh_rows.append(rows)
            if repeated is not None:
                reused_ids.append(repeated)

        all_added = [files[p] for p in added]
        if all_added:
            ids = pa.concat_tables(all_added).column("rollout_id")
            if len(pc.unique(ids)) != len(ids):
                raise ReplayRLError(
                    f"version {target} of {uri} has duplicate rollout_ids among its new files: "
                    f"rewrite the affected iterations with append(), which keeps ids unique"
                )
        drop = removed_keys
        if reused_ids and drop.num_rows:
            reused = pa.chunked_array(
                [c for ids in reused_ids for c in ids.chunks], type=pa.string()
            )
            drop = drop.filter(pc.invert(pc.is_in(drop.column("rollout_id"), value_set=reused)))
        segments = self._drop(old, drop, target=target)
        fresh = pa.concat_tables(fresh_rows).cast(schema) if fresh_rows else schema.empty_table()
        segments = self._insert(segments, fresh, target=target)
        segments = coalesce(
            [piece for s in segments for piece in split(s, self._cap) if piece.num_rows],
            self._cap,
        )
        first, last, starts = bounds(segments)
        mirror = _Mirror(
            version=target,
            schema=schema,
            files=files,
            segments=tuple(segments),
            first=first,
            last=last,
            starts=starts,
        )
        return mirror, len(added), fresh.num_rows, drop.num_rows

    def _read_added(
        self,
        fragment: pads.ParquetFileFragment,
        schema: pa.Schema,
        *,
        removed_ids: pa.ChunkedArray,
        written: set[int] | None,
    ) -> tuple[pa.Table, pa.Table | None, pa.ChunkedArray | None]:
        """One added data file, against the rows of the removed files (`removed_ids`) and
        the iterations written anew in between (`written`; None: any may have been).
        Returns its keys, its rows the mirror must insert (None when there are none to read),
        and the ids of its rows that held rows of removed files stand for (None when none
        can: every row is decoded)."""
        if written is None:  # an append, or nothing held can be trusted: decode all
            rows = self._read(fragment, schema)
            return rows.select(_KEYS), rows, None
        keys = self._read(fragment, pa.schema([schema.field(name) for name in _KEYS]))
        held = pc.is_in(keys.column("rollout_id"), value_set=removed_ids)
        rewritten = pc.is_in(
            keys.column("iteration"), value_set=pa.array(sorted(written), pa.int64())
        )
        fresh = pc.or_(pc.invert(held), rewritten)  # (file rows,)
        n_fresh = pc.sum(fresh).as_py() or 0
        reused = keys.column("rollout_id").filter(pc.invert(fresh))
        if n_fresh == keys.num_rows:
            return keys, self._read(fragment, schema), reused
        if not n_fresh:
            return keys, None, reused
        fresh_keys = keys.filter(fresh)
        rows = self._read(
            fragment,
            schema,
            filter=pc.field("iteration").isin(pc.unique(fresh_keys.column("iteration"))),
        )
        wanted = pc.is_in(rows.column("rollout_id"), value_set=fresh_keys.column("rollout_id"))
        return keys, rows.filter(wanted), reused

    def _fragments(self, table: DeltaTable, sizes: dict[str, int], paths: list[str]) -> dict:
        """Parquet fragments of the data files `paths` of `table`, built the way
        `DeltaTable.to_pyarrow_dataset()` builds them (the buffer's storage options, known
        sizes, pre-buffered reads) but for these files only, the whole dataset costs a
        fragment with a statistics expression per file; through pyarrow's own file system
        (`data_filesystem`), not delta-rs's Python one."""
        if not paths:
            return {}
        fs = data_filesystem(table.table_uri, self.buffer.storage_options)
        fmt = pads.ParquetFileFormat(
            default_fragment_scan_options=pads.ParquetFragmentScanOptions(pre_buffer=True)
        )
        return {
            path: fmt.make_fragment(path, filesystem=fs, file_size=sizes[path]) for path in paths
        }

    @staticmethod
    def _read(
        fragment: pads.ParquetFileFragment,
        schema: pa.Schema,
        *,
        filter: pc.Expression | None = None,
    ) -> pa.Table:
        """`schema`'s columns of one data file, cast to it (files a Delta delete rewrote
        store rollout_id as string_view). A `filter` is applied in the scan, except on a file
        with view columns: pyarrow has no filter kernel for string_view, so such a file is
        read whole, cast, then filtered."""
        columns = [field.name for field in schema]
        file_schema = fragment.physical_schema
        read_schema = pa.schema([file_schema.field(name) for name in columns])
        views = any(
            pa.types.is_string_view(f.type) or pa.types.is_binary_view(f.type) for f in read_schema
        )
        if filter is None or not views:
            return fragment.to_table(schema=read_schema, columns=columns, filter=filter).cast(
                schema
            )
        return fragment.to_table(schema=read_schema, columns=columns).cast(schema).filter(filter)

    def _written_iterations(self, table: DeltaTable, *, first: int, last: int) -> set[int] | None:
        """Iterations whose rows the commits `first`..`last` may have written anew (a retried
        append), from their commitInfo; None when any row may have been (an operation that
        does not only copy or drop rows, or a log entry that cannot be read)."""
        fs = pafs.PyFileSystem(DeltaStorageHandler(table.table_uri, self.buffer.storage_options))
        written: set[int] = set()
        for version in range(first, last + 1):
            try:
                with fs.open_input_stream(f"_delta_log/{version:020d}.json") as stream:
                    text = stream.read().decode()
            except (OSError, DeltaError, UnicodeDecodeError):
                # cleaned-up or damaged log entry, or the store is away: trust nothing
                return None
            info = None
            for line in text.splitlines():
                if '"commitInfo"' in line:
                    try:
                        info = json.loads(line).get("commitInfo")
                    except ValueError:
                        info = None
                    if info is not None:
                        break
            if not isinstance(info, dict):
                return None
            operation = info.get("operation")
            if operation in _COPYING_OPERATIONS:
                continue
            params = info.get("operationParameters") or {}
            match = _ITERATION_PREDICATE.fullmatch(str(params.get("predicate", "")))
            if operation == "WRITE" and params.get("mode") == "Overwrite" and match:
                written.add(int(match.group(1)))
                continue
            return None
        return written

    def _drop(self, old: _Mirror, drop: pa.Table, *, target: int) -> list[pa.RecordBatch]:
        """`old`'s segments without the rows whose keys are in `drop`; only the segments
        holding those rows are filtered."""
        segments = list(old.segments)
        if not drop.num_rows:
            return segments
        iteration = drop.column("iteration").to_numpy()  # (dropped,)
        where = np.searchsorted(old.first, iteration, side="right") - 1  # (dropped,)
        ok = where >= 0
        ok[ok] = iteration[ok] <= old.last[where[ok]]
        if not ok.all():
            raise ReplayRLError(
                f"mirror of {self.buffer.rollouts_uri} out of step at version {target}: rows to "
                f"drop are not held; make a new BufferMirror (and report this as a bug)"
            )
        ids = drop.column("rollout_id")
        for s in np.unique(where):
            segment = segments[s]
            gone = pc.is_in(
                segment.column("rollout_id"), value_set=ids.filter(pa.array(where == s))
            )
            segments[s] = segment.filter(pc.invert(gone))
            if segment.num_rows - segments[s].num_rows != int((where == s).sum()):
                raise ReplayRLError(
                    f"mirror of {self.buffer.rollouts_uri} out of step at version {target}: "
                    f"rows to drop are not held; make a new BufferMirror (and report this as "
                    f"a bug)"
                )
        return [s for s in segments if s.num_rows]

    def _insert(
        self, segments: list[pa.RecordBatch], rows: pa.Table, *, target: int
    ) -> list[pa.RecordBatch]:
        """`segments` with `rows` placed in canonical order. Rows between two segments'
        iteration ranges (or before the first, after the last) become segments of their own,
        left to `coalesce` to merge; rows inside a segment's range are merged into it by a
        sort of that segment only."""
        if not rows.num_rows:
            return segments
        rows = canonical(rows)
        uri = self.buffer.rollouts_uri
        if not segments:
            check_unique_neighbours(rows, uri=uri, version=target)
            return [rows]
        first, last, _ = bounds(segments)
        iteration = rows.column("iteration").to_numpy()  # (new rows,) ascending
        # The segment at or before each new row (-1: before the first), and whether the row
        # falls inside that segment's iteration range.
        where = np.searchsorted(first, iteration, side="right") - 1  # (new rows,)
        inside = (where >= 0) & (iteration <= last[np.maximum(where, 0)])  # (new rows,)
        # Where each run goes, ascending: 2s + 1 inside segment s, 2s + 2 the gap after it.
        slot = 2 * where + 2 - inside  # (new rows,)
        cuts = np.flatnonzero(slot[1:] != slot[:-1]) + 1  # (runs - 1,)
        placed: dict[int, pa.RecordBatch] = {}
        for begin, end in zip(
            np.concatenate([[0], cuts]), np.concatenate([cuts, [len(slot)]]), strict=True
        ):
            run = rows.slice(int(begin), int(end - begin))
            s = int(where[begin])
            if inside[begin]:
                run = canonical(pa.concat_batches([segments[s], run]))
            check_unique_neighbours(run, uri=uri, version=target)
            placed[int(slot[begin])] = run
        out: list[pa.RecordBatch] = []
        for s in range(-1, len(segments)):
            if s >= 0:
                out.append(placed.get(2 * s + 1, segments[s]))
            if 2 * s + 2 in placed:  # the gap after segment s (before s + 1)
                out.append(placed[2 * s + 2])
        return out

    # ---- sampling ------------------------------------------------------------------------

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
        """Exactly `ReplayBuffer.sample(version=..., ...)` with the same arguments (same draw
        from `np.random.default_rng(seed)`, rows, order, values and schema), from memory:
        syncs to `version` first when the mirror holds another. `columns=None` means every
        rollout column, which needs a mirror of all of them."""
        check_sample_args(
            batch_size=batch_size, num_batches=num_batches, mode=mode, replace=replace
        )
        ReplayBuffer._check_columns(columns)
        wanted = ROLLOUT_SCHEMA.names if columns is None else columns
        missing = [c for c in wanted if c not in self.columns]
        if missing:
            raise ReplayRLError(
                f"column(s) {missing} are not mirrored (this BufferMirror holds {self.columns}): "
                f"pass them in BufferMirror(columns=...), or sample fewer columns"
            )
        if self._mirror is None or self._mirror.version != version:
            self.sync(version)
        mirror = self._mirror
        assert mirror is not None  # sync() set it, or raised
        # The same draw as ReplayBuffer.sample: same rows for the same version and seed.
        chosen = draw(
            mirror.num_rows,
            batch_size=batch_size,
            num_batches=num_batches,
            seed=seed,
            mode=mode,
            replace=replace,
            where=f"version {version} of {self.buffer.rollouts_uri}",
        )  # (num_batches, batch_size) canonical row indices

        unique = np.unique(chosen)  # (distinct rows,) sorted, i.e. canonical order
        segment = np.searchsorted(mirror.starts, unique, side="right") - 1  # (distinct rows,)
        cuts = np.flatnonzero(segment[1:] != segment[:-1]) + 1  # (segments hit - 1,)
        pieces = [
            mirror.segments[segment[begin]].take(
                pa.array(unique[begin:end] - mirror.starts[segment[begin]])
            )
            for begin, end in zip(
                np.concatenate([[0], cuts]), np.concatenate([cuts, [len(unique)]]), strict=True
            )
        ]
        fetched = pa.concat_batches(pieces).select(list(wanted))
        # Row i of `fetched` is canonical row unique[i]; map each draw to its position.
        positions = np.searchsorted(unique, chosen)  # (num_batches, batch_size)
        return [pa.Table.from_batches([fetched.take(pa.array(batch))]) for batch in positions]
