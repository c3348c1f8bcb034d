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
own work: it is not a measure of GPU time. For that, `DeviceTimer` reads a third clock
around a phase on a CUDA device (generation, training, evaluation): a pair of timing events
on the device's current stream.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol


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


class DeviceEvent(Protocol):
    """What `DeviceTimer` needs of an event: `torch.cuda.Event(enable_timing=True)`."""

    def record(self) -> None: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end_event: Any) -> float: ...  # milliseconds, to `end_event`


class DeviceTimer:
    """Device seconds of one phase: an event recorded on the device's current stream when the
    phase starts (`start`) and one when it ends (`stop`), which waits for the end event only
    then, so nothing inside the phase is synchronised.

    The two events measure the time the stream took from reaching the first to completing
    the second: the phase's queued kernels, plus any gap in which the host had not yet given
    the stream work (tokenisation, Python between launches, a CPU-side wait). It is the
    device time the phase held the stream, an upper bound on the time the device was busy
    with it; work on other streams or in other processes (a trainer's own processes under
    `train.distributed`) is outside it.

    `event`: makes one timing event (`torch.cuda.Event` with `enable_timing=True` on a GPU);
    None = no device (the CPU), where `start` and `stop` do nothing and `stop` returns None,
    so the metric is absent rather than 0. `cuda_timer()` picks one for this process.

        timer = cuda_timer()
        timer.start()
        ...                              # the phase's work
        device_s = timer.stop()          # e.g. 0.27 on a GPU, None on the CPU
    """

    def __init__(self, event: Callable[[], DeviceEvent] | None):
        self._event = event
        self._start: DeviceEvent | None = None

    @property
    def enabled(self) -> bool:
        return self._event is not None

    def start(self) -> None:
        if self._event is not None:
            self._start = self._event()
            self._start.record()

    def stop(self) -> float | None:
        """Seconds from `start` to now on the device (waits for the device to reach now);
        None without a device. A `stop` without `start` is a bug and raises."""
        if self._event is None:
            return None
        if self._start is None:
            raise RuntimeError("DeviceTimer.stop() before start()")
        end = self._event()
        end.record()
        end.synchronize()
        start, self._start = self._start, None
        return start.elapsed_time(end) / 1000.0


def cuda_timer() -> DeviceTimer:
    """A `DeviceTimer` on this process's current CUDA stream when CUDA is usable, else one
    that measures nothing (no CUDA call beyond asking whether CUDA is available)."""
    import torch

    if not torch.cuda.is_available():
        return DeviceTimer(None)
    return DeviceTimer(lambda: torch.cuda.Event(enable_timing=True))
