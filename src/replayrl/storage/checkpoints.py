"""Checkpoints of a lineage: opaque folders, each publication in its own sub-folder, made
visible by a COMPLETE marker that names it and lists each file's size and sha256.

A checkpoint lives at `<lineage>/checkpoints/v000003/` (`LineagePaths.checkpoint`):

    v000003/COMPLETE          the marker (JSON, format 2): write_id, the sub-folder that
                              holds the files, the fencing epoch of the writer, and per file
                              its size and sha256
    v000003/w-<epoch>-<id>/   the files of one publication: the Hugging Face layout
                              (safetensors weight shards, tokenizer) and the training state of
                              a full checkpoint (optimizer*, rng_state*: only the trainer
                              reads those)

Failure and fencing: a publication writes its files into a fresh sub-folder nobody else
uses, fsyncs them and the folders (locally), then swaps the marker in by a
compare-and-swap (`objects.compare_and_swap`) that refuses (StaleOwnerError) when the
marker already there has a higher fencing epoch (`replayrl.storage.fencing`). So a crash or
a stale owner (stopped, then resumed after another owner took the lineage) never deletes or
rewrites files another publication made visible, and a lower epoch never replaces a higher
one. What a crash leaves (a sub-folder without a marker naming it) is deleted by
`prune_checkpoints` once it is superseded. Readers resolve the marker to the sub-folder
and check every file's size and sha256 (`checkpoint_local_dir`): a flipped bit, a
truncated shard or an unreadable marker is refused with one line naming the file.

Older markers still read: format 1 (JSON with sizes only, files in the version folder
itself, checked by size) and format 0 (the text "complete", files in the version folder,
nothing to check). Nothing here knows about models, losses or trackers. Every object
operation goes through `replayrl.storage.objects`, and each folder copy through
`replayrl.storage.transfer` (module attributes, looked up at each call, so a test that
patches one there reaches these calls).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from replayrl.errors import ReplayRLError
from replayrl.storage import fencing, objects, transfer
from replayrl.storage.objects import COMPLETE_MARKER, Digest

if TYPE_CHECKING:
    from replayrl.storage.state import LineagePaths

log = logging.getLogger(__name__)

# Files of a checkpoint only the trainer reads (generation and evaluation skip them) are
# named after these: optimizer.json, optimizer.safetensors, optimizer-00001-of-00004.
# safetensors, optimizer.safetensors.index.json, rng_state.safetensors, rng_state.json, and
# the optimizer.pt / rng_state.pt of older checkpoints.
TRAINING_STATE_PREFIXES = ("optimizer", "rng_state")
MARKER_FORMAT = 2
LEGACY_MARKER = b"complete\n"  # format 0: files in the version folder, nothing listed
# A publication's sub-folder: "w-<fencing epoch>-<12 hex digits>".
_FOLDER = re.compile(r"^w-(\d+)-[0-9a-f]+$")
_VERSION = re.compile(r"v\d{6}")  # a checkpoint's folder (`LineagePaths.checkpoint`)
_FIX = (
    "Restore the file from a copy, or start a new --lineage from an older complete "
    "checkpoint (--set model.source=<that checkpoint>)."
)


def is_training_state(name: str) -> bool:
    """Whether checkpoint file `name` is training state (optimizer or RNG state) that only
    the trainer reads. Example: "optimizer-00001-of-00002.safetensors" and "rng_state.json"
    are; "model.safetensors" and "tokenizer.json" are not."""
    return any(name == p or name.startswith((p + ".", p + "-")) for p in TRAINING_STATE_PREFIXES)


def is_complete(uri: str) -> bool:
    """Whether checkpoint `uri` has a COMPLETE marker (readers still check what it lists)."""
    return objects.exists(objects.join(uri, COMPLETE_MARKER))


# ---------------------------------------------------------------- the marker


class Listed(NamedTuple):
    """A file as the marker lists it: size in bytes, and sha256 (None in format 1)."""

    size: int
    sha256: str | None


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's COMPLETE marker, read. `folder` is the sub-folder holding the files
    ("" for formats 0 and 1: the version folder itself); `files` is None for format 0."""

    uri: str
    format: int
    write_id: str
    folder: str
    epoch: int
    files: dict[str, Listed] | None

    @property
    def files_uri(self) -> str:
        """Where the files of this publication lie."""
        return objects.join(self.uri, self.folder) if self.folder else self.uri


def read_manifest(uri: str) -> Manifest:
    """The COMPLETE marker of checkpoint `uri`. Missing: the checkpoint is incomplete;
    unreadable or malformed: refused, naming the marker (never trusted unchecked)."""
    marker = objects.join(uri, COMPLETE_MARKER)
    if not objects.exists(marker):
        raise ReplayRLError(_missing_message(uri))
    return parse_manifest(uri, objects.read_bytes(marker))


def _missing_message(uri: str) -> str:
    """Why checkpoint `uri` cannot be read, and what can bring a lineage back. A checkpoint
    a lineage's state.json names was complete when it was committed, so no resume writes it
    again (the iterations after it are committed too): the folder comes back from a copy, or
    the work goes on in a new lineage from the previous complete checkpoint."""
    what = (
        f"is incomplete (no {COMPLETE_MARKER} marker)"
        if objects.list_dir(uri)
        else "is gone (its folder was deleted or moved)"
    )
    parent, _, name = uri.rstrip("/").rpartition("/")
    earlier = None
    if _VERSION.fullmatch(name):
        older = sorted(
            (n for n in objects.list_dir(parent) if _VERSION.fullmatch(n) and n < name),
            reverse=True,
        )
        earlier = next((n for n in older if is_complete(objects.join(parent, n))), None)
    start = (
        f"start a new --lineage from the previous complete checkpoint, {earlier} "
        f"(--set model.source={objects.join(parent, earlier)})"
        if earlier
        else "start a new --lineage (no earlier complete checkpoint is left)"
    )
    return (
        f"Checkpoint '{uri}' {what}. A checkpoint that a lineage's state.json names was "
        f"committed complete, so resuming cannot write it again: put the folder back from a "
        f"copy, or {start}."
    )


def parse_manifest(uri: str, blob: bytes) -> Manifest:
    if blob == LEGACY_MARKER:
        return Manifest(uri, 0, "format0", "", 0, None)
    try:
        data = json.loads(blob)
        fmt = data["format"]
        write_id = str(data["write_id"])
        if fmt == 1:
            files = {str(n): Listed(_count(s), None) for n, s in data["files"].items()}
            folder, epoch = "", 0
        elif fmt == MARKER_FORMAT:
            files = {
                str(n): Listed(_count(f["size"]), _hex(f["sha256"]))
                for n, f in data["files"].items()
            }
            folder, epoch = str(data["folder"]), _count(data["epoch"])
            if not _FOLDER.match(folder):
                raise ValueError(f"bad folder {folder!r}")
        else:
            raise ValueError(f"unknown format {fmt!r}")
        if not re.fullmatch(r"[0-9A-Za-z_-]+", write_id):
            raise ValueError(f"bad write_id {write_id!r}")
        for name in files:
            if "/" in name or name in ("", ".", ".."):
                raise ValueError(f"bad file name {name!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ReplayRLError(
            f"Checkpoint marker '{objects.join(uri, COMPLETE_MARKER)}' is unreadable "
            f"({_one_line(e)}), so the checkpoint's files cannot be checked. {_FIX}"
        ) from None
    return Manifest(uri, fmt, write_id, folder, epoch, files)


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def _hex(value: object) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ValueError(f"{value!r} is not a sha256")
    return value


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


# ---------------------------------------------------------------- writing


def write_checkpoint(
    local_dir: Path, uri: str, *, skip: Callable[[str], bool] | None = None
) -> Manifest:
    """Publish the files of `local_dir` (but those `skip` is true for) as checkpoint `uri`:
    copy them into a fresh sub-folder (fsynced locally), then swap in the COMPLETE marker
    naming it (`mark_complete`). A reader only trusts what a marker names; nothing another
    publication wrote is touched."""
    epoch, folder = _new_folder(uri)
    files = transfer.upload_dir(local_dir, objects.join(uri, folder), skip=skip)
    return mark_complete(uri, folder=folder, epoch=epoch, files=files)


@contextlib.contextmanager
def writing_in_place(uri: str) -> Iterator[Path]:
    """A fresh local sub-folder of checkpoint `uri` (a local one) to write its files into,
    without a copy; when the block ends the files and folders are fsynced, hashed and the
    COMPLETE marker naming the sub-folder is swapped in. If the block raises, the sub-folder
    (this publication's own) is removed and nothing is published."""
    if objects.is_s3(uri):
        raise ValueError(f"writing_in_place needs a local checkpoint, not {uri}")
    epoch, folder = _new_folder(uri)
    out = Path(objects.normalize_root(objects.join(uri, folder)))
    out.mkdir(parents=True)
    try:
        yield out
        files = _sync_and_digest(out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    mark_complete(uri, folder=folder, epoch=epoch, files=files)


def _new_folder(uri: str) -> tuple[int, str]:
    """The fencing epoch this process writes `uri` with, and a sub-folder name for one new
    publication. Refuses (StaleOwnerError) at once when the lineage is fenced past it."""
    fencing.check(uri, f"write checkpoint {uri}")
    epoch = fencing.epoch_for(uri)
    return epoch, f"w-{epoch}-{uuid.uuid4().hex[:12]}"


def _sync_and_digest(folder: Path) -> dict[str, Digest]:
    """fsync every file of local `folder`, then the folder and its parent; each file's Digest."""
    out = {}
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name == COMPLETE_MARKER:
            continue
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        out[path.name] = objects.file_digest(path)
    objects.fsync_dir(str(folder))
    objects.fsync_dir(str(folder.parent))
    return out


def mark_complete(uri: str, *, folder: str, epoch: int, files: dict[str, Digest]) -> Manifest:
    """Make the publication in sub-folder `folder` of `uri` (its files durable, with these
    sizes and hashes) the checkpoint: the COMPLETE marker is replaced by a compare-and-swap
    that refuses (StaleOwnerError) when the marker there has a higher fencing epoch than
    `epoch`, or the lineage was fenced past this process's epoch meanwhile. An equal or lower
    one (this owner's crashed attempt, an older owner) is replaced."""
    manifest = {
        "format": MARKER_FORMAT,
        "write_id": uuid.uuid4().hex,
        "folder": folder,
        "epoch": epoch,
        "files": {n: {"size": d.size, "sha256": d.sha256} for n, d in sorted(files.items())},
    }
    blob = json.dumps(manifest, indent=1).encode()
    fence = fencing.for_uri(uri)
    root = uri if fence is None else fence.root

    def update(current: bytes | None) -> bytes:
        what = f"publish checkpoint {uri}"
        # The lineage fenced past this writer (it was stopped after writing its files):
        # refuse before the marker, so its publication stays invisible.
        fencing.check(uri, what)
        if current is not None:
            fencing.admit(fencing.epoch_of(current), epoch=epoch, root=root, what=what)
        return blob

    objects.compare_and_swap(objects.join(uri, COMPLETE_MARKER), update, action="publish")
    if not objects.is_s3(uri):
        # The version folder's own entry (new for a first publication), so the marker
        # survives a power loss before state.json names the checkpoint.
        objects.fsync_dir(os.path.dirname(objects.normalize_root(uri)))
    return parse_manifest(uri, blob)


def new_publication(uri: str) -> tuple[int, str]:
    """The fencing epoch and a fresh sub-folder name for one publication of checkpoint `uri`
    that several writers fill (`upload_part`, then `complete_parts`): the lease holder
    takes it, and tells the other writers the folder. Refuses (StaleOwnerError) at once when
    the lineage is fenced past this process."""
    return _new_folder(uri)


def upload_part(
    local_dir: Path, uri: str, *, folder: str, skip: Callable[[str], bool] | None = None
) -> dict[str, Digest]:
    """One writer's share of a publication of checkpoint `uri` (sub-folder `folder`, from
    `new_publication`): copy the files of its own `local_dir` there and return their
    Digests, for the lease holder's `complete_parts`. Writes no marker: a part alone is
    never a checkpoint."""
    if not _FOLDER.match(folder):
        raise ValueError(f"bad publication folder {folder!r}")
    return transfer.upload_dir(local_dir, objects.join(uri, folder), skip=skip)


def complete_parts(
    uri: str, *, folder: str, epoch: int, parts: list[dict[str, Digest] | None]
) -> Manifest:
    """Make the publication in sub-folder `folder` of `uri`, written by several writers (one
    Digest map from each writer's `upload_part`), the checkpoint: the COMPLETE marker names
    every writer's files (`mark_complete`). A writer that failed (None) or two writers that
    wrote one name with different bytes are refused with one line before any marker, so a
    checkpoint with a missing or clashing shard never counts as complete."""
    missing = [i for i, part in enumerate(parts) if part is None]
    if missing or not parts:
        raise ReplayRLError(
            f"Checkpoint {uri} was not published: writer(s) {missing or 'none'} of "
            f"{len(parts)} did not upload their files; the version before it stays current."
        )
    files: dict[str, Digest] = {}
    for i, part in enumerate(parts):
        assert part is not None
        for name, digest in part.items():
            if files.setdefault(name, digest) != digest:
                raise ReplayRLError(
                    f"Checkpoint {uri} was not published: writer {i} uploaded {name} with "
                    "other bytes than an earlier writer; the version before it stays current."
                )
    return mark_complete(uri, folder=folder, epoch=epoch, files=files)


class Publication:
    """A checkpoint being published (`publish_in_background`): `done()` says whether it has
    finished, either way; `wait()` blocks until it has and raises
    what stopped it (a ReplayRLError of one line for a storage failure; a bug raises as it
    is). A failed publication never swapped its COMPLETE marker in (that is its last step),
    so readers still see the version before it, or nothing; the files it left in its own
    sub-folder are deleted by `prune_checkpoints` once superseded."""

    def __init__(self, uri: str):
        self.uri = uri
        self._finished = threading.Event()
        self._error: BaseException | None = None

    @classmethod
    def finished(cls, uri: str) -> Publication:
        """A publication that already ran, in the caller's thread."""
        made = cls(uri)
        made._finished.set()
        return made

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        if not self._finished.wait(timeout_s):
            raise ReplayRLError(
                f"Publishing checkpoint '{self.uri}' is still running after {timeout_s:.0f} s."
            )
        if self._error is not None:
            raise self._error

    def join(self) -> None:
        """Wait until it has finished, without raising what failed (whoever holds the
        handle learns that from `wait()`)."""
        self._finished.wait()

    def _run(self, write: Callable[[], object], cleanup: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self._error = e
            log.warning("publishing checkpoint %s failed: %s", self.uri, _one_line(e))
        finally:
            try:
                cleanup()
            finally:
                self._finished.set()


def publish_in_background(
    uri: str, write: Callable[[], object], *, cleanup: Callable[[], None] = lambda: None
) -> Publication:
    """Run `write()` (which publishes checkpoint `uri`, its COMPLETE marker last) in a
    thread of its own, then `cleanup()` whatever happened; returns at once. The thread is a
    daemon: a process that exits without `wait()` leaves the publication unfinished, and so
    invisible (no marker), never half visible."""
    publication = Publication(uri)
    threading.Thread(
        target=publication._run,
        args=(write, cleanup),
        name=f"replayrl-publish-{uri.rstrip('/').rpartition('/')[2]}",
        daemon=True,
    ).start()
    return publication


# ---------------------------------------------------------------- reading


def checkpoint_files_uri(uri: str) -> str:
    """Where the files of checkpoint `uri` lie (the sub-folder its marker names)."""
    return read_manifest(uri).files_uri


def verify_checkpoint(
    manifest: Manifest, local_dir: Path, *, skip: Callable[[str], bool] = objects._skip_nothing
) -> None:
    """Check the files in `local_dir` (the checkpoint's folder, or a copy of it) against the
    sizes and sha256 its marker lists, except the names `skip` is true for (not copied).
    Raises a one-line ReplayRLError naming the first damaged file."""
    for name, listed in (manifest.files or {}).items():
        if skip(name):
            continue
        path = Path(local_dir) / name
        try:
            found = objects.file_digest(path)
        except FileNotFoundError:
            found = None
        except OSError as e:
            raise ReplayRLError(
                f"Checkpoint file '{_file_uri(manifest, name)}' is unreadable "
                f"({_one_line(e)}). {_FIX}"
            ) from None
        _compare(manifest, name, listed, found)


def _check_download(
    manifest: Manifest, skip: Callable[[str], bool]
) -> Callable[[dict[str, Digest]], None]:
    """A `download_dir` check: each downloaded file's size and sha256 against the marker."""

    def check(digests: dict[str, Digest]) -> None:
        for name, listed in (manifest.files or {}).items():
            if not skip(name):
                _compare(manifest, name, listed, digests.get(name))

    return check


def _compare(manifest: Manifest, name: str, listed: Listed, found: Digest | None) -> None:
    where = f"Checkpoint file '{_file_uri(manifest, name)}'"
    if found is None:
        raise ReplayRLError(
            f"{where} is missing, but its {COMPLETE_MARKER} marker lists it. {_FIX}"
        )
    if found.size != listed.size:
        raise ReplayRLError(
            f"{where} is damaged: it has {found.size} bytes but its {COMPLETE_MARKER} marker "
            f"lists {listed.size} bytes (truncated or partly overwritten). {_FIX}"
        )
    if listed.sha256 is not None and found.sha256 != listed.sha256:
        raise ReplayRLError(
            f"{where} is corrupt: its sha256 is {found.sha256[:16]}… but its "
            f"{COMPLETE_MARKER} marker lists {listed.sha256[:16]}… (flipped bits or an "
            f"overwrite). {_FIX}"
        )


def _file_uri(manifest: Manifest, name: str) -> str:
    return objects.join(manifest.files_uri, name)


def complete_versions(paths: LineagePaths) -> list[int]:
    return sorted(v for v in _versions(paths) if is_complete(paths.checkpoint(v)))


def _versions(paths: LineagePaths) -> list[int]:
    names = objects.list_dir(paths.checkpoints)
    return sorted(int(n[1:]) for n in names if n.startswith("v") and n[1:].isdigit())


def checkpoint_local_dir(uri: str, cache_dir: Path, *, weights_only: bool = False) -> Path:
    """A local directory holding the files of checkpoint `uri`, every one checked against
    the size and sha256 its COMPLETE marker lists. `weights_only` leaves out the training
    state (`is_training_state`: optimizer and RNG state), which generation and evaluation
    never read. A local checkpoint is used where it lies (its sub-folder).

    From S3 the files are downloaded into `cache_dir`, one entry per publication (keyed by
    the marker's write_id), staged privately and renamed into place, so concurrent readers
    of one checkpoint share a single verified copy and an entry a reader resolved is never
    replaced under it; a cached entry is reused only while its hashes still match (a damaged
    one is moved aside and fetched again)."""
    manifest = read_manifest(uri)
    skip = is_training_state if weights_only else objects._skip_nothing
    if not objects.is_s3(uri):
        local = Path(objects.normalize_root(manifest.files_uri))
        verify_checkpoint(manifest, local, skip=skip)
        return local
    entry = cached_copies_dir(uri, cache_dir, weights_only=weights_only) / manifest.write_id
    if entry.is_dir():
        try:
            verify_checkpoint(manifest, entry, skip=skip)
            return entry
        except ReplayRLError as e:
            log.warning("cached copy %s is damaged (%s): fetching it again", entry, e)
            _discard(entry)
    listed = manifest.files

    def leave_out(name: str) -> bool:
        if listed is None:  # format 0: everything but the marker
            return name == COMPLETE_MARKER or name.startswith(".")
        return name not in listed or skip(name)

    return transfer.download_dir(
        manifest.files_uri, entry, skip=leave_out, check=_check_download(manifest, skip)
    )


def cached_copies_dir(uri: str, cache_dir: Path, *, weights_only: bool = False) -> Path:
    """The folder of `cache_dir` under which `checkpoint_local_dir` keeps its copies of S3
    checkpoint `uri` (one sub-folder per publication, named by its write_id). For a folder
    `uri` above checkpoints (e.g. where published versions lie), the folder above theirs."""
    kind = "s3-weights" if weights_only else "s3"
    return Path(cache_dir) / kind / uri[len("s3://") :].rstrip("/")


def drop_cached_copies(uri: str, cache_dir: Path, *, weights_only: bool = False) -> int:
    """Delete the local copies of checkpoint `uri` that `checkpoint_local_dir` cached in
    `cache_dir` (nothing for a local checkpoint, which is never copied); returns how many.

    Each copy is first renamed aside in one step, then removed, so a crash mid-way leaves a
    `.<write_id>.dropped-*` folder that no reader ever resolves (and the next call here
    removes); even a copy damaged some other way is never used, as readers check every file
    against the marker's sha256 first. A download in progress (its `.<write_id>.tmp-*`
    folder) is left alone, and the version's folder goes only once it is empty. Only for a
    checkpoint no process of this machine will read from its copy again: one that already
    opened the files keeps reading them (unlinked files live on while open), one that
    resolved the copy but has not opened them yet would find them gone."""
    if not objects.is_s3(uri):
        return 0
    folder = cached_copies_dir(uri, cache_dir, weights_only=weights_only)
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return 0
    dropped = 0
    for name in names:
        path = folder / name
        if name.startswith("."):
            if ".dropped-" in name or ".damaged-" in name:
                shutil.rmtree(path, ignore_errors=True)  # what a crash here left
            continue  # a download in progress
        aside = folder / f".{name}.dropped-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, aside)
        except OSError:
            continue  # another process dropped it first
        shutil.rmtree(aside, ignore_errors=True)
        dropped += 1
    with contextlib.suppress(OSError):
        folder.rmdir()  # only when empty: no download in progress
    return dropped


def _discard(entry: Path) -> None:
    """Move a damaged cache entry aside in one rename (a concurrent download may install a
    good one at once), then delete it."""
    aside = entry.with_name(f".{entry.name}.damaged-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(entry, aside)
    except OSError:
        return  # another reader moved it first
    shutil.rmtree(aside, ignore_errors=True)


# ---------------------------------------------------------------- pruning


def prune_checkpoints(
    paths: LineagePaths, *, keep: int, protect: set[int], older_than: int | None = None
) -> list[int]:
    """After checkpoint `older_than` (default: the newest of `protect`, the one just
    committed) is the lineage's: delete complete checkpoints older than the newest `keep`
    (0: keep all) and never `protect`, and checkpoints a crash left without a marker, both
    only strictly older than `older_than`; in the versions kept up to `older_than`, delete
    the sub-folders of superseded publications (never the one the marker names, nor one of
    a higher epoch). A newer owner only ever writes versions past the one its lineage state
    names, so this never deletes anything it may still publish. Returns the versions deleted."""
    fencing.check(paths.root, "prune checkpoints")
    newest = max(protect) if older_than is None else older_than
    complete = complete_versions(paths)
    doomed = [v for v in complete[:-keep] if v < newest and v not in protect] if keep > 0 else []
    doomed += [v for v in _versions(paths) if v < newest and v not in protect and v not in complete]
    for v in sorted(doomed):
        objects.delete(paths.checkpoint(v))
    for v in complete:
        if v <= newest and v not in doomed:
            _prune_superseded(paths.checkpoint(v))
    return sorted(doomed)


def _prune_superseded(uri: str) -> None:
    try:
        manifest = read_manifest(uri)
    except ReplayRLError as e:
        log.warning("not pruning the sub-folders of %s: %s", uri, e)
        return
    for name in objects.list_dir(uri):
        m = _FOLDER.match(name)
        if m and name != manifest.folder and int(m.group(1)) <= manifest.epoch:
            objects.delete(objects.join(uri, name))
