"""A lineage's lease: which run may write to it right now.

Every step of a Kubeflow run, and the inline engine before each iteration, holds the lease of
its lineage before it writes anything, so when two runs overlap on one lineage (two
schedules, a manual run during a recurring one, two `replayrl run` commands) the second
stops before a row, checkpoint or metric is written, with a message that names the run
holding it. Without it two writers could append the same iteration at once, and Delta's
replace-where of one would not see the other's files. The lease is `<lineage>/lease.json`:
the owner (the KFP run id, or `inline:<host>:<pid>:<nonce>` for an inline run) and an
expiry; the holder renews it, releases it at the end, and a lease left by a run that died
expires after `ttl_s` — at once when the dead owner was an inline process on this host, so
rerunning a killed command resumes without waiting. Leases are short (minutes): a step keeps
its lease alive with a `heartbeat`, a background thread that renews it every third of its TTL
while the step works, so a run killed without a chance to release its lease (a deleted pod, a
terminated workflow) frees its lineage within one TTL.

The commit point of an iteration stays the compare-and-swap of `state.json`
(`storage.advance_state`): the lease keeps a losing run from doing work, the swap keeps it
from advancing the lineage. Locally the lease is taken under an exclusive file lock; on S3
with a conditional write (If-Match the ETag just read, If-None-Match for a new lease).

Knows nothing about steps, models or KFP: owners are opaque strings (except that an inline
owner names its host and pid).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from replayrl import storage
from replayrl.errors import ReplayRLError
from replayrl.storage import LineagePaths, s3

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    owner: str
    acquired_at: float  # unix seconds
    expires_at: float  # unix seconds


def inline_owner() -> str:
    """A lease owner for this process: `inline:<host>:<pid>:<nonce>`."""
    return f"inline:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _dead_local_process(owner: str) -> bool:
    """True when `owner` is an inline run of this host whose process is gone, or an earlier
    run in this very process that ended without releasing (e.g. its store was unreachable)."""
    parts = owner.split(":")
    if len(parts) != 4 or parts[0] != "inline" or parts[1] != socket.gethostname():
        return False
    if parts[2] == str(os.getpid()):
        return True
    try:
        os.kill(int(parts[2]), 0)  # signal 0: does the process exist?
    except ProcessLookupError:
        return True
    except (ValueError, PermissionError):
        return False
    return False


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
        if current.expires_at > now and not _dead_local_process(current.owner):
            until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(current.expires_at))
            raise ReplayRLError(
                f"Lineage at {paths.root} is being advanced by run '{current.owner}' (lease "
                f"until {until}); this run stops before writing anything. Pause one of the two "
                f"schedules, or, if that run is gone, delete {lease_uri(paths)}."
            )
        log.warning("run %s takes over the lease of run %s (expired or gone)", owner, current.owner)
    # Renewing its own lease keeps when `owner` first took it.
    acquired_at = current.acquired_at if current is not None and current.owner == owner else now
    return Lease(owner=owner, acquired_at=acquired_at, expires_at=now + ttl_s)


def hold(paths: LineagePaths, *, owner: str, ttl_s: float, now: float | None = None) -> Lease:
    """Take or renew the lease for `ttl_s` seconds. Raises ReplayRLError, and writes nothing,
    when another owner holds an unexpired lease."""
    if not owner:
        raise ReplayRLError("A lease needs an owner (a run id); got an empty one.")
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
    """Drop the lease if `owner` holds it; True when it did. Writes nothing when there is no
    lease (not even the lock file of a local lineage that was never created)."""
    if not storage.exists(lease_uri(paths)):
        return False
    with _locked(paths):
        current = read(paths)
        if current is None or current.owner != owner:
            return False
        storage.delete(lease_uri(paths))
        return True


class Heartbeat:
    """Renews `owner`'s lease every `interval_s` in a daemon thread until stopped.

    A renewal that finds another owner holding the lease (this run's lease expired and
    another run took it) stops the heartbeat and sets `lost`; the step goes on, and its
    commit — the compare-and-swap of `state.json` — is what keeps two runs from both
    advancing the lineage. A renewal that fails for another reason (the store unreachable
    past its deadline) is logged and tried again at the next beat."""

    def __init__(self, paths: LineagePaths, *, owner: str, ttl_s: float, interval_s: float):
        self.paths, self.owner, self.ttl_s, self.interval_s = paths, owner, ttl_s, interval_s
        self.beats = 0
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replayrl-lease", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                hold(self.paths, owner=self.owner, ttl_s=self.ttl_s)
                self.beats += 1
            except ReplayRLError as e:
                if self._held_by_another():
                    self.lost = str(e)
                    log.error("lost the lease of %s: %s", self.paths.root, e)
                    return
                log.warning("could not renew the lease of %s (will retry): %s", self.paths.root, e)
            except Exception as e:  # noqa: BLE001 - a heartbeat must never kill its step
                log.warning("could not renew the lease of %s (will retry): %s", self.paths.root, e)

    def _held_by_another(self) -> bool:
        try:
            current = read(self.paths)
        except Exception:  # noqa: BLE001 - unreachable: not known to be lost
            return False
        return current is not None and current.owner != self.owner


@contextlib.contextmanager
def heartbeat(
    paths: LineagePaths, *, owner: str, ttl_s: float, interval_s: float | None = None
) -> Iterator[Heartbeat]:
    """Hold the lease now (raising, before any work, when another run holds it) and renew it
    every `interval_s` (default a third of `ttl_s`) until the block ends. Does not release:
    whether the run is done with the lineage is the caller's call."""
    hold(paths, owner=owner, ttl_s=ttl_s)
    beat = Heartbeat(
        paths, owner=owner, ttl_s=ttl_s, interval_s=ttl_s / 3 if interval_s is None else interval_s
    ).start()
    try:
        yield beat
    finally:
        beat.stop()


@contextlib.contextmanager
def _locked(paths: LineagePaths) -> Iterator[None]:
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


class Holder:
    """A lineage's lease, taken when the run first asks (`hold`) and from then on renewed by
    a `Heartbeat` every third of `ttl_s`; `held` makes one and releases it at the end."""

    def __init__(self, paths: LineagePaths, *, owner: str, ttl_s: float):
        self.paths, self.owner, self.ttl_s = paths, owner, ttl_s
        self.beat: Heartbeat | None = None

    def hold(self) -> None:
        """Take or renew the lease now (ReplayRLError, writing nothing, when another run
        holds it); the first call starts the heartbeat."""
        hold(self.paths, owner=self.owner, ttl_s=self.ttl_s)
        if self.beat is None:
            self.beat = Heartbeat(
                self.paths, owner=self.owner, ttl_s=self.ttl_s, interval_s=self.ttl_s / 3
            ).start()

    @property
    def lost(self) -> str | None:
        """Why the heartbeat found the lease taken by another run; None while it is ours."""
        return None if self.beat is None else self.beat.lost


@contextlib.contextmanager
def held(paths: LineagePaths, *, owner: str, ttl_s: float) -> Iterator[Holder]:
    """A `Holder` of the lease of `paths` for the block. Nothing is taken until the block
    calls `hold()` (so input found bad before then leaves no lease behind); when the block
    ends the heartbeat stops and a lease that was taken is released. A release that fails is
    logged, never raised: it must not mask the block's own error."""
    holder = Holder(paths, owner=owner, ttl_s=ttl_s)
    try:
        yield holder
    finally:
        if holder.beat is not None:
            try:
                holder.beat.stop()
                release(paths, owner=owner)
            except Exception as e:  # noqa: BLE001 - never mask the run's own error
                log.warning("could not release the lease of %s: %s", paths.root, e)
