"""Finding and setting aside damaged data files of the buffer's Delta tables.

A data file the transaction log lists can be missing (deleted by hand, vacuumed too
early), of the wrong size (truncated by a broken copy) or not Parquet at all (overwritten).
`damaged_files` finds them from the log's add actions (path, size, row count) with one
listing and one footer read per file. `quarantine` moves damaged files that still exist
to `<buffer root>/quarantine/<table>/` (they are kept, for forensics) and then commits a
Delta FSCK (`DeltaTable.repair`), which removes the log's references to files that are
gone: the table is readable again and holds every row except those of the damaged files.

The transaction log itself can be damaged too (`log_damage`): a commit entry
(`_delta_log/<version>.json`) truncated, overwritten or deleted, a checkpoint of the log
(`<version>.checkpoint.parquet`) unreadable or deleted, `_last_checkpoint` garbled, the
whole `_delta_log/` gone. delta-rs then cannot load the table at all. `log_damage` lists
the log, reads every entry a load needs (the newest readable checkpoint and the commits
after it) and works out the newest version that can still be read: the last one before
the first damaged or missing commit. `set_aside_log` moves the damage and everything after
it (later commits cannot be applied without it; a damaged checkpoint and a `_last_checkpoint`
that names it are only shortcuts, so setting those aside loses nothing) to
`<buffer root>/quarantine/<table>/_delta_log.<time>/`, with the data files those later
commits added, so the table reads as that version again. When no version can be read (the
first commit gone with no checkpoint to stand in for it, or the log gone while data files
remain) nothing is moved: only a backup of the log brings those rows back.

Knows nothing about rollouts or lineages: it works on any Delta table under a root URI,
with the `storage_options` it is given.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError, TableNotFoundError
from deltalake.fs import DeltaStorageHandler

QUARANTINE_DIR = "quarantine"
LOG_DIR = "_delta_log"
LAST_CHECKPOINT = "_last_checkpoint"
_COMMIT = re.compile(r"^(\d{20})\.json$")
# Single-part (<v>.checkpoint.parquet), multi-part (<v>.checkpoint.<i>.<n>.parquet) and v2
# (<v>.checkpoint.<uuid>.parquet) checkpoints of the log.
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(?:\.(\d+)\.(\d+)|\.[0-9a-fA-F-]+)?\.parquet$")
# What reading a log entry can raise: the store (OSError, delta-rs) or the bytes (pyarrow).
_LOG_READ_ERRORS = (OSError, DeltaError, pa.ArrowException)


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


# ---- the transaction log -------------------------------------------------------------


@dataclass(frozen=True)
class LogDamage:
    """What is wrong with one table's transaction log, and what `set_aside_log` would do.

    `damaged` lists the entries at fault and, after them, the readable commits that must go
    with them (their `problem` says so); `set_aside` the log files a repair moves (paths
    relative to the table); `readable_version` the version the table reads as afterwards,
    None when no version can be read (nothing is then moved); `latest_version` the newest
    commit in the log; `data_files` the data files of a table whose log is gone."""

    table: str
    damaged: list[DamagedFile]
    set_aside: list[str] = field(default_factory=list)
    readable_version: int | None = None
    latest_version: int | None = None
    data_files: int = 0

    @property
    def recoverable(self) -> bool:
        return self.readable_version is not None

    def describe(self) -> str:
        """The damage in a few words: the first three entries and their problems."""
        listed = "; ".join(f"{d.path} {d.problem}" for d in self.damaged[:3])
        more = len(self.damaged) - 3
        return listed + (f"; and {more} more" if more > 0 else "")


def _commit_problem(fs: pafs.FileSystem, path: str) -> str | None:
    """Why the commit entry at `path` cannot be read (None: it can)."""
    try:
        with fs.open_input_stream(path) as f:
            raw = f.read()
    except _LOG_READ_ERRORS as e:
        return f"cannot be read: {' '.join(str(e).split())[:200]}"
    if not raw.strip():
        return "is empty (truncated to nothing)"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "is not text (overwritten with other bytes)"
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            action = json.loads(line)
        except ValueError:
            return f"is not valid JSON at line {number} (truncated or overwritten)"
        if not _is_action(action):
            return f"line {number} is not a valid Delta action (overwritten?)"
    return None


# The fields delta-rs cannot read an action without, and their types.
_REQUIRED: dict[str, dict[str, type]] = {
    "add": {
        "path": str,
        "partitionValues": dict,
        "size": int,
        "modificationTime": int,
        "dataChange": bool,
    },
    "remove": {"path": str, "dataChange": bool},
    "protocol": {"minReaderVersion": int, "minWriterVersion": int},
    "metaData": {"id": str, "schemaString": str, "partitionColumns": list},
}


def _is_action(action: object) -> bool:
    """Whether one line of a commit entry is an action delta-rs can read: an object with one
    key, whose value (for the actions that have required fields) holds them."""
    if not isinstance(action, dict) or len(action) != 1:
        return False
    [(kind, body)] = action.items()
    if not isinstance(body, dict):
        return False
    for name, kind_type in _REQUIRED.get(kind, {}).items():
        if not isinstance(body.get(name), kind_type):
            return False
    if kind == "metaData":
        try:
            json.loads(body["schemaString"])
        except ValueError:
            return False
    return True


def _checkpoint_problem(fs: pafs.FileSystem, paths: list[str], parts: int) -> str | None:
    """Why the checkpoint made of `paths` (`parts` files expected) cannot be read."""
    if len(paths) < parts:
        return f"has {len(paths)} of its {parts} parts"
    for path in paths:
        try:
            with fs.open_input_file(path) as f:
                pq.read_table(f)
        except _LOG_READ_ERRORS as e:
            return f"is not readable as Parquet: {' '.join(str(e).split())[:200]}"
    return None


def _last_checkpoint_version(fs: pafs.FileSystem) -> tuple[int | None, str | None]:
    """(the version `_last_checkpoint` names, why it cannot be read); (None, None) when absent."""
    path = f"{LOG_DIR}/{LAST_CHECKPOINT}"
    try:
        with fs.open_input_stream(path) as f:
            raw = f.read()
    except FileNotFoundError:
        return None, None
    except _LOG_READ_ERRORS as e:
        return None, f"cannot be read: {' '.join(str(e).split())[:200]}"
    try:
        version = json.loads(raw.decode("utf-8")).get("version")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None, "is not valid JSON (truncated or overwritten)"
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        return None, f"names no valid version ({version!r})"
    return version, None


def _list(fs: pafs.FileSystem, folder: str) -> list[pafs.FileInfo] | None:
    """The entries of `folder` of the table's store; None when the table folder is absent."""
    try:
        return list(fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True)))
    except FileNotFoundError:
        return None


def log_damage(
    table_uri: str, *, name: str, storage_options: dict[str, str] | None
) -> LogDamage | None:
    """What stops delta-rs from loading the latest version of the table at `table_uri`
    (None when nothing in its log does, or when there is no table there at all)."""
    try:
        fs = _fs(table_uri, storage_options)
    except TableNotFoundError:  # a local table folder that does not exist
        return None
    entries = _list(fs, LOG_DIR)
    if entries is None:
        return None
    commits: dict[int, str] = {}
    checkpoints: dict[int, list[str]] = {}
    parts: dict[int, int] = {}
    has_last_checkpoint = False
    for info in entries:
        if info.type != pafs.FileType.File:
            continue
        base = info.base_name
        if (match := _COMMIT.match(base)) is not None:
            commits[int(match.group(1))] = info.path
        elif (match := _CHECKPOINT.match(base)) is not None:
            version = int(match.group(1))
            checkpoints.setdefault(version, []).append(info.path)
            parts[version] = int(match.group(3) or 1)
        elif base == LAST_CHECKPOINT:
            has_last_checkpoint = True
    if not commits and not checkpoints:
        data = [
            i
            for i in _list(fs, "") or []
            if i.type == pafs.FileType.File and i.base_name.endswith(".parquet")
        ]
        if not data:
            return None  # no table here (or a first commit that never happened, with no data)
        return LogDamage(
            table=name,
            damaged=[
                DamagedFile(
                    table=name,
                    path=f"{LOG_DIR}/",
                    rows=None,
                    problem=f"is missing or empty, but {len(data)} data file(s) are there",
                )
            ],
            data_files=len(data),
        )

    damaged: list[DamagedFile] = []
    set_aside: list[str] = []

    def bad(path: str, problem: str) -> None:
        damaged.append(DamagedFile(table=name, path=path, rows=None, problem=problem))
        set_aside.append(path)

    # The newest checkpoint that can be read is where a load starts; newer damaged ones
    # would be picked first (and fail), so they go.
    base = -1
    for version in sorted(checkpoints, reverse=True):
        problem = _checkpoint_problem(fs, sorted(checkpoints[version]), parts[version])
        if problem is None:
            base = version
            break
        for path in sorted(checkpoints[version]):
            bad(path, problem)
    good = base
    while good + 1 in commits and _commit_problem(fs, commits[good + 1]) is None:
        good += 1
    latest = max([base, *commits])
    readable = good if good >= 0 else None
    if good < latest:
        first = good + 1
        problem = _commit_problem(fs, commits[first]) if first in commits else None
        if problem is not None:
            bad(commits[first], problem)
        elif good < 0:
            bad(f"{LOG_DIR}/{first:020d}.json", "is missing and no checkpoint stands in for it")
        else:
            bad(
                f"{LOG_DIR}/{first:020d}.json",
                f"is missing: versions {min(v for v in commits if v > first)}-{latest} come "
                f"after a gap",
            )
        if readable is not None:
            for version in sorted(v for v in commits if v > first):
                problem = _commit_problem(fs, commits[version])
                bad(
                    commits[version],
                    problem
                    if problem is not None
                    else f"is readable but comes after the damaged version {first}, so it "
                    f"goes with it",
                )
    named, problem = _last_checkpoint_version(fs) if has_last_checkpoint else (None, None)
    if problem is None and named is not None:
        if named not in checkpoints:
            problem = f"names checkpoint version {named}, which is missing"
        elif named > base:
            problem = f"names checkpoint version {named}, which cannot be read"
    if problem is not None:
        bad(f"{LOG_DIR}/{LAST_CHECKPOINT}", problem)
    if not damaged:
        return None
    if readable is None:
        set_aside = []  # no version to go back to: leave every file where it is
    return LogDamage(
        table=name,
        damaged=damaged,
        set_aside=set_aside,
        readable_version=readable,
        latest_version=latest if latest >= 0 else None,
    )


def _added_paths(fs: pafs.FileSystem, path: str) -> list[str]:
    """The data files the commit entry at `path` adds (from the lines that parse)."""
    try:
        with fs.open_input_stream(path) as f:
            text = f.read().decode("utf-8", errors="replace")
    except _LOG_READ_ERRORS:
        return []
    out = []
    for line in text.splitlines():
        try:
            action = json.loads(line)
        except ValueError:
            continue
        add = action.get("add") if isinstance(action, dict) else None
        if isinstance(add, dict) and isinstance(add.get("path"), str):
            out.append(add["path"])
    return out


def set_aside_log(
    *, root_uri: str, damage: LogDamage, storage_options: dict[str, str] | None
) -> str:
    """Move `damage.set_aside` (log files of table `damage.table` under `root_uri`) and the
    data files the moved commits added to `<root_uri>/quarantine/<table>/_delta_log.<time>/`
    (the data files beside it, under `quarantine/<table>/`), so that the table reads as
    `damage.readable_version`. `_last_checkpoint` and checkpoints go first, then commits
    newest first, so a repair stopped half-way leaves a log that reads as some version at
    or after that one, and running it again finishes the job. Returns the log folder."""
    if not damage.recoverable:
        raise ValueError("set_aside_log: no readable version to go back to")
    root = _fs(root_uri, storage_options)
    table = _fs(f"{root_uri.rstrip('/')}/{damage.table}", storage_options)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    log_dest = f"{QUARANTINE_DIR}/{damage.table}/{LOG_DIR}.{stamp}"
    root.create_dir(log_dest, recursive=True)

    def order(path: str) -> tuple[int, int]:
        """_last_checkpoint, then checkpoints, then commits; each newest first."""
        name = path.rsplit("/", 1)[-1]
        if name == LAST_CHECKPOINT:
            return (0, 0)
        return (2 if _COMMIT.match(name) else 1, -int(name[:20]))

    for path in sorted(damage.set_aside, key=order):
        src = f"{damage.table}/{path}"
        if root.get_file_info(src).type == pafs.FileType.NotFound:
            continue
        if _COMMIT.match(path.rsplit("/", 1)[-1]):
            for added in _added_paths(table, path):
                data = f"{damage.table}/{added}"
                if root.get_file_info(data).type != pafs.FileType.NotFound:
                    dest = f"{QUARANTINE_DIR}/{damage.table}/{added}"
                    root.create_dir(dest.rsplit("/", 1)[0], recursive=True)
                    root.move(data, dest)
        root.move(src, f"{log_dest}/{path.rsplit('/', 1)[-1]}")
    return f"{root_uri.rstrip('/')}/{log_dest}"


def log_entry_exists(
    table_uri: str, version: int, *, storage_options: dict[str, str] | None
) -> bool:
    """Whether commit `version` of the table at `table_uri` is still in its log (False also
    when the table folder itself is gone)."""
    try:
        fs = _fs(table_uri, storage_options)
    except TableNotFoundError:
        return False
    info = fs.get_file_info(f"{LOG_DIR}/{version:020d}.json")
    return info.type != pafs.FileType.NotFound
