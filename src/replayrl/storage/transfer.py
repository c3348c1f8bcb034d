"""Folders to and from a run root: `upload_dir` (the files of a checkpoint publication) and
`download_dir` (a reader's copy of them), each file's size and sha256 computed as it is
copied, so a COMPLETE marker can list them and a reader check them without a second read.

Locally files are copied one after another, each fsynced. On S3 several files go at once,
each in parallel multipart parts (upload) or ranged GETs (download) through one boto3
transfer manager per folder; `UPLOAD_*` and `DOWNLOAD_*` below say how many and why (a
15 GB folder in one stream per file moved at the speed of one connection). A file that
fails is sent or fetched again from its start under the S3 deadline; a download lands in a
private temp folder renamed into place, so nobody sees a partial copy.

Every object operation goes through `replayrl.storage.objects` (module attributes, looked
up at each call, so a test that patches one there reaches these calls); `checkpoints`
calls the two functions here the same way. Nothing here knows about models, losses or
trackers.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow.fs as pafs

from replayrl.errors import ReplayRLError
from replayrl.storage import objects, s3
from replayrl.storage.objects import COMPLETE_MARKER, Digest


def upload_dir(
    local_dir: Path, uri: str, *, skip: Callable[[str], bool] | None = None
) -> dict[str, Digest]:
    """Copy every file of `local_dir` to `uri` (a folder), except those whose name `skip` is
    true for and a COMPLETE marker, which only `checkpoints.mark_complete` writes (last);
    returns each copied file's Digest, of
    the bytes it read. Locally each copy is fsynced, then the folder and its parent, so a
    power loss cannot leave an empty shard under a marker written afterwards. Files are
    streamed: a multi-GB shard is never held in memory. On S3 several files go at once, each
    in multipart parts sent in parallel and hashed as they are read (`UPLOAD_STREAMS`)."""
    files = sorted(
        p
        for p in Path(local_dir).iterdir()
        if p.is_file() and p.name != COMPLETE_MARKER and not (skip and skip(p.name))
    )
    out: dict[str, Digest] = {}
    if not objects.is_s3(uri):
        dest = Path(objects.normalize_root(uri))
        objects.check_not_vanished(str(dest))
        try:
            dest.mkdir(parents=True, exist_ok=True)
            for item in files:
                with open(item, "rb") as src, open(dest / item.name, "wb") as f:
                    out[item.name] = objects._copy_stream(src.read, f.write)
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as e:
            raise ReplayRLError(
                f"Cannot write '{uri}': {e}. Check the run root is writable."
            ) from None
        objects.fsync_dir(str(dest))
        objects.fsync_dir(str(dest.parent))
        return out
    from concurrent.futures import ThreadPoolExecutor

    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    client = s3.client(objects.s3_settings())
    config = TransferConfig(
        multipart_threshold=UPLOAD_PART_BYTES,
        multipart_chunksize=UPLOAD_PART_BYTES,
        max_concurrency=UPLOAD_STREAMS,
    )
    # One transfer manager for the whole folder: its UPLOAD_STREAMS threads send the parts
    # of every file, so one big shard and many small ones both keep every stream busy.
    with (
        create_transfer_manager(client, config) as manager,
        ThreadPoolExecutor(max_workers=UPLOAD_FILES, thread_name_prefix="replayrl-upload") as pool,
    ):

        def upload(item: Path) -> Digest:
            target = objects.join(uri, item.name)
            return objects._io("upload", target, lambda: _put_file(manager, item, target))

        for item, digest in zip(files, pool.map(upload, files), strict=True):
            out[item.name] = digest
    return out


# S3 uploads (`upload_dir`): multipart parts of UPLOAD_PART_BYTES, sent by UPLOAD_STREAMS
# threads at once, UPLOAD_FILES files read (and hashed) at once. Eight streams stay inside
# the ten connections of `s3.client`'s pool (botocore's default). Each file being read holds
# up to ten parts in memory (s3transfer's bound for a stream it cannot seek): 640 MiB.
UPLOAD_PART_BYTES = 64 << 20
UPLOAD_STREAMS = 8
UPLOAD_FILES = 4


class _HashingReader:
    """A file read once, front to back, hashing what it hands out: s3transfer reads a
    stream without `seek` in order (its parts then go out in parallel), so the sha256 is of
    the bytes sent, computed beside the upload instead of in a second read."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._sha = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        chunk = self._f.read(n)
        self._sha.update(chunk)
        self.size += len(chunk)
        return chunk

    def digest(self) -> Digest:
        return Digest(self.size, self._sha.hexdigest())


def _put_file(manager: Any, item: Path, uri: str) -> Digest:
    """Upload local file `item` to S3 object `uri` in parallel multipart parts through
    `manager` (a boto3 transfer manager); its Digest. A failed part aborts the multipart
    upload (s3transfer does), so nothing of it becomes an object; `_io` starts it again."""
    bucket, key = s3.split(uri)
    with open(item, "rb") as src:
        reader = _HashingReader(src)
        manager.upload(reader, bucket, key).result()
    return reader.digest()


# S3 downloads (`download_dir`): each file in ranged GETs of DOWNLOAD_PART_BYTES,
# DOWNLOAD_STREAMS of them in flight at once over the whole folder, DOWNLOAD_FILES files
# fetched at once. One stream per file, one file after another (pyarrow's input stream,
# what `download_dir` did before) moved a 15 GB bf16 7B folder at the speed of one
# connection, which across a network is bound by its round trips, not by the link: with
# each connection paced to 50 MB/s, 2 x 64 MiB came 4.2 times faster in parallel
# (`bench/bench_download.py`). Eight streams stay inside the ten connections of
# `s3.client`'s pool (as for uploads). Parts can arrive out of order; s3transfer keeps them in memory until
# the file's next bytes are there, at most DOWNLOAD_WINDOW_PARTS parts for the whole folder
# (16 x 16 MiB = 256 MiB), and a file's writes (and their sha256) happen in order in one
# thread, which bounds a folder at about one core's sha256 speed (1.6 GB/s measured here).
DOWNLOAD_PART_BYTES = 16 << 20
DOWNLOAD_STREAMS = 8
DOWNLOAD_FILES = 4
DOWNLOAD_WINDOW_PARTS = 2 * DOWNLOAD_STREAMS


def download_dir(
    uri: str,
    local_dir: Path,
    *,
    skip: Callable[[str], bool] = objects._skip_nothing,
    check: Callable[[dict[str, Digest]], None] | None = None,
) -> Path:
    """Copy the files of folder `uri` into `local_dir`, but those whose name `skip` is true
    for. They land in a private temp folder next to `local_dir`; `check(digests)` (each
    downloaded file's size and sha256) may raise to refuse the copy, which is then removed;
    else the folder is renamed into place in one step. On S3 several files come at once,
    each in ranged GETs fetched in parallel and hashed as they are written
    (`DOWNLOAD_STREAMS`); a file whose download fails is fetched again from its start,
    under the S3 deadline.

    Safe under concurrent downloads of the same `uri` (threads or processes): when another
    one installed `local_dir` first, its copy is kept and this one is dropped, so a reader
    that already resolved `local_dir` never sees files deleted or replaced under it, and
    nobody sees a partial copy. A crash leaves at most a `.<name>.tmp-*` folder beside it.
    """
    fs, path = objects.filesystem(uri)
    local_dir = Path(local_dir)
    local_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=local_dir.parent, prefix=f".{local_dir.name}.tmp-"))
    try:
        files = _listed_files(fs, uri, path, skip)
        if objects.is_s3(uri):
            digests = _get_files(uri, files, tmp)
        else:
            digests = _copy_files(fs, uri, files, tmp)
        if check is not None:
            check(digests)
        try:
            os.rename(tmp, local_dir)
        except OSError as e:
            # ENOTEMPTY / EEXIST: another download installed its copy first; keep that one.
            if not local_dir.is_dir():
                raise ReplayRLError(
                    f"Cannot place the download of '{uri}' at '{local_dir}': {e}"
                ) from None
    except FileNotFoundError:
        raise ReplayRLError(f"'{uri}' does not exist; check the path.") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return local_dir


def _listed_files(
    fs: pafs.FileSystem, uri: str, path: str, skip: Callable[[str], bool]
) -> list[pafs.FileInfo]:
    """The files (not folders) of folder `uri` (`path` in `fs`) that `skip` keeps."""
    infos = objects._io("list", uri, lambda: fs.get_file_info(pafs.FileSelector(path)))
    return [i for i in infos if i.type == pafs.FileType.File and not skip(i.base_name)]


def _copy_files(
    fs: pafs.FileSystem, uri: str, files: list[pafs.FileInfo], dest: Path
) -> dict[str, Digest]:
    """Copy `files` (of folder `uri`) into folder `dest` one after another, each in one
    stream through `fs`, hashed as it is read; their Digests. The path of a local folder,
    and on S3 the one-stream baseline `bench/bench_download.py` measures against."""
    digests: dict[str, Digest] = {}
    for info in files:

        def get(info: pafs.FileInfo = info) -> Digest:
            with fs.open_input_stream(info.path) as src, open(dest / info.base_name, "wb") as f:
                return objects._copy_stream(src.read, f.write)

        digests[info.base_name] = objects._io("download", objects.join(uri, info.base_name), get)
    return digests


def _get_files(uri: str, files: list[pafs.FileInfo], dest: Path) -> dict[str, Digest]:
    """Download `files` of S3 folder `uri` into folder `dest`: DOWNLOAD_FILES at once, each
    in parallel ranged GETs through one boto3 transfer manager; their Digests."""
    from concurrent.futures import ThreadPoolExecutor

    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    client = s3.client(objects.s3_settings())
    config = TransferConfig(
        multipart_threshold=DOWNLOAD_PART_BYTES,
        multipart_chunksize=DOWNLOAD_PART_BYTES,
        max_concurrency=DOWNLOAD_STREAMS,
    )
    # s3transfer's bound on the parts of non-seekable downloads held in memory (default 10):
    # a window a little wider than the streams, so a slow part does not stall the others.
    config.max_in_memory_download_chunks = DOWNLOAD_WINDOW_PARTS
    # One transfer manager for the whole folder: its DOWNLOAD_STREAMS threads fetch the
    # parts of every file, so one big shard and many small ones both keep every stream busy.
    with (
        create_transfer_manager(client, config) as manager,
        ThreadPoolExecutor(
            max_workers=DOWNLOAD_FILES, thread_name_prefix="replayrl-download"
        ) as pool,
    ):

        def download(info: pafs.FileInfo) -> Digest:
            source = objects.join(uri, info.base_name)
            return objects._io(
                "download", source, lambda: _get_file(manager, source, dest / info.base_name)
            )

        return {
            info.base_name: digest
            for info, digest in zip(files, pool.map(download, files), strict=True)
        }


class _HashingWriter:
    """A file written once, front to back, hashing what it is handed. It says it cannot
    seek, so s3transfer writes it in order (its DownloadNonSeekableOutputManager holds
    parts that arrive early until the bytes before them are written, then writes from
    its one IO thread): the sha256 is of the bytes written, computed beside the parallel
    GETs instead of in a second read of the file."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._sha = hashlib.sha256()
        self.size = 0

    def seekable(self) -> bool:
        return False

    def write(self, chunk: bytes) -> int:
        self._sha.update(chunk)
        self.size += len(chunk)
        return self._f.write(chunk)

    def digest(self) -> Digest:
        return Digest(self.size, self._sha.hexdigest())


def _get_file(manager: Any, uri: str, target: Path) -> Digest:
    """Download S3 object `uri` into local file `target` (started anew: an attempt `_io`
    repeats writes it from its first byte) in parallel ranged GETs through `manager` (a
    boto3 transfer manager); its Digest. The ranged GETs carry the ETag of the object's
    HEAD (If-Match), so an object rewritten mid-download fails instead of mixing versions.
    A missing object is FileNotFoundError; a part that kept failing is its last error."""
    # s3transfer's own, re-exported by boto3 (whose imports mypy is told to skip)
    from boto3.s3.transfer import S3TransferRetriesExceededError as RetriesExceededError

    bucket, key = s3.split(uri)
    try:
        with open(target, "wb") as f:
            writer = _HashingWriter(f)
            manager.download(bucket, key, writer).result()
            return writer.digest()
    except RetriesExceededError as e:
        # s3transfer retried a part's broken stream itself; its last error says what broke
        # (a reset connection is transient, for `_io` to retry under the deadline).
        if e.last_exception is None:
            raise
        raise e.last_exception from None
    except Exception as e:
        if s3.classify(e) == "missing":  # HeadObject's 404, GetObject's NoSuchKey
            raise FileNotFoundError(uri) from None
        raise
