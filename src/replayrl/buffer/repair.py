"""Finding and setting aside damaged data files of the buffer's Delta tables.

A data file the transaction log lists can be missing (deleted by hand, vacuumed too
early), of the wrong size (truncated by a broken copy) or not Parquet at all (overwritten).
`damaged_files` finds them from the log's add actions (path, size, row count) with one
listing and one footer read per file. `quarantine` moves damaged files that still exist
to `<buffer root>/quarantine/<table>/` (they are kept, for forensics) and then commits a
Delta FSCK (`DeltaTable.repair`), which removes the log's references to files that are
gone: the table is readable again and holds every row except those of the damaged files.

Knows nothing about rollouts or lineages: it works on any Delta table under a root URI,
with the `storage_options` it is given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.fs import DeltaStorageHandler

QUARANTINE_DIR = "quarantine"


@dataclass(frozen=True)
class DamagedFile:
    table: str  # table name under the buffer root, e.g. "rollouts"
    path: str  # data file path relative to the table
    rows: int | None  # rows the log says it holds (None: no statistics)
    problem: str  # "missing", "has 409 bytes, the log says 819", "not Parquet: ..."

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _fs(uri: str, storage_options: dict[str, str] | None) -> pafs.FileSystem:
    return pafs.PyFileSystem(DeltaStorageHandler(uri, storage_options))


def damaged_files(
    table: DeltaTable, *, name: str, storage_options: dict[str, str] | None
) -> list[DamagedFile]:
    """The data files of `table`'s loaded version that are missing, of another size than
    the log records, or whose Parquet footer cannot be read."""
    actions = pa.table(table.get_add_actions(flatten=True))
    rows = (
        actions.column("num_records").to_pylist() if "num_records" in actions.column_names else None
    )
    fs = _fs(table.table_uri, storage_options)
    out = []
    for i, (path, size) in enumerate(
        zip(
            actions.column("path").to_pylist(),
            actions.column("size_bytes").to_pylist(),
            strict=True,
        )
    ):
        problem = _problem(fs, path, int(size))
        if problem is not None:
            out.append(
                DamagedFile(
                    table=name,
                    path=path,
                    rows=None if rows is None or rows[i] is None else int(rows[i]),
                    problem=problem,
                )
            )
    return out


def _problem(fs: pafs.FileSystem, path: str, size: int) -> str | None:
    try:
        info = fs.get_file_info(path)
    except OSError as e:
        return f"cannot be listed: {e}"
    if info.type == pafs.FileType.NotFound:
        return "missing"
    if info.size is not None and info.size != size:
        return f"has {info.size} bytes, the log says {size}"
    try:
        with fs.open_input_file(path) as f:
            pq.read_metadata(f)
    except (pa.ArrowException, OSError) as e:
        return f"not readable as Parquet: {' '.join(str(e).split())[:200]}"
    return None


def quarantine(
    *,
    root_uri: str,
    table: DeltaTable,
    damaged: list[DamagedFile],
    storage_options: dict[str, str] | None,
) -> list[str]:
    """Move `damaged` files of `table` (a table under `root_uri`) that still exist to
    `<root_uri>/quarantine/<table name>/`, then commit an FSCK removing the log's references
    to missing files. Returns the paths the FSCK removed from the table."""
    root = _fs(root_uri, storage_options)
    for d in damaged:
        src = f"{d.table}/{d.path}"
        if root.get_file_info(src).type == pafs.FileType.NotFound:
            continue
        dest = f"{QUARANTINE_DIR}/{d.table}/{d.path}"
        root.create_dir(dest.rsplit("/", 1)[0], recursive=True)
        root.move(src, dest)
    if not damaged:
        return []
    return list(table.repair(dry_run=False)["files_removed"])
