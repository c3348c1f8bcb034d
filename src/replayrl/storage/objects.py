"""Where a lineage keeps its state: run-root URIs, files, checkpoints and `state.json`.

A run root is a local path, a `file://` URI (the embedded default) or `s3://bucket/prefix`.
One lineage lives under `<run root>/<lineage>/`:

    state.json            next iteration, policy version, the last full checkpoint (with
                          the buffer table versions it pairs with), MLflow run id
    config.yaml           the resolved config the lineage was started with
    buffer/rollouts       the replay buffer (Delta table, see `buffer.py`)
    buffer/usage          one row per use of a rollout (Delta table)
    checkpoints/v000003/  Hugging Face layout (safetensors weight shards, tokenizer), the
                          training state of a full checkpoint (optimizer*, rng_state*: only
                          the trainer reads those), then a COMPLETE marker

This module and `config` are the only ones that read environment variables: the S3
endpoint and credentials come from the standard AWS variables (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`); pyarrow
does not read `AWS_ENDPOINT_URL` itself, so it is passed explicitly.
`REPLAYRL_S3_DEADLINE_S` (default 120 s) is how long an S3 operation keeps retrying a
store that does not answer (connection refused, timeouts, 5xx) before it fails with a
`ReplayRLError`; wrong credentials and a missing bucket fail at once.

Failure and concurrency: every object is written whole (locally a temp file and a rename;
on S3 one PUT), so a crash leaves the old object or the new one. A checkpoint counts only
once its COMPLETE marker exists; the marker is written last and lists each file's size, so
a reader also notices a checkpoint damaged after it was published. `advance_state` is a
compare-and-swap: under an exclusive file lock locally, an S3 conditional write on S3;
`ensure_writable` (called when a lineage is opened) refuses an S3 store that ignores
conditional writes, where the swap would silently be last-writer-wins.
Nothing here knows about models, losses or trackers: checkpoints are opaque directories.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from replayrl.errors import ReplayRLError
from replayrl.storage import s3

T = TypeVar("T")
COMPLETE_MARKER = "COMPLETE"
# Files of a checkpoint only the trainer reads (generation and evaluation skip them) are
# named after these: optimizer.json, optimizer.safetensors, optimizer-00001-of-00004.
# safetensors, optimizer.safetensors.index.json, rng_state.safetensors, rng_state.json, and
# the optimizer.pt / rng_state.pt of older checkpoints.
TRAINING_STATE_PREFIXES = ("optimizer", "rng_state")
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


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it for `uri`."""
    if is_s3(uri):
        s = s3_settings()
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
    return info.type != pafs.FileType.NotFound


def read_bytes(uri: str) -> bytes:
    fs, path = filesystem(uri)

    def read() -> bytes:
        with fs.open_input_stream(path) as f:
            return f.read()

    try:
        return _io("read", uri, read)
    except FileNotFoundError:
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
    try:
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise ReplayRLError(f"Cannot write '{uri}': {e}. Check the run root is writable.") from None


def ensure_writable(root: str) -> None:
    """Fail early, with the fix, when the run root cannot be written, or (on S3) when its
    store ignores the conditional writes `advance_state` and the lease rely on. That check
    (`s3.check_conditional_writes`) runs once per process per endpoint and run root."""
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
    try:
        write_bytes_atomic(probe, b"ok")
        delete(probe)
    except ReplayRLError:
        raise ReplayRLError(
            f"Run root '{root}' cannot be written. Pick a writable --run-root (a local folder or "
            f"s3://bucket/prefix with credentials in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)."
        ) from None


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


def list_dir(uri: str) -> list[str]:
    fs, path = filesystem(uri)
    sel = pafs.FileSelector(path, allow_not_found=True)
    return sorted(info.base_name for info in _io("list", uri, lambda: fs.get_file_info(sel)))


def upload_dir(local_dir: Path, uri: str) -> None:
    """Copy every file of `local_dir` to `uri` (a folder), except a COMPLETE marker, which
    only `mark_complete` writes (last). Locally a plain copy."""
    files = sorted(
        p for p in Path(local_dir).iterdir() if p.is_file() and p.name != COMPLETE_MARKER
    )
    if not is_s3(uri):
        dest = Path(normalize_root(uri))
        dest.mkdir(parents=True, exist_ok=True)
        for item in files:
            shutil.copy2(item, dest / item.name)
        return
    fs, path = filesystem(uri)
    for item in files:

        def put(item: Path = item) -> None:
            with fs.open_output_stream(f"{path}/{item.name}") as f:
                f.write(item.read_bytes())

        _io("upload", join(uri, item.name), put)


def is_training_state(name: str) -> bool:
    """Whether checkpoint file `name` is training state (optimizer or RNG state) that only
    the trainer reads. Example: "optimizer-00001-of-00002.safetensors" and "rng_state.json"
    are; "model.safetensors" and "tokenizer.json" are not."""
    return any(name == p or name.startswith((p + ".", p + "-")) for p in TRAINING_STATE_PREFIXES)


def _skip_nothing(name: str) -> bool:
    return False


def download_dir(uri: str, local_dir: Path, *, skip: Callable[[str], bool] = _skip_nothing) -> Path:
    """Copy the files of folder `uri` into `local_dir`, but those whose name `skip` is
    true for. They land in a temp folder first and are renamed into place, so a crash never
    leaves a partial copy at `local_dir`."""
    fs, path = filesystem(uri)
    local_dir = Path(local_dir)
    local_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=local_dir.parent, prefix=f".{local_dir.name}.tmp-"))
    try:
        infos = _io("list", uri, lambda: fs.get_file_info(pafs.FileSelector(path)))
        for info in infos:
            if info.type != pafs.FileType.File or skip(info.base_name):
                continue

            def get(info: pafs.FileInfo = info) -> bytes:
                with fs.open_input_stream(info.path) as f:
                    return f.read()

            (tmp / info.base_name).write_bytes(_io("download", join(uri, info.base_name), get))
        shutil.rmtree(local_dir, ignore_errors=True)
        os.replace(tmp, local_dir)
    except FileNotFoundError:
        raise ReplayRLError(f"'{uri}' does not exist; check the path.") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return local_dir


# ---------------------------------------------------------------- lineage layout


@dataclass(frozen=True)
class LineagePaths:
    root: str  # <run root>/<lineage>

    @property
    def state(self) -> str:
        return join(self.root, "state.json")

    @property
    def config(self) -> str:
        return join(self.root, "config.yaml")

    @property
    def buffer(self) -> str:
        return join(self.root, "buffer")

    @property
    def checkpoints(self) -> str:
        return join(self.root, "checkpoints")

    def checkpoint(self, version: int) -> str:
        return join(self.checkpoints, f"v{version:06d}")

    @property
    def eval_dir(self) -> str:
        return join(self.root, "eval")

    @property
    def inputs(self) -> str:
        """Inputs downloaded once for the lineage (`replayrl.policy.hub`)."""
        return join(self.root, "inputs")

    @property
    def dataset(self) -> str:
        return join(self.inputs, "dataset.parquet")

    @property
    def hub_record(self) -> str:
        return join(self.inputs, "hub.json")


def lineage_paths(run_root: str, lineage: str) -> LineagePaths:
    if not lineage or "/" in lineage or lineage.startswith("."):
        raise ReplayRLError(
            f"Lineage name '{lineage}' is not valid: use letters, digits, '-' and '_'."
        )
    return LineagePaths(join(normalize_root(run_root), lineage))


# ---------------------------------------------------------------- checkpoints


def is_complete(uri: str) -> bool:
    return exists(join(uri, COMPLETE_MARKER))


def write_checkpoint(local_dir: Path, uri: str) -> None:
    """Publish a checkpoint: clear any partial output a crashed attempt left at `uri`,
    copy the files, then write the COMPLETE marker last. A reader only trusts marked ones."""
    delete(uri)
    upload_dir(local_dir, uri)
    mark_complete(uri, files=_sizes(Path(local_dir)))


def _sizes(local_dir: Path) -> dict[str, int]:
    return {
        p.name: p.stat().st_size
        for p in sorted(Path(local_dir).iterdir())
        if p.is_file() and p.name != COMPLETE_MARKER
    }


def mark_complete(uri: str, *, files: dict[str, int] | None = None) -> None:
    """Write the COMPLETE marker of a checkpoint whose files are all in place. The marker
    lists each file's size in bytes (`files`; by default what is at `uri` now)."""
    if files is None:
        fs, path = filesystem(uri)
        infos = _io("list", uri, lambda: fs.get_file_info(pafs.FileSelector(path)))
        files = {
            i.base_name: int(i.size)
            for i in infos
            if i.type == pafs.FileType.File and i.base_name != COMPLETE_MARKER
        }
    # `write_id` makes every publication's marker unique, so a cached copy of an earlier
    # publication of the same version is recognised as stale.
    manifest = {"format": 1, "write_id": uuid.uuid4().hex, "files": dict(sorted(files.items()))}
    write_bytes_atomic(join(uri, COMPLETE_MARKER), json.dumps(manifest, indent=1).encode())


def verify_checkpoint(
    uri: str, local_dir: Path, *, skip: Callable[[str], bool] = _skip_nothing
) -> None:
    """Check the files in `local_dir` (a copy of checkpoint `uri`) against the sizes its
    COMPLETE marker lists, except the names `skip` is true for (not copied). Markers
    written before sizes were recorded are trusted."""
    try:
        manifest = json.loads((Path(local_dir) / COMPLETE_MARKER).read_bytes())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    for name, size in files.items():
        if skip(name):
            continue
        path = Path(local_dir) / name
        actual = path.stat().st_size if path.exists() else None
        if actual != size:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise ReplayRLError(
                f"Checkpoint '{uri}' is damaged: '{name}' {found} but its {COMPLETE_MARKER} "
                f"marker lists {size} bytes (truncated or partly overwritten). Restore the "
                f"file from a copy, or start a new --lineage from an older complete checkpoint "
                f"(--set model.source=<that checkpoint>)."
            )


def complete_versions(paths: LineagePaths) -> list[int]:
    out = []
    for name in list_dir(paths.checkpoints):
        if (
            name.startswith("v")
            and name[1:].isdigit()
            and is_complete(paths.checkpoint(int(name[1:])))
        ):
            out.append(int(name[1:]))
    return sorted(out)


def checkpoint_local_dir(uri: str, cache_dir: Path, *, weights_only: bool = False) -> Path:
    """A local directory holding the checkpoint at `uri` (downloaded from S3 if needed),
    checked against the sizes its COMPLETE marker lists. `weights_only` skips the training
    state (`is_training_state`: optimizer and RNG state) on S3, so generation and
    evaluation never download it; a local checkpoint is used where it lies."""
    if not is_complete(uri):
        raise ReplayRLError(
            f"Checkpoint '{uri}' is missing or incomplete (no {COMPLETE_MARKER} marker). "
            f"Resume the lineage so the step that writes it runs again."
        )
    skip = is_training_state if weights_only else _skip_nothing
    if not is_s3(uri):
        local = Path(normalize_root(uri))
        verify_checkpoint(uri, local, skip=skip)
        return local
    local = cache_dir / ("s3-weights" if weights_only else "s3") / uri[len("s3://") :]
    cached_marker = local / COMPLETE_MARKER
    if cached_marker.exists() and cached_marker.read_bytes() == read_bytes(
        join(uri, COMPLETE_MARKER)
    ):
        try:
            verify_checkpoint(uri, local, skip=skip)
            return local
        except ReplayRLError:
            pass  # a damaged cached copy: fetch it again
    download_dir(uri, local, skip=skip)
    verify_checkpoint(uri, local, skip=skip)
    return local


def prune_checkpoints(paths: LineagePaths, *, keep: int, protect: set[int]) -> list[int]:
    """Delete complete checkpoints older than the newest `keep`, except `protect`."""
    if keep <= 0:
        return []
    versions = complete_versions(paths)
    doomed = [v for v in versions[:-keep] if v not in protect]
    for v in doomed:
        delete(paths.checkpoint(v))
    return doomed


# ---------------------------------------------------------------- state.json


@dataclass(frozen=True)
class LineageState:
    lineage: str
    arm: str
    seed: int
    config_hash: str
    next_iteration: int = 1  # iterations are 1-based; iteration t trains v_{t-1} -> v_t
    policy_version: int = 0  # newest complete checkpoint of the lineage
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    # Cumulative compute ledger, so a resumed lineage continues the totals.
    ledger: dict[str, float] | None = None
    # Metrics of the last committed iteration, written with the commit so they reach the
    # tracker exactly once even when the process dies right after the commit:
    # {"iteration": t, "timestamp_ms": ms, "groups": [[step, {name: value}], ...]}.
    last_metrics: dict[str, Any] | None = None
    # The last full checkpoint, which a crashed run rewinds to: {"iteration": c,
    # "policy_version": v, "rollouts_version": Delta version of buffer/rollouts after
    # iteration c (None: no table yet), "usage_version": same for buffer/usage, "ledger":
    # the cumulative ledger after iteration c}. None in states written before checkpoint
    # cadence existed: every committed iteration had its checkpoint then.
    checkpoint: dict[str, Any] | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()


def _parse_state(paths: LineagePaths, blob: bytes) -> LineageState:
    try:
        return LineageState(**json.loads(blob))
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
        raise ReplayRLError(
            f"Lineage state '{paths.state}' is unreadable ({e}). Restore it or start a new --lineage."
        ) from None


def read_state(paths: LineagePaths) -> LineageState | None:
    if not exists(paths.state):
        return None
    return _parse_state(paths, read_bytes(paths.state))


def check_iteration_open(paths: LineagePaths, *, iteration: int) -> None:
    """Raise when the lineage already committed `iteration`: a run that lost the race for
    it must not overwrite rows or checkpoints the winner's commit points at."""
    state = read_state(paths)
    if state is not None and state.next_iteration > iteration:
        raise ReplayRLError(
            f"Iteration {iteration} of the lineage at {paths.root} was already committed "
            f"(state.json says next iteration {state.next_iteration}): another run is advancing "
            f"this lineage. This run stops without writing; stop one of the two runs."
        )


def advance_state(
    paths: LineagePaths, new: LineageState, *, expected_next_iteration: int | None
) -> None:
    """Replace state.json if it still says `expected_next_iteration` (None: must not exist).

    A real compare-and-swap: locally under an exclusive file lock, on S3 a conditional
    write (`If-Match` the ETag just read, or `If-None-Match: *` for a new lineage), so of
    two runs advancing the same iteration exactly one wins and the other gets a
    ReplayRLError. On S3, a retry whose first attempt landed (its answer was lost on the
    way back) finds its own state there and succeeds.
    """
    if is_s3(paths.state):
        _advance_s3(paths, new, expected_next_iteration)
        return
    import fcntl

    lock_path = normalize_root(paths.state) + ".lock"
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _check_expected(paths, expected_next_iteration, read_state(paths))
            write_bytes_atomic(paths.state, new.to_json())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _advance_s3(paths: LineagePaths, new: LineageState, expected: int | None) -> None:
    client = s3.client(s3_settings())
    body = new.to_json()

    def swap() -> None:
        # A 409/412 means another writer moved between our read and our write: read again
        # and decide (a 409 "conflict" may leave the state unchanged, then try again).
        for _ in range(5):
            blob, etag = s3.get_with_etag(client, paths.state)
            current = None if blob is None else _parse_state(paths, blob)
            if blob == body:
                return  # our own earlier attempt landed
            _check_expected(paths, expected, current)
            if s3.put_if(client, paths.state, body, etag=etag):
                return
        blob, _ = s3.get_with_etag(client, paths.state)
        _check_expected(paths, expected, None if blob is None else _parse_state(paths, blob))
        raise ReplayRLError(
            f"Lineage state '{paths.state}' kept changing while this run tried to advance it: "
            f"another run is advancing this lineage. Stop one of them."
        )

    _io("advance", paths.state, swap)


def _check_expected(
    paths: LineagePaths, expected: int | None, current: LineageState | None
) -> None:
    found = None if current is None else current.next_iteration
    if found != expected:
        raise ReplayRLError(
            f"Lineage state '{paths.state}' changed underneath this run (expected next iteration "
            f"{expected}, found {found}): another run is advancing this lineage. Stop one of them."
        )
