"""A lineage's lease: which run may write to it right now, and with which fencing epoch.

Every step of a Kubeflow run, and the inline and asynchronous engines for their whole run,
hold the lease of their lineage before they write anything, so when two runs overlap on one
lineage (two schedules, a manual run during a recurring one, two `replayrl run` commands) the
second stops before a row, checkpoint or metric is written, with a message that names the
run holding it. The lease is `<lineage>/lease.json`: the owner (the KFP run id, or
`inline:<host>:<pid>:<nonce>` for a run started from the CLI), the holder's token (one per
process that took it), its fencing epoch, where the holder runs (host, pid, boot id, pid
namespace) and an expiry.

Epochs. Every take of the lease — a new run, a rerun of a killed command, each step of a
Kubeflow run, a retry of one step — gets an epoch one higher than any the lineage has seen
(the lease's and `state.json`'s), and fences `state.json` with it
(`replayrl.storage.state.fence`) before it returns. A holder that was stopped (SIGSTOP, a
paused VM, a network cut, a zombie pod) and comes back after another took over finds a
higher epoch at its next durable write and stops (`replayrl.storage.fencing`,
docs/fencing.md). Renewals keep the epoch; the roles of one asynchronous Kubeflow run join
the epoch their run's first task took (`join=True`).

Liveness and time. A lease expires `ttl_s` after its last renewal. A holder renews it every
third of its TTL (`Heartbeat`) while it works, so a run killed without releasing frees its
lineage within one TTL. Another run takes an unexpired lease only when its holder is known
dead: same host, same boot id and same pid namespace as the taker, and no such pid
(rerunning a killed command resumes at once). Expiry is judged on the taker's clock with a
skew allowance of a third of the TTL (`skew_allowance_s`): a live lease is renewed at least
every third of its TTL, so it is never taken unless the two clocks differ by more than the
whole TTL. Release is a conditional write too (the lease is marked released, never deleted
under another holder).

Locally every update is a read-decide-write under an exclusive lock file; on S3 a
conditional write (If-Match the ETag just read, If-None-Match for a new lease). Knows
nothing about steps, models or KFP: owners are opaque strings.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace

from replayrl import storage
from replayrl.errors import ReplayRLError, StaleOwnerError
from replayrl.storage import LineagePaths, fencing, objects

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    owner: str
    acquired_at: float  # unix seconds, on the holder's clock
    expires_at: float  # unix seconds, on the holder's clock
    epoch: int = 0  # fencing epoch of this take (0: a lease written before epochs existed)
    token: str = ""  # which holder (one per process and take) holds it
    host: str = ""
    pid: int = 0
    boot_id: str = ""
    pid_ns: str = ""
    released: bool = False
    ttl_s: float = 0.0  # the holder's TTL (0: a lease written before it was recorded)


def inline_owner() -> str:
    """A lease owner for this process: `inline:<host>:<pid>:<nonce>`."""
    return f"inline:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


# Tokens of the holders of this process whose heartbeat has stopped: a lease of this
# process under one of them was left behind (e.g. its store was unreachable at release).
_ENDED: set[str] = set()


def skew_allowance_s(ttl_s: float) -> float:
    """How far past its expiry a lease is still honoured: a third of its holder's TTL."""
    return ttl_s / 3.0


def _known_dead(current: Lease) -> bool:
    """True when `current`'s holder is a CLI run (`inline_owner`: its lease lives and dies
    with its process) of this very machine and pid namespace
    (same host, boot id and pid namespace) that no longer exists, or an earlier holder in
    this process that ended without releasing. Anything else is judged by expiry only."""
    if not current.owner.startswith("inline:"):
        return False  # a Kubeflow run's lease outlives each of its pods: judged by expiry
    if not current.pid or not current.boot_id or not current.pid_ns:
        return False
    if (current.host, current.boot_id, current.pid_ns) != (
        socket.gethostname(),
        _boot_id(),
        _pid_ns(),
    ):
        return False
    if current.pid == os.getpid():
        return current.token in _ENDED
    try:
        os.kill(current.pid, 0)  # signal 0: does the process exist?
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def lease_uri(paths: LineagePaths) -> str:
    return storage.join(paths.root, "lease.json")


_FIELDS = {f.name for f in fields(Lease)}


def _parse(blob: bytes | None) -> Lease | None:
    if blob is None:
        return None
    try:
        data = json.loads(blob)
        return Lease(**{k: v for k, v in data.items() if k in _FIELDS})
    except (json.JSONDecodeError, TypeError, AttributeError, UnicodeDecodeError):
        # A lease nobody can parse protects nothing; the next holder rewrites it.
        return None


def _stored(paths: LineagePaths) -> Lease | None:
    uri = lease_uri(paths)
    return _parse(storage.read_bytes(uri)) if storage.exists(uri) else None


def read(paths: LineagePaths) -> Lease | None:
    """The lease as held now; None when there is none or its holder released it."""
    current = _stored(paths)
    return None if current is None or current.released else current


def _busy(paths: LineagePaths, current: Lease) -> ReplayRLError:
    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(current.expires_at))
    return ReplayRLError(
        f"Lineage at {paths.root} is being advanced by run '{current.owner}' (lease "
        f"until {until}); this run stops before writing anything. Pause one of the two "
        f"schedules, or, if that run is gone, delete {lease_uri(paths)}."
    )


def _next(
    paths: LineagePaths,
    current: Lease | None,
    *,
    owner: str,
    ttl_s: float,
    now: float,
    token: str | None,
    join: bool,
) -> Lease:
    """The lease `owner` may write now (a renewal, a join or a new take), or a ReplayRLError
    when another run holds it. `token` None renews by owner alone (no new epoch)."""
    live = current is not None and not current.released
    mine = live and current is not None and current.owner == owner
    if mine and current is not None and (token is None or join or current.token == token):
        # A renewal (or a role joining its run's take): same epoch, same first take.
        return replace(current, expires_at=now + ttl_s, ttl_s=ttl_s)
    if live and current is not None and not mine:
        # The allowance follows the holder's TTL (how often it renews), not the taker's.
        expired = now > current.expires_at + skew_allowance_s(current.ttl_s or ttl_s)
        if not expired and not _known_dead(current):
            raise _busy(paths, current)
        log.warning("run %s takes over the lease of run %s (expired or gone)", owner, current.owner)
    # A new take: one epoch past any the lineage has seen.
    seen = max(
        0 if current is None else current.epoch, fencing.Fence(paths.root, 0).current_epoch()
    )
    return Lease(
        owner=owner,
        acquired_at=now,
        expires_at=now + ttl_s,
        ttl_s=ttl_s,
        epoch=seen + 1,
        token=token or uuid.uuid4().hex,
        host=socket.gethostname(),
        pid=os.getpid(),
        boot_id=_boot_id(),
        pid_ns=_pid_ns(),
    )


def hold(
    paths: LineagePaths,
    *,
    owner: str,
    ttl_s: float,
    now: float | None = None,
    token: str | None = None,
    join: bool = False,
) -> Lease:
    """Take or renew the lease for `ttl_s` seconds. Raises ReplayRLError, and writes nothing,
    when another owner holds an unexpired lease. With a `token` (a holder's identity) a
    lease of the same owner under another token is taken anew with a new epoch (a retried
    Kubeflow task, the next step of a run), unless `join`; without one, a lease of the same
    owner is renewed. Only takes it: fencing `state.json` is `Holder`'s job."""
    if not owner:
        raise ReplayRLError("A lease needs an owner (a run id); got an empty one.")
    taken: list[Lease] = []

    def update(blob: bytes | None) -> bytes:
        t = time.time() if now is None else now
        lease = _next(paths, _parse(blob), owner=owner, ttl_s=ttl_s, now=t, token=token, join=join)
        taken[:] = [lease]
        return json.dumps(asdict(lease)).encode()

    objects.compare_and_swap(lease_uri(paths), update, action="take the lease")
    return taken[-1]


def renew(paths: LineagePaths, held: Lease, *, ttl_s: float) -> Lease:
    """Renew `held` (same token and epoch). Raises StaleOwnerError when another holder has
    taken the lease since (expired meanwhile, or a retry of the same run)."""
    renewed: list[Lease] = []

    def update(blob: bytes | None) -> bytes:
        current = _parse(blob)
        if current is None or current.released or current.token != held.token:
            raise StaleOwnerError(
                f"The lease of {paths.root} is no longer this run's (now "
                f"{'free' if current is None or current.released else repr(current.owner)}, "
                f"epoch {0 if current is None else current.epoch}; this run holds epoch "
                f"{held.epoch})."
            )
        lease = replace(current, expires_at=time.time() + ttl_s, ttl_s=ttl_s)
        renewed[:] = [lease]
        return json.dumps(asdict(lease)).encode()

    objects.compare_and_swap(lease_uri(paths), update, action="renew the lease")
    return renewed[-1]


def release(paths: LineagePaths, *, owner: str, token: str | None = None) -> bool:
    """Mark the lease released if `owner` (and `token`, when given) holds it; True when it
    did. A conditional write: a lease another holder took meanwhile is left alone. Writes
    nothing when there is no lease (not even the lock file of a local lineage that was
    never created)."""
    if not storage.exists(lease_uri(paths)):
        return False
    done: list[bool] = []

    def update(blob: bytes | None) -> bytes | None:
        current = _parse(blob)
        done[:] = [False]
        if current is None or current.released or current.owner != owner:
            return None
        if token is not None and current.token != token:
            return None
        done[:] = [True]
        return json.dumps(asdict(replace(current, released=True, expires_at=0.0))).encode()

    objects.compare_and_swap(lease_uri(paths), update, action="release the lease")
    if done and done[-1]:
        fencing.remove(paths.root)
        return True
    return False


def fence_take(paths: LineagePaths, taken: Lease) -> fencing.Fence:
    """Fence `state.json` with the epoch of lease `taken` and record the fence for this
    process's writes under the lineage (`replayrl.storage.fencing`)."""
    from replayrl.storage import state

    state.fence(paths, taken.epoch)
    fence = fencing.Fence(paths.root, taken.epoch)
    fencing.install(fence)
    return fence


class Heartbeat:
    """Renews the lease `held` every `interval_s` in a daemon thread until stopped.

    A renewal that finds another holder (this run's lease expired and another run took it,
    or a retry of this run took it anew) stops the heartbeat and sets `lost`; the engines stop
    at their next safe point when they see it, and the fence keeps every write they still
    attempt from landing. A renewal that fails for another reason (the store unreachable past
    its deadline) is logged and tried again at the next beat."""

    def __init__(self, paths: LineagePaths, held: Lease, *, ttl_s: float, interval_s: float):
        self.paths, self.held, self.ttl_s, self.interval_s = paths, held, ttl_s, interval_s
        self.owner = held.owner
        self.beats = 0
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replayrl-lease", daemon=True)

    @property
    def epoch(self) -> int:
        return self.held.epoch

    @property
    def fence(self) -> fencing.Fence:
        return fencing.Fence(self.paths.root, self.held.epoch)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        _ENDED.add(self.held.token)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.held = renew(self.paths, self.held, ttl_s=self.ttl_s)
                self.beats += 1
            except StaleOwnerError as e:
                self.lost = str(e)
                log.error("lost the lease of %s: %s", self.paths.root, e)
                return
            except Exception as e:  # noqa: BLE001 - a heartbeat must never kill its step
                log.warning("could not renew the lease of %s (will retry): %s", self.paths.root, e)


def _take(
    paths: LineagePaths, *, owner: str, ttl_s: float, join: bool
) -> tuple[Lease, fencing.Fence]:
    """Take the lease as a new holder (a new token, so a new epoch unless `join`) and fence
    the lineage with it."""
    taken = hold(paths, owner=owner, ttl_s=ttl_s, token=uuid.uuid4().hex, join=join)
    try:
        fence = fence_take(paths, taken)
    except Exception:
        release(paths, owner=owner, token=taken.token)
        raise
    return taken, fence


@contextlib.contextmanager
def heartbeat(
    paths: LineagePaths,
    *,
    owner: str,
    ttl_s: float,
    interval_s: float | None = None,
    join: bool = False,
) -> Iterator[Heartbeat]:
    """Take the lease now as a new holder (raising, before any work, when another run holds
    it), fence the lineage with its epoch, and renew it every `interval_s` (default a third
    of `ttl_s`) until the block ends. `join`: share the epoch of the lease this `owner`
    already holds (the concurrent role tasks of one Kubeflow run). Does not release: whether
    the run is done with the lineage is the caller's call."""
    taken, _ = _take(paths, owner=owner, ttl_s=ttl_s, join=join)
    beat = Heartbeat(
        paths, taken, ttl_s=ttl_s, interval_s=ttl_s / 3 if interval_s is None else interval_s
    ).start()
    try:
        yield beat
    finally:
        beat.stop()


@contextlib.contextmanager
def _locked(paths: LineagePaths) -> Iterator[None]:
    """The lock around a local lease update (the one `objects.compare_and_swap` takes); a
    no-op on S3."""
    if storage.is_s3(paths.root):
        yield
        return
    with objects.file_lock(objects.lock_path(lease_uri(paths))):
        yield


class Holder:
    """A lineage's lease, taken when the run first asks (`hold`) and from then on renewed by
    a `Heartbeat` every third of `ttl_s`; `held` makes one and releases it at the end."""

    def __init__(self, paths: LineagePaths, *, owner: str, ttl_s: float):
        self.paths, self.owner, self.ttl_s = paths, owner, ttl_s
        self.beat: Heartbeat | None = None

    def hold(self) -> None:
        """Take the lease and fence the lineage (ReplayRLError, writing nothing, when another
        run holds it) on the first call, starting the heartbeat; later calls check it is
        still ours (StaleOwnerError when another holder took it)."""
        if self.beat is None:
            taken, _ = _take(self.paths, owner=self.owner, ttl_s=self.ttl_s, join=False)
            self.beat = Heartbeat(
                self.paths, taken, ttl_s=self.ttl_s, interval_s=self.ttl_s / 3
            ).start()
            return
        if self.beat.lost:
            raise StaleOwnerError(self.beat.lost)

    @property
    def lost(self) -> str | None:
        """Why the heartbeat found the lease taken by another holder; None while it is ours."""
        return None if self.beat is None else self.beat.lost

    @property
    def fence(self) -> fencing.Fence | None:
        """This holder's fence (its epoch); None before `hold()`."""
        return None if self.beat is None else self.beat.fence

    @property
    def epoch(self) -> int | None:
        return None if self.beat is None else self.beat.epoch


@contextlib.contextmanager
def held(paths: LineagePaths, *, owner: str, ttl_s: float) -> Iterator[Holder]:
    """A `Holder` of the lease of `paths` for the block. Nothing is taken until the block
    calls `hold()` (so input found bad before then leaves no lease behind); when the block
    ends the heartbeat stops and a lease that was taken is released (only if still this
    holder's). A release that fails is logged, never raised: it must not mask the block's
    own error."""
    holder = Holder(paths, owner=owner, ttl_s=ttl_s)
    try:
        yield holder
    finally:
        if holder.beat is not None:
            try:
                holder.beat.stop()
                release(paths, owner=owner, token=holder.beat.held.token)
            except Exception as e:  # noqa: BLE001 - never mask the run's own error
                log.warning("could not release the lease of %s: %s", paths.root, e)
