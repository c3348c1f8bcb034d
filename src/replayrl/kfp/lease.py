"""A lineage's lease: which pipeline run may write to it right now.

Every step of a Kubeflow run holds the lease of its lineage before it writes anything, so
when two runs overlap on one lineage (two schedules, a manual run during a recurring one)
the second stops at its first step, before a row, checkpoint or metric is written, with a
message that names the run holding it. The lease is `<lineage>/lease.json`: the owner (the
KFP run id) and an expiry; each step renews it, the run's last step releases it, and a
lease left by a run that died expires after `ttl_s`, so the next run can take over.

The commit point of an iteration stays the compare-and-swap of `state.json`
(`storage.advance_state`): the lease keeps a losing run from doing work, the swap keeps it
from advancing the lineage. Locally the lease is taken under an exclusive file lock; on S3
with a conditional write (If-Match the ETag just read, If-None-Match for a new lease).

Knows nothing about steps, models or KFP: owners are opaque strings.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from dataclasses import asdict, dataclass

from replayrl import s3, storage
from replayrl.errors import ReplayRLError
from replayrl.storage import LineagePaths

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    owner: str
    acquired_at: float  # unix seconds
    expires_at: float  # unix seconds


def lease_uri(paths: LineagePaths) -> str:
    return storage.join(paths.root, "lease.json")


def _parse(blob: bytes | None) -> Lease | None:
    if blob is None:
        return None
    try:
        return Lease(**json.loads(blob))
    except (json.JSONDecodeError, TypeError):
        # A lease nobody can parse protects nothing; the next holder rewrites it.
        return None


def read(paths: LineagePaths) -> Lease | None:
    uri = lease_uri(paths)
    return _parse(storage.read_bytes(uri)) if storage.exists(uri) else None


def _renewed(
    paths: LineagePaths, current: Lease | None, *, owner: str, ttl_s: float, now: float
) -> Lease:
    """The lease `owner` may write now, or a ReplayRLError when another run holds it."""
    if current is not None and current.owner != owner:
        if current.expires_at > now:
            until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(current.expires_at))
            raise ReplayRLError(
                f"Lineage at {paths.root} is being advanced by run '{current.owner}' (lease "
                f"until {until}); this run stops before writing anything. Pause one of the two "
                f"schedules, or, if that run is gone, delete {lease_uri(paths)}."
            )
        log.warning("run %s takes over the expired lease of run %s", owner, current.owner)
    held = current is not None and current.owner == owner
    return Lease(
        owner=owner, acquired_at=current.acquired_at if held else now, expires_at=now + ttl_s
    )


def hold(paths: LineagePaths, *, owner: str, ttl_s: float, now: float | None = None) -> Lease:
    """Take or renew the lease for `ttl_s` seconds. Raises ReplayRLError, and writes nothing,
    when another owner holds an unexpired lease."""
    if not owner:
        raise ReplayRLError("A lease needs an owner (the pipeline run id); got an empty one.")
    uri = lease_uri(paths)
    if storage.is_s3(uri):
        return _hold_s3(paths, owner=owner, ttl_s=ttl_s, now=now)
    with _locked(paths):
        t = time.time() if now is None else now
        lease = _renewed(paths, read(paths), owner=owner, ttl_s=ttl_s, now=t)
        storage.write_bytes_atomic(uri, json.dumps(asdict(lease)).encode())
        return lease


def _hold_s3(paths: LineagePaths, *, owner: str, ttl_s: float, now: float | None) -> Lease:
    uri = lease_uri(paths)
    settings = storage.s3_settings()
    client = s3.client(settings)

    def attempt() -> Lease | None:
        blob, etag = s3.get_with_etag(client, uri)
        t = time.time() if now is None else now
        lease = _renewed(paths, _parse(blob), owner=owner, ttl_s=ttl_s, now=t)
        body = json.dumps(asdict(lease)).encode()
        return lease if s3.put_if(client, uri, body, etag=etag) else None

    for _ in range(5):
        lease = s3.retry(
            attempt,
            action="take the lease",
            uri=uri,
            endpoint=settings.get("AWS_ENDPOINT_URL"),
            deadline_s=storage.s3_deadline_s(),
            secrets=[settings.get("AWS_SECRET_ACCESS_KEY", "")],
        )
        if lease is not None:
            return lease
    # Another writer won each conditional write: say who holds it now.
    _renewed(paths, read(paths), owner=owner, ttl_s=ttl_s, now=time.time())
    raise ReplayRLError(f"The lease {uri} kept changing; another run is starting on it.")


def release(paths: LineagePaths, *, owner: str) -> bool:
    """Drop the lease if `owner` holds it; True when it did."""
    with _locked(paths):
        current = read(paths)
        if current is None or current.owner != owner:
            return False
        storage.delete(lease_uri(paths))
        return True


@contextlib.contextmanager
def _locked(paths: LineagePaths):
    """An exclusive lock around a lease update, for a local run root (no-op on S3)."""
    if storage.is_s3(paths.root):
        yield
        return
    lock_path = storage.normalize_root(lease_uri(paths)) + ".lock"
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
