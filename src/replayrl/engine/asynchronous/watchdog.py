"""The asynchronous supervisor's watchdog: which role processes stopped making progress.

Each role process stamps a pulse its supervisor gave it (`replayrl.engine.children.beat`:
two shared doubles, the `time.monotonic()` of its last progress report and the slowest
interval between two reports so far) after each batch, gradient step or evaluation and at
every poll while it waits. A role is *stalled* when its last report is older than its limit:

    before its first report   asynchronous.stall_startup_s (default 1800 s: imports, loading
                              the model, starting the generation engine)
    after it                  asynchronous.stall_timeout_s when set, else
                              max(FLOOR_S, FACTOR x the slowest interval it measured)

so a worker whose batches take 20 s on a GPU is stalled after max(600, 200) = 600 s without
a report, and one whose batches take 2 minutes after 20 minutes. A process that is stopped
(SIGSTOP, a paused container), deadlocked or stuck in a collective reports nothing and is
found; a role waiting on another (the trainer for rows, a worker for room) keeps reporting,
so only the hung one is stopped. The supervisor then stops it (SIGTERM, then SIGKILL after
asynchronous.stop_grace_s) and starts it again within the restart budget.

Knows nothing about what the roles do; only reads their pulses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# The derived limit: this many times the slowest interval between two progress reports,
# and never less than FLOOR_S (a slow checkpoint write or weight download must not look
# like a hang to a role whose steps are fast).
FACTOR = 10.0
FLOOR_S = 600.0


def stall_limit_s(*, slowest_s: float | None, timeout_s: float | None, startup_s: float) -> float:
    """Seconds without a report after which a role is stalled (see the module docstring);
    `slowest_s` None: no report yet."""
    if slowest_s is None:
        return startup_s
    if timeout_s is not None:
        return timeout_s
    return max(FLOOR_S, FACTOR * slowest_s)


@dataclass
class Pulse:
    """One role process's progress as its supervisor reads it: `shared` is the array of two
    doubles the process writes (`children.beat`), `started` when the process was started
    (monotonic seconds)."""

    shared: object
    started: float

    @classmethod
    def new(cls, ctx) -> Pulse:
        return cls(shared=ctx.Array("d", 2, lock=False), started=time.monotonic())

    @property
    def last_report(self) -> float | None:
        value = self.shared[0]
        return value if value > 0 else None

    @property
    def slowest_s(self) -> float | None:
        """The slowest interval between two reports; 0 after one report, None before."""
        return None if self.last_report is None else self.shared[1]

    def silent_s(self, now: float | None = None) -> float:
        """Seconds since the last report (since the start, before the first)."""
        now = time.monotonic() if now is None else now
        last = self.last_report
        return now - (self.started if last is None else last)

    def stalled(self, *, timeout_s: float | None, startup_s: float) -> tuple[float, float] | None:
        """(seconds silent, the limit) when the role is stalled, else None."""
        limit = stall_limit_s(slowest_s=self.slowest_s, timeout_s=timeout_s, startup_s=startup_s)
        silent = self.silent_s()
        return (silent, limit) if silent > limit else None
