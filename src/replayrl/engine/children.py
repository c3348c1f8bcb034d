"""What a child process of an engine does so that it never outlives its parent, and how it
tells its parent that it is making progress.

A child (an asynchronous worker, trainer or evaluator, a follower rank of the trainer group)
calls `adopt(parent_pid, pulse)` first thing:

- On Linux it asks the kernel for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`), however
  the parent dies (SIGKILL included), then checks that its parent is still `parent_pid`: a
  parent that died between the spawn and the prctl call would never send the signal (the
  race), so the child exits at once instead.
- SIGTERM becomes `SystemExit(143)`, so a child its parent stops runs its `finally` blocks
  (closing a generation engine) when it is in Python code; a parent that gets no exit within
  its grace sends SIGKILL. SIGINT is ignored: Ctrl-C in a terminal reaches the whole process
  group, and the parent decides how its children stop.
- `beat()`, called in every loop of the child (after each unit of work and every poll while
  it waits), checks the parent again (the only check where prctl does not exist) and stamps
  the progress `pulse` the parent reads (`replayrl.engine.asynchronous.watchdog`): the time of
  the last report and the slowest interval between two reports so far.

A child that must stop for good exits with `exit_code_of(error)`: EXIT_SUPERSEDED when a newer
owner took the lineage over (`StaleOwnerError`, or the segment it works for was replaced), so
the parent ends the run instead of starting it again; EXIT_ORPHANED when its parent is gone.

Knows nothing about roles, storage or models.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

from replayrl.errors import ReplayRLError, StaleOwnerError

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_SUPERSEDED = 3
EXIT_ORPHANED = 4

# Set by `adopt` in a child: its parent's pid and the shared progress pulse (None: no parent
# watches it, e.g. a Kubeflow task).
_PARENT_PID: int | None = None
_PULSE = None


class Orphaned(ReplayRLError):
    """This process's parent is gone: it stops (nobody would supervise or read its work)."""


class Superseded(ReplayRLError):
    """A newer run took the lineage over: this process stops and is not started again."""


def die_with_parent(parent_pid: int) -> bool:
    """Ask for SIGKILL when the parent dies (Linux), then exit at once when `parent_pid` is
    already gone. True when the kernel took the request."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:
        # Re-parented already: the parent died before the request was in place.
        os._exit(EXIT_ORPHANED)
    return armed


# The environment variable through which a run names itself to the processes it starts
# through a tool it does not control (kfp.local runs each task under `sh -c`).
EXIT_WITH_ENV = "REPLAYRL_EXIT_WITH_PID"


def exit_with(pid: int, *, poll_s: float = 1.0) -> None:
    """Exit (EXIT_ORPHANED) within `poll_s` of process `pid` ending, from a daemon thread: for
    a process whose parent is not the run itself (a shell in between), where the kernel's
    parent-death signal cannot reach it."""
    import threading

    def watch() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                log.error("process %d that started this one is gone: exiting", pid)
                os._exit(EXIT_ORPHANED)
            except PermissionError:
                pass
            time.sleep(poll_s)

    threading.Thread(target=watch, name="replayrl-exit-with", daemon=True).start()


def exit_with_starter() -> None:
    """`exit_with` the run named in EXIT_WITH_ENV, if any (a task of `kfp-local`)."""
    raw = os.environ.get(EXIT_WITH_ENV, "")
    if raw.isdigit() and int(raw) != os.getpid():
        exit_with(int(raw))


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)


def adopt(parent_pid: int, pulse=None, *, clean_exit: bool = True) -> None:
    """Make this process a child that dies with `parent_pid`; `pulse` (a shared array of two
    doubles, or None) receives its progress (`beat`). `clean_exit`: SIGTERM raises
    SystemExit; False keeps its default action (die at once), for a process with nothing to
    close that may wait in a collective, where a Python handler would never run."""
    global _PARENT_PID, _PULSE
    if not die_with_parent(parent_pid):
        log.debug("no PR_SET_PDEATHSIG here: the parent is checked at every beat only")
    _PARENT_PID, _PULSE = parent_pid, pulse
    if clean_exit:
        signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def check_parent() -> None:
    """Raise `Orphaned` when this process was adopted and its parent is gone."""
    if _PARENT_PID is not None and os.getppid() != _PARENT_PID:
        raise Orphaned(f"the parent process {_PARENT_PID} is gone: this process stops")


def beat() -> None:
    """One progress report: the parent is checked (`Orphaned`), then the pulse stamped with
    `time.monotonic()` (one clock for every process of a Linux machine) and the slowest
    interval between two reports updated. A no-op in a process nobody adopted."""
    check_parent()
    if _PULSE is None:
        return
    now = time.monotonic()
    last = _PULSE[0]
    if last > 0:
        _PULSE[1] = max(_PULSE[1], now - last)
    _PULSE[0] = now


@contextlib.contextmanager
def beating(interval_s: float = 1.0) -> Iterator[None]:
    """Progress reports from a thread while the caller waits on something bounded by its own
    timeout (the trainer's weight broadcast to a worker that stopped answering: up to
    `asynchronous.weight_timeout_s`): a wait by design is not a stall for the watchdog."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            with contextlib.suppress(Exception):  # an orphan is found by the caller's own beat
                beat()

    thread = threading.Thread(target=run, name="beating", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def exit_code_of(error: BaseException) -> int | None:
    """The exit code of a child that must stop for good with `error`; None for any other
    error (the parent may start it again)."""
    if isinstance(error, StaleOwnerError | Superseded):
        return EXIT_SUPERSEDED
    if isinstance(error, Orphaned):
        return EXIT_ORPHANED
    return None
