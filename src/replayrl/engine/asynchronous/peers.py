"""A segment whose roles do not all start is given up, by every role, within a known time.

The roles of a segment (W workers, the trainer, the evaluator) wait on each other: workers
pause for a trainer to use their rows, the trainer waits for rows, the evaluator for
published weights, and the trainer for evaluations at the end. On Kubeflow a pod's timeout
starts only once a node runs it, so a role whose pod stays Pending (no free accelerator, a
quota, a node selector no node matches) would leave the others waiting for ever, and the
run, its exit handler and the next recurring run with it. So every role of a segment must
start within `asynchronous.peer_start_timeout_s` of each other, and every role looks for the
others while it works or waits:

    async/started/<role>.json   {"segment": id, "at": unix seconds}, written by each role
                                first thing, before it loads a model (`mark_started`)
    async/abandoned.json        {"segment": id, "by": role, "reason": ...}: written once, by
                                the first role that finds a peer missing past the limit

A role that finds a peer missing that long after it started itself (on its own monotonic
clock: pods' clocks are never compared) writes `abandoned.json` and stops with one
error line (`PeersMissing`); a role that reads it stops with the same line, at its next
check while it works, at once when it starts (a Pending pod that was scheduled at last, a
retried one), naming the record. Nothing committed is lost: the next run begins a new segment,
whose id (from its KFP run id) the record does not name, so an old record holds no later run
back. On Kubeflow the role that stops also stops its run when a peer's pod is still Pending
(the Kubeflow runtime does that, in `replayrl.kfp.pending_peers`: this layer knows no pods). Role names are
`trainer`, `evaluator` and `worker<i>`.

Knows nothing about models, the buffer or pods; only the board's files.
"""

from __future__ import annotations

import logging
import time

from replayrl import storage
from replayrl.config import RunConfig
from replayrl.engine.asynchronous import board
from replayrl.errors import ReplayRLError
from replayrl.storage import LineagePaths

log = logging.getLogger(__name__)

# At most how often a role reads the others' start records (seconds); a tenth of the limit
# when that is shorter.
CHECK_S = 2.0


class PeersMissing(ReplayRLError):
    """A role of the segment did not start in time: this role stops, and so do the others."""


def role_names(workers: int) -> list[str]:
    return ["trainer", "evaluator"] + [f"worker{w}" for w in range(workers)]


def _said(role: str) -> str:
    """`worker0` -> `worker 0`, for messages."""
    return f"worker {role[6:]}" if role.startswith("worker") else role


def _the(role: str) -> str:
    """`worker0` -> `worker 0`, `trainer` -> `the trainer`, for messages."""
    return _said(role) if role.startswith("worker") else f"the {role}"


def started_uri(paths: LineagePaths, role: str) -> str:
    return storage.join(board.root(paths), "started", f"{role}.json")


def abandoned_uri(paths: LineagePaths) -> str:
    return storage.join(board.root(paths), "abandoned.json")


def mark_started(paths: LineagePaths, segment_id: str, role: str) -> None:
    """Say that `role` has started for segment `segment_id`."""
    board._write_json(started_uri(paths, role), {"segment": segment_id, "at": time.time()})


def _started(paths: LineagePaths, segment_id: str, role: str) -> bool:
    found = board._read_json(started_uri(paths, role))
    return found is not None and found.get("segment") == segment_id


def abandoned_reason(paths: LineagePaths, segment_id: str) -> str | None:
    """Why segment `segment_id` was given up ("<role>: <reason>"), or None."""
    found = board._read_json(abandoned_uri(paths))
    if found is None or found.get("segment") != segment_id:
        return None
    return f"{_the(str(found.get('by')))} gave it up: {found.get('reason')}"


class _Taken(Exception):
    """`abandoned.json` already names this segment: the first reason stays."""


def abandon(paths: LineagePaths, segment_id: str, *, by: str, reason: str) -> str:
    """Record that segment `segment_id` is given up by `by` (unless a role already did: the
    first record stays); returns the recorded reason, as `abandoned_reason` says it."""

    def first_wins(current: dict | None) -> None:
        if current is not None and current.get("segment") == segment_id:
            raise _Taken

    try:
        board._write_json(
            abandoned_uri(paths),
            {"segment": segment_id, "by": by, "reason": reason},
            check=first_wins,
        )
    except _Taken:
        pass
    return abandoned_reason(paths, segment_id) or f"{_the(by)} gave it up: {reason}"


class Peers:
    """Role `role`'s view of the other roles of segment `segment_id`: `check()` (cheap: it
    reads storage at most every CHECK_S) raises `PeersMissing` once the segment was given up,
    or once a peer has not started `asynchronous.peer_start_timeout_s` after this role was
    made (recording it for the others first)."""

    def __init__(self, cfg: RunConfig, paths: LineagePaths, *, segment_id: str, role: str):
        self.paths, self.segment_id, self.role = paths, segment_id, role
        self.timeout_s = float(cfg.asynchronous.peer_start_timeout_s)
        self.interval_s = min(CHECK_S, self.timeout_s / 10)
        self.missing = [r for r in role_names(cfg.asynchronous.workers) if r != role]
        self.since = time.monotonic()
        self._next = 0.0

    def start(self) -> Peers:
        """Say this role started, then check at once (a role that starts after its segment
        was given up stops before it loads anything)."""
        mark_started(self.paths, self.segment_id, self.role)
        self.check()
        return self

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        stops = f"this {_said(self.role)} stops. Nothing committed is lost; the next run "
        stops += "begins a new segment."
        why = abandoned_reason(self.paths, self.segment_id)
        if why is not None:
            marker = abandoned_uri(self.paths)
            raise PeersMissing(
                f"Segment {self.segment_id} was given up ({why}; recorded in {marker}, which "
                f"holds only this segment); {stops}"
            )
        if not self.missing:
            return
        self.missing = [r for r in self.missing if not _started(self.paths, self.segment_id, r)]
        if not self.missing or now - self.since <= self.timeout_s:
            return
        names = ", ".join(_the(r) for r in self.missing)
        reason = (
            f"{names} had not started {self.timeout_s:g} s after {_the(self.role)} did "
            "(asynchronous.peer_start_timeout_s); on Kubeflow its pod is likely Pending: no "
            "free accelerator, a quota, or a node selector or tolerations no node matches"
        )
        why = abandon(self.paths, self.segment_id, by=self.role, reason=reason)
        log.error("segment %s given up: %s", self.segment_id, why)
        raise PeersMissing(f"Segment {self.segment_id} was given up ({why}); {stops}")
