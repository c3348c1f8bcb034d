"""Stopping a run at its next safe point when asked to (SIGTERM, SIGINT), or when it lost its
lineage's lease.

`StopSignals` turns the first SIGTERM or SIGINT into a request; the engine looks at it only
where stopping leaves the lineage as a rerun expects it (the inline engine between
iterations, after the previous one's commit; the asynchronous supervisor at every poll,
then it stops its roles: SIGTERM, then SIGKILL after a grace), raises `Stopped`, and the
lease is released on the way out. A second signal does not wait: it raises
KeyboardInterrupt where the engine is (the lineage then rewinds to its last full checkpoint
on the next run, as after a crash).

    with StopSignals() as signals:
        run_inline(cfg, signals=signals)   # Stopped("stopped by SIGTERM before iteration 3; ...")
"""

from __future__ import annotations

import logging
import signal
import threading

from replayrl.errors import ReplayRLError

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(ReplayRLError):
    """The run stopped at a safe point because it received `signum`."""

    def __init__(self, signum: int, where: str):
        self.signum = signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} {where}; re-run the same command to resume"
        )


class LeaseLost(ReplayRLError):
    """Another run took this run's lease: it stops before writing anything more. `why` is
    the heartbeat's finding, `where` finishes "this run stops ..."."""

    def __init__(self, root: str, why: str, where: str):
        super().__init__(
            f"{why.rstrip('.') or f'another run took the lease of {root}'}; this run stops "
            f"{where}. Nothing after its last commit is kept: let the other run finish, then "
            "re-run to resume."
        )


class StopSignals:
    """SIGTERM and SIGINT, while the block runs, ask the engine to stop at its next safe
    point (`check`); a second one raises KeyboardInterrupt at once. Outside the main thread
    (where Python cannot install handlers) it installs nothing and never asks."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        log.warning(
            "%s received: stopping at the next safe point (send it again to stop at once)",
            signal.Signals(signum).name,
        )

    def check(self, where: str) -> None:
        """Raise `Stopped` (saying `where`, e.g. "before iteration 3") when a signal came."""
        if self.received is not None:
            raise Stopped(self.received, where)
