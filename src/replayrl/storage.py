"""Where a lineage keeps its state: run-root URIs, files, checkpoints and `state.json`.

A run root is a local path, a `file://` URI (the embedded default) or `s3://bucket/prefix`.
One lineage lives under `<run root>/<lineage>/`:

    state.json            next iteration, latest checkpoint version, MLflow run id
    config.yaml           the resolved config the lineage was started with
    buffer/rollouts       the replay buffer (Delta table, see `buffer.py`)
    buffer/usage          one row per use of a rollout (Delta table)
    checkpoints/v000003/  Hugging Face layout + optimizer.pt, then a COMPLETE marker

This module and `config` are the only ones that read environment variables: the S3
endpoint and credentials come from the standard AWS variables (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`); pyarrow does not read
`AWS_ENDPOINT_URL` itself, so it is passed explicitly. Nothing here knows about models,
losses or trackers: checkpoints are opaque directories of files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

from replayrl.errors import ReplayRLError

COMPLETE_MARKER = "COMPLETE"


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


def delta_storage_options(uri: str) -> dict[str, str] | None:
    """Options for delta-rs: endpoint, credentials, plain HTTP for a loopback endpoint."""
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
        fs = pafs.S3FileSystem(**kwargs)
        return fs, uri[len("s3://") :]
    return pafs.LocalFileSystem(), normalize_root(uri)


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_bytes(uri: str) -> bytes:
    fs, path = filesystem(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        raise ReplayRLError(f"'{uri}' does not exist.") from None
    except OSError as e:
        raise ReplayRLError(f"Cannot read '{uri}': {e}") from None


def open_input(uri: str):
    """A binary file object for reading `uri` (used by dataset loaders)."""
    fs, path = filesystem(uri)
    try:
        return fs.open_input_file(path)
    except FileNotFoundError:
        raise ReplayRLError(f"'{uri}' does not exist; check the path.") from None
    except OSError as e:
        raise ReplayRLError(f"Cannot read '{uri}': {e}") from None


def write_bytes_atomic(uri: str, data: bytes) -> None:
    """Write a whole object. Locally: a temp file in the same folder, then rename, so a
    reader never sees half a file. On S3 a PUT is already all-or-nothing."""
    fs, path = filesystem(uri)
    try:
        if is_s3(uri):
            with fs.open_output_stream(path) as f:
                f.write(data)
            return
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
    """Fail early, with the fix, when the run root cannot be written."""
    probe = join(root, f".probe-{uuid.uuid4().hex[:8]}")
    try:
        write_bytes_atomic(probe, b"ok")
        delete(probe)
    except ReplayRLError:
        raise ReplayRLError(
            f"Run root '{root}' cannot be written. Pick a writable --run-root (a local folder or "
            f"s3://bucket/prefix with credentials in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)."
        ) from None


def delete(uri: str, *, recursive: bool = False) -> None:
    fs, path = filesystem(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return
    if info.type == pafs.FileType.Directory:
        fs.delete_dir(path)
    else:
        fs.delete_file(path)


def list_dir(uri: str) -> list[str]:
    fs, path = filesystem(uri)
    sel = pafs.FileSelector(path, allow_not_found=True)
    return sorted(info.base_name for info in fs.get_file_info(sel))


def upload_dir(local_dir: Path, uri: str) -> None:
    """Copy every file of `local_dir` to `uri` (a folder). Locally a plain copy."""
    if not is_s3(uri):
        dest = Path(normalize_root(uri))
        dest.mkdir(parents=True, exist_ok=True)
        for item in Path(local_dir).iterdir():
            if item.is_file():
                shutil.copy2(item, dest / item.name)
        return
    fs, path = filesystem(uri)
    for item in Path(local_dir).iterdir():
        if item.is_file():
            with fs.open_output_stream(f"{path}/{item.name}") as f:
                f.write(item.read_bytes())


def download_dir(uri: str, local_dir: Path) -> Path:
    fs, path = filesystem(uri)
    local_dir.mkdir(parents=True, exist_ok=True)
    for info in fs.get_file_info(pafs.FileSelector(path)):
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as f:
                (local_dir / info.base_name).write_bytes(f.read())
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
    delete(uri, recursive=True)
    upload_dir(local_dir, uri)
    mark_complete(uri)


def mark_complete(uri: str) -> None:
    """Write the COMPLETE marker of a checkpoint whose files are all in place."""
    write_bytes_atomic(join(uri, COMPLETE_MARKER), b"complete\n")


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


def checkpoint_local_dir(uri: str, cache_dir: Path) -> Path:
    """A local directory holding the checkpoint at `uri` (downloaded from S3 if needed)."""
    if not is_complete(uri):
        raise ReplayRLError(
            f"Checkpoint '{uri}' is missing or incomplete (no {COMPLETE_MARKER} marker). "
            f"Resume the lineage so the step that writes it runs again."
        )
    if not is_s3(uri):
        return Path(normalize_root(uri))
    local = cache_dir / "s3" / uri[len("s3://") :]
    if (local / COMPLETE_MARKER).exists():
        return local
    shutil.rmtree(local, ignore_errors=True)
    download_dir(uri, local)
    return local


def prune_checkpoints(paths: LineagePaths, *, keep: int, protect: set[int]) -> list[int]:
    """Delete complete checkpoints older than the newest `keep`, except `protect`."""
    if keep <= 0:
        return []
    versions = complete_versions(paths)
    doomed = [v for v in versions[:-keep] if v not in protect]
    for v in doomed:
        delete(paths.checkpoint(v), recursive=True)
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

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()


def read_state(paths: LineagePaths) -> LineageState | None:
    if not exists(paths.state):
        return None
    try:
        data = json.loads(read_bytes(paths.state))
        return LineageState(**data)
    except (json.JSONDecodeError, TypeError) as e:
        raise ReplayRLError(
            f"Lineage state '{paths.state}' is unreadable ({e}). Restore it or start a new --lineage."
        ) from None


def advance_state(
    paths: LineagePaths, new: LineageState, *, expected_next_iteration: int | None
) -> None:
    """Replace state.json if it still says `expected_next_iteration` (None: must not exist).

    Locally this is a real compare-and-swap under an exclusive file lock. On S3 it is
    read-compare-write, which detects a stale writer but cannot exclude a simultaneous one.
    """
    if is_s3(paths.state):
        _check_expected(paths, expected_next_iteration)
        write_bytes_atomic(paths.state, new.to_json())
        return
    import fcntl

    lock_path = normalize_root(paths.state) + ".lock"
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _check_expected(paths, expected_next_iteration)
            write_bytes_atomic(paths.state, new.to_json())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _check_expected(paths: LineagePaths, expected: int | None) -> None:
    current = read_state(paths)
    found = None if current is None else current.next_iteration
    if found != expected:
        raise ReplayRLError(
            f"Lineage state '{paths.state}' changed underneath this run (expected next iteration "
            f"{expected}, found {found}): another run is advancing this lineage. Stop one of them."
        )
