"""The two clocks every part of the compute ledger is read on: wall and process CPU seconds.

Wall seconds (`time.perf_counter`) are what an iteration took; on a machine shared with
other jobs they also count the time this process waited for a core. CPU seconds are the
user + system time the operating system charged to this process: all its threads (torch's
intra-op pool, an in-process vLLM engine), plus child processes that have ended and been
waited for while the clock ran (the `train.distributed` workers, started and joined inside
the training part). A child that is still running (a server, an engine core that lives in
its own process) is not counted. Waiting for a core, for I/O or for a sleep costs no CPU
seconds, so they measure the method's own work where the wall clock measures the machine.

    start = clock.now()
    ...                                  # the part's work
    took = clock.since(start)            # Clocks(wall=0.31, cpu=0.29)

A single-threaded loop on an idle core gives cpu ≈ wall; a sleep, cpu ≈ 0; four busy
threads, cpu ≈ 4 × wall. On a GPU the CPU clock sees only the host side (Python,
tokenization, kernel launches, spinning while it waits for the device), not the device's
own work: it is not a measure of GPU time.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple


class Clocks(NamedTuple):
    """A reading of both clocks (`now`), or the seconds between two readings (`since`)."""

    wall: float
    cpu: float


def cpu_seconds() -> float:
    """User + system CPU seconds of this process since it started: every thread, plus the
    child processes it has waited for."""
    t = os.times()
    # process_time: nanosecond resolution, all threads; os.times' children fields are
    # only in clock ticks (10 ms) but are the one portable source for ended children.
    return time.process_time() + t.children_user + t.children_system


def now() -> Clocks:
    return Clocks(time.perf_counter(), cpu_seconds())


def since(start: Clocks) -> Clocks:
    """Wall and CPU seconds from `start` to now."""
    end = now()
    return Clocks(end.wall - start.wall, end.cpu - start.cpu)
