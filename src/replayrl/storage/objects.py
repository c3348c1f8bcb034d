"""Objects under a run root: URIs, the S3 settings, whole-object reads and writes, folders.

A run root is a local path, a `file://` URI (the embedded default) or `s3://bucket/prefix`;
what lives under it is described in `replayrl.storage.state` (a lineage's layout and
`state.json`) and `replayrl.storage.checkpoints` (checkpoint folders). Those two call the
functions here as module attributes, looked up at each call, so a test that patches one
here reaches every caller; so does `replayrl.storage.transfer`, which copies whole folders
(`upload_dir`, `download_dir`).

This module and `config` are the only ones that read environment variables: the S3
endpoint and credentials come from the standard AWS variables (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`); pyarrow
does not read `AWS_ENDPOINT_URL` itself, so it is passed explicitly.
`REPLAYRL_LEASE_TTL_S` (default 600 s, `cli_lease_ttl_s`) is how long the lease of a CLI run
lasts without renewal. `REPLAYRL_S3_DEADLINE_S` (default 120 s) is how long an S3 operation keeps retrying a
store that does not answer (connection refused, timeouts, 5xx) before it fails with a
`ReplayRLError`; wrong credentials and a missing bucket fail at once.

Failure: every object is written whole (locally a temp file and a rename; on S3 one PUT),
so a crash leaves the old object or the new one. `ensure_writable` (called when a lineage
is opened) refuses an S3 store that ignores the conditional writes `state.advance_state`
and the lease rely on. A local run root, and the lineage folder `ensure_folder_or_absent`
checks, are guarded from then on in this process: a write below one that was there and is
gone (deleted or moved while the run used it) raises a ReplayRLError instead of creating it
again, empty, beside nothing (`check_not_vanished`). Nothing here knows about models,
losses or trackers.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from replayrl.errors import ReplayRLError
from replayrl.storage import s3

T = TypeVar("T")
# The marker a checkpoint folder is published with, last (`checkpoints.mark_complete`);
# `transfer.upload_dir` never copies one.
COMPLETE_MARKER = "COMPLETE"
DEFAULT_S3_DEADLINE_S = 120.0


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def normalize_root(uri: str) -> str:
    """Local paths become absolute `file://`-free paths; s3:// URIs stay as they are."""
    if is_s3(uri):
        return uri.rstrip("/")
    if uri.startswith("file://"):
        uri = urlparse(uri).path
    elif "://" in uri:
        raise ReplayRLError(
            f"Unsupported run root '{uri}': use a local path, file://… or s3://bucket/prefix."
        )
    return str(Path(uri).expanduser().resolve())


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])


# ---------------------------------------------------------------- vanished folders

# Local folders a lineage was opened under in this process (the run root, the lineage's
# folder): what each is called, and whether it was seen to exist. A folder seen and then
# gone was deleted or moved behind the run's back; writing below it would recreate it.
_GUARDED: dict[str, tuple[str, bool]] = {}
_GUARD_LOCK = threading.Lock()


def guard_folder(uri: str, *, what: str) -> None:
    """Guard local folder `uri` (`what` names it: "Run root", "Lineage 'x' folder") from being
    recreated by a write below it once it was seen to exist; opening it again (this call)
    starts over, so a folder deleted between two opens is created anew as usual."""
    if is_s3(uri):
        return
    path = normalize_root(uri)
    with _GUARD_LOCK:
        _GUARDED[path] = (what, os.path.isdir(path))


def check_not_vanished(uri: str) -> None:
    """Raise a ReplayRLError when local `uri` lies below a guarded folder (`guard_folder`)
    that existed and is gone; nothing on S3, where prefixes are not folders."""
    if is_s3(uri):
        return
    path = normalize_root(uri)
    with _GUARD_LOCK:
        guarded = [(f, w, s) for f, (w, s) in _GUARDED.items() if _below(path, f)]
    for folder, what, seen in sorted(guarded, key=lambda g: len(g[0])):
        if os.path.isdir(folder):
            if not seen:
                with _GUARD_LOCK:
                    _GUARDED[folder] = (what, True)
            continue
        if seen:
            raise ReplayRLError(
                f"{what} '{folder}' is gone: it was deleted or moved while this run was using "
                f"it, so nothing more is written there (that would recreate it empty). Put it "
                f"back and rerun the same command to resume, or rerun with --run-root where it "
                f"is now."
            )


def _below(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _unguard_below(path: str) -> None:
    """Forget the guards of `path` and the folders below it (deleted on purpose)."""
    with _GUARD_LOCK:
        for folder in [f for f in _GUARDED if _below(f, path)]:
            del _GUARDED[folder]


# ---------------------------------------------------------------- settings


def s3_settings() -> dict[str, str]:
    """S3 endpoint and credentials from the standard environment variables."""
    env = os.environ
    out = {}
    for key in (
        "AWS_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_REGION",
    ):
        if env.get(key):
            out[key] = env[key]
    if "AWS_REGION" not in out and env.get("AWS_DEFAULT_REGION"):
        out["AWS_REGION"] = env["AWS_DEFAULT_REGION"]
    return out


def s3_deadline_s() -> float:
    """Seconds an S3 operation retries an unreachable store (REPLAYRL_S3_DEADLINE_S)."""
    raw = os.environ.get("REPLAYRL_S3_DEADLINE_S", "")
    if not raw:
        return DEFAULT_S3_DEADLINE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ReplayRLError(f"REPLAYRL_S3_DEADLINE_S must be seconds >= 0, got {raw!r}.")
    return value


DEFAULT_CLI_LEASE_TTL_S = 600.0


def cli_lease_ttl_s() -> float:
    """How long the lease of a run started from the CLI (`replayrl run`, `replayrl buffer
    vacuum|repair`) outlives its last renewal: REPLAYRL_LEASE_TTL_S, default 600 s. A run
    stopped without releasing (SIGSTOP, a paused VM) loses its lineage to the next run after
    this plus a third of it (the clock-skew allowance); a killed run's lease is taken at once
    on the same machine."""
    raw = os.environ.get("REPLAYRL_LEASE_TTL_S", "")
    if not raw:
        return DEFAULT_CLI_LEASE_TTL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ReplayRLError(f"REPLAYRL_LEASE_TTL_S must be seconds > 0, got {raw!r}.")
    return value


def _secrets() -> list[str]:
    s = s3_settings()
    return [s.get("AWS_SECRET_ACCESS_KEY", ""), s.get("AWS_SESSION_TOKEN", "")]


def redact(text: str) -> str:
    """`text` with the S3 secret key and session token replaced by ***."""
    return s3.clean(text, secrets=_secrets())


def delta_storage_options(uri: str) -> dict[str, str] | None:
    """Options for delta-rs: endpoint, credentials, plain HTTP for a loopback endpoint,
    conditional puts for commits, and retries of an unreachable store up to the deadline."""
    if not is_s3(uri):
        return None
    s = s3_settings()
    opts = {k: v for k, v in s.items()}
    opts.setdefault("AWS_REGION", "us-east-1")
    endpoint = s.get("AWS_ENDPOINT_URL", "")
    if endpoint.startswith("http://"):
        opts["AWS_ALLOW_HTTP"] = "true"
    # Path-style addressing works with every S3-compatible server (SeaweedFS, MinIO).
    opts["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "false"
    # Concurrent writers are safe because a commit is a put-if-absent of the next log
    # entry. delta-rs 1.x already does that on S3; say so, so a changed default cannot
    # silently turn it into last-writer-wins.
    opts["aws_conditional_put"] = "etag"
    # object_store retries each request with exponential backoff until either limit.
    opts["max_retries"] = "1000"
    opts["retry_timeout"] = f"{max(1, round(s3_deadline_s()))}s"
    opts["backoff_config.init_backoff"] = "200ms"
    opts["backoff_config.max_backoff"] = "5s"
    return opts


def filesystem(uri: str, settings: dict[str, str] | None = None) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it for `uri`; on S3 with `settings` (the keys
    of `s3_settings`, which are the default; other keys are ignored)."""
    if is_s3(uri):
        s = s3_settings() if settings is None else settings
        endpoint = s.get("AWS_ENDPOINT_URL")
        kwargs: dict[str, Any] = {"region": s.get("AWS_REGION", "us-east-1")}
        if endpoint:
            parsed = urlparse(endpoint)
            kwargs["endpoint_override"] = parsed.netloc or endpoint
            kwargs["scheme"] = parsed.scheme or "https"
        if s.get("AWS_ACCESS_KEY_ID"):
            kwargs["access_key"] = s["AWS_ACCESS_KEY_ID"]
            kwargs["secret_key"] = s.get("AWS_SECRET_ACCESS_KEY", "")
            if s.get("AWS_SESSION_TOKEN"):
                kwargs["session_token"] = s["AWS_SESSION_TOKEN"]
        # Few quick attempts inside pyarrow: `_io` owns backoff and the deadline.
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=2)
        kwargs["connect_timeout"] = 5
        kwargs["request_timeout"] = 60
        fs = pafs.S3FileSystem(**kwargs)
        return fs, uri[len("s3://") :]
    return pafs.LocalFileSystem(), normalize_root(uri)


def folder_filesystem(uri: str, settings: dict[str, str] | None = None) -> pafs.FileSystem:
    """pyarrow's own file system rooted at folder `uri` (paths inside it are relative), for
    pyarrow's readers (datasets, Parquet fragments).

    Why not delta-rs's `DeltaStorageHandler`: it is Python, wrapped in a `PyFileSystem`, and
    pyarrow's IO threads call into it; one that does so while the interpreter is exiting
    aborts the process after its work is done ("terminate called without an active
    exception", exit -6). Measured on 2 cores under load: 10 % of local and 26 % of S3 table
    reads followed by exit aborted that way; 0 of 520 with this file system."""
    fs, path = filesystem(uri, settings)
    return pafs.SubTreeFileSystem(path.rstrip("/"), fs)


class _NotTransient(Exception):
    """Carries an error `retried_on_s3` must not retry or translate through `s3.retry`."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def retried_on_s3(action: str, uri: str, fn: Callable[[], T]) -> T:
    """`fn()`, an idempotent read of `uri`: on S3 its transient failures (the store
    unreachable, throttling) are retried under the deadline like every other object
    operation, and past it they are a ReplayRLError; any other error (a missing or damaged
    file, a bug) is raised as it is, for the caller to translate (a damaged data file is
    named by the buffer's own check). Elsewhere `fn()` runs as it is."""
    if not is_s3(uri):
        return fn()

    def attempt() -> T:
        try:
            return fn()
        except Exception as e:
            if s3.is_library_error(e) and s3.classify(e) == "transient":
                raise
            raise _NotTransient(e) from None

    try:
        return _io(action, uri, attempt)
    except _NotTransient as wrapped:
        raise wrapped.error from None


def _io(action: str, uri: str, fn: Callable[[], T]) -> T:
    """Run an idempotent operation on `uri`: retried under the deadline on S3, and any
    failure but a missing object (FileNotFoundError) turned into a ReplayRLError."""
    if is_s3(uri):
        return s3.retry(
            fn,
            action=action,
            uri=uri,
            endpoint=s3_settings().get("AWS_ENDPOINT_URL"),
            deadline_s=s3_deadline_s(),
            secrets=_secrets(),
        )
    try:
        return fn()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ReplayRLError(f"Cannot {action} '{uri}': {e}") from None


# ---------------------------------------------------------------- objects


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    info = _io("look up", uri, lambda: fs.get_file_info(path))
    if info.type == pafs.FileType.NotFound:
        _check_bucket(fs, uri, action="look up")
        return False
    return True


def _check_bucket(fs: pafs.FileSystem, uri: str, *, action: str) -> None:
    """On S3, when an object `uri` is not there: raise the missing bucket's error if its
    bucket is gone (deleted under a lineage, or a typo), so that it does not read as "no
    such lineage". pyarrow answers a missing bucket's keys with NotFound, without a word
    about the bucket. A bucket the credentials may not look at (403) counts as there."""
    if not is_s3(uri):
        return
    bucket = s3.bucket_of(uri)
    try:
        gone = fs.get_file_info(bucket).type == pafs.FileType.NotFound
    except OSError:
        return  # no HeadBucket permission, or a hiccup: the caller's answer stands
    if gone:
        raise s3.missing_bucket(
            action=action, uri=uri, endpoint=s3_settings().get("AWS_ENDPOINT_URL")
        )


def read_bytes(uri: str) -> bytes:
    """The whole object. On S3 in one GET: pyarrow's input stream asks the object's size
    first (HEAD) and then reads that many bytes, so an object rewritten between the two
    (a board record, a lease) came back cut short or mixed."""
    fs, path = filesystem(uri)

    def read() -> bytes:
        if is_s3(uri):
            blob, _ = s3.get_with_etag(s3.client(s3_settings()), uri)
            if blob is None:
                raise FileNotFoundError(uri)
            return blob
        with fs.open_input_stream(path) as f:
            return f.read()

    try:
        return _io("read", uri, read)
    except FileNotFoundError:
        _check_bucket(fs, uri, action="read")
        raise ReplayRLError(f"'{uri}' does not exist.") from None


def open_input(uri: str) -> pa.NativeFile:
    """A binary file object for reading `uri` (used by dataset loaders)."""
    fs, path = filesystem(uri)
    try:
        return _io("open", uri, lambda: fs.open_input_file(path))
    except FileNotFoundError:
        raise ReplayRLError(f"'{uri}' does not exist; check the path.") from None


def write_bytes_atomic(uri: str, data: bytes) -> None:
    """Write a whole object. Locally: a temp file in the same folder, then rename, so a
    reader never sees half a file. On S3 a PUT is already all-or-nothing."""
    fs, path = filesystem(uri)
    if is_s3(uri):

        def put() -> None:
            with fs.open_output_stream(path) as f:
                f.write(data)

        _io("write", uri, put)
        return
    check_not_vanished(path)
    try:
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(folder)
    except OSError as e:
        raise ReplayRLError(f"Cannot write '{uri}': {e}. Check the run root is writable.") from None


def fsync_dir(folder: str) -> None:
    """Flush a local folder's entries (a rename, a new file) to disk, so they survive a power
    loss. Filesystems that cannot fsync a directory are skipped."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


LOCK_TIMEOUT_S = 60.0


@contextlib.contextmanager
def file_lock(path: str, *, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """An exclusive lock on the local file `path` (made if missing), for the read-decide-write
    of a local compare-and-swap. Waits up to `timeout_s`, then raises a ReplayRLError that
    names the lock: a process stopped (SIGSTOP, a paused VM) while holding it keeps it."""
    import fcntl

    check_not_vanished(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ReplayRLError(
                        f"Lock '{path}' has been held for over {timeout_s:.0f} s by another "
                        f"process (stopped or hung?). Stop that process and retry."
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def lock_path(uri: str) -> str:
    """The lock file of local object `uri`'s compare-and-swap: `.<name>.lock` beside it,
    hidden (and left out of `list_dir`), so listings of a folder see only its objects."""
    path = normalize_root(uri)
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.lock")


def compare_and_swap(
    uri: str, update: Callable[[bytes | None], bytes | None], *, action: str = "update"
) -> bytes | None:
    """Replace the object at `uri` with `update(current bytes or None)` only if nobody wrote
    it in between; returns what was written (None: `update` chose to write nothing). `update`
    may raise to refuse (e.g. a stale fencing epoch) and is called again after a lost race.
    Locally under an exclusive lock file (`lock_path`); on S3 a conditional PUT (If-Match
    the ETag just read, If-None-Match for a new object). A retried S3 PUT whose first attempt
    landed finds its own bytes there and succeeds."""
    if not is_s3(uri):
        with file_lock(lock_path(uri)):
            current = read_bytes(uri) if exists(uri) else None
            new = update(current)
            if new is not None and new != current:
                write_bytes_atomic(uri, new)
            return new
    client = s3.client(s3_settings())
    written: list[bytes | None] = []

    def swap() -> bytes | None:
        for _ in range(8):
            blob, etag = s3.get_with_etag(client, uri)
            if written and blob == written[-1]:
                return blob  # our own earlier attempt landed
            new = update(blob)
            if new is None or new == blob:
                return new
            written.append(new)
            if s3.put_if(client, uri, new, etag=etag):
                return new
        raise ReplayRLError(
            f"'{uri}' kept changing while this run tried to {action} it: another run is "
            "writing it. Stop one of them."
        )

    return _io(action, uri, swap)


def ensure_writable(root: str) -> None:
    """Fail early, with the fix, when the run root cannot be written, or (on S3) when its
    store ignores the conditional writes `advance_state` and the lease rely on. That check
    (`s3.check_conditional_writes`) runs once per process per endpoint and run root. A local
    run root is guarded from then on (`guard_folder`)."""
    probe = join(root, f".probe-{uuid.uuid4().hex[:8]}")
    if is_s3(root):
        # Also proves boto3 is there for the state compare-and-swap, before any work.
        settings = s3_settings()
        client = s3.client(settings)
        write_bytes_atomic(probe, b"ok")  # its error names credentials or bucket
        delete(probe)
        s3.check_conditional_writes(
            client,
            normalize_root(root),  # one verdict for s3://b/runs and s3://b/runs/
            endpoint=settings.get("AWS_ENDPOINT_URL"),
            deadline_s=s3_deadline_s(),
            secrets=_secrets(),
        )
        return
    guard_folder(root, what="Run root")  # opened again: created anew if it is not there
    try:
        write_bytes_atomic(probe, b"ok")
        delete(probe)
    except ReplayRLError:
        raise ReplayRLError(
            f"Run root '{root}' cannot be written. Pick a writable --run-root (a local folder or "
            f"s3://bucket/prefix with credentials in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)."
        ) from None
    guard_folder(root, what="Run root")  # it exists now


def ensure_folder_or_absent(uri: str, *, what: str) -> None:
    """Refuse, with one line, a local `uri` that exists and is not a folder (on S3 a prefix
    is never a file in the way); then guard it (`guard_folder`): once it exists, a write
    below it that finds it gone refuses instead of recreating it."""
    if is_s3(uri):
        return
    path = Path(normalize_root(uri))
    if path.exists() and not path.is_dir():
        raise ReplayRLError(
            f"{what} '{path}' is a file, not a folder. Move it away or pick another name."
        )
    guard_folder(uri, what=f"{what} folder")


def delete(uri: str) -> None:
    """Delete a file or a whole directory; nothing there is fine."""
    fs, path = filesystem(uri)

    def remove() -> None:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            return
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(path)
        else:
            fs.delete_file(path)

    try:
        _io("delete", uri, remove)
    except FileNotFoundError:
        return
    finally:
        if not is_s3(uri):
            _unguard_below(path)


def list_dir(uri: str) -> list[str]:
    """Names in folder `uri`, except hidden ones (lock files, a write's temporary file)."""
    fs, path = filesystem(uri)
    sel = pafs.FileSelector(path, allow_not_found=True)
    infos = _io("list", uri, lambda: fs.get_file_info(sel))
    return sorted(i.base_name for i in infos if not i.base_name.startswith("."))


class Digest(NamedTuple):
    """A file's size in bytes and the sha256 of its content (hex)."""

    size: int
    sha256: str


CHUNK_BYTES = 8 << 20  # a file is copied, hashed and uploaded 8 MiB at a time


def _copy_stream(read: Callable[[int], bytes], write: Callable[[bytes], Any]) -> Digest:
    digest, size = hashlib.sha256(), 0
    while chunk := read(CHUNK_BYTES):
        digest.update(chunk)
        write(chunk)
        size += len(chunk)
    return Digest(size, digest.hexdigest())


def file_digest(path: Path) -> Digest:
    """The size and sha256 of local file `path`, read in chunks."""
    with open(path, "rb") as f:
        return _copy_stream(f.read, lambda chunk: None)


def _skip_nothing(name: str) -> bool:
    """The default `skip` of `transfer.download_dir` (and `checkpoints.verify_checkpoint`):
    none."""
    return False
