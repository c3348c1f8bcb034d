from __future__ import annotations

import time

import pytest

from replayrl.core import clock

pytestmark = pytest.mark.unit


def _spin(cpu_seconds: float) -> int:
    """Busy until this thread has used `cpu_seconds` of CPU, however loaded the machine."""
    n, end = 0, time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        n += 1
    return n


def test_a_busy_part_costs_cpu_seconds_and_a_sleeping_part_does_not():
    start = clock.now()
    _spin(0.4)
    busy = clock.since(start)
    start = clock.now()
    time.sleep(0.4)
    idle = clock.since(start)
    assert busy.wall >= 0.4 and idle.wall >= 0.4
    # Which clock, not how fast: the loop spins on CPU time (a loop on a core shared with other
    # jobs gets less than its wall time), a sleep gets none.
    assert 0.38 < busy.cpu <= busy.wall * 1.1
    assert idle.cpu < 0.05


def test_children_count_once_they_ended_and_were_waited_for():
    import subprocess
    import sys

    start, own = clock.now(), time.process_time()
    subprocess.run(
        [
            sys.executable,
            "-c",
            # Spins until it has used 0.3 s of CPU, however busy the machine is.
            "import time\nwhile time.process_time() < 0.3: pass",
        ],
        check=True,
    )
    took, own = clock.since(start), time.process_time() - own
    # the child's start-up and its 0.3 s of CPU count; this process itself only waited
    assert took.cpu > 0.25  # the children's clock ticks in 10 ms
    assert own < 0.1


class WallEvent:
    """A timing event on the host's wall clock, standing in for `torch.cuda.Event` on a
    machine without CUDA: `record` reads `time.perf_counter` (the moment a device would reach
    the event on an idle stream), `synchronize` counts how often the timer waited."""

    synchronized: list[WallEvent] = []

    def __init__(self):
        self.at: float | None = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        WallEvent.synchronized.append(self)

    def elapsed_time(self, end_event: WallEvent) -> float:
        assert self.at is not None and end_event.at is not None, "an event was not recorded"
        return (end_event.at - self.at) * 1000.0


def test_a_device_timer_measures_its_phase_and_waits_only_at_its_end():
    WallEvent.synchronized = []
    timer = clock.DeviceTimer(WallEvent)
    assert timer.enabled
    timer.start()
    time.sleep(0.2)  # the phase's work
    assert WallEvent.synchronized == []  # nothing waited for inside the phase
    first = timer.stop()
    assert first is not None and 0.2 <= first < 2.0
    assert len(WallEvent.synchronized) == 1  # the end event, once
    # A second phase on the same timer starts from its own start, not the first one's.
    timer.start()
    time.sleep(0.05)
    second = timer.stop()
    assert second is not None and 0.05 <= second < first
    with pytest.raises(RuntimeError, match="before start"):
        timer.stop()  # each stop needs its start


def test_without_a_device_the_timer_measures_nothing():
    timer = clock.DeviceTimer(None)
    timer.start()
    assert not timer.enabled and timer.stop() is None  # absent, not 0


def test_the_process_timer_is_off_without_cuda():
    import torch

    timer = clock.cuda_timer()
    assert timer.enabled == torch.cuda.is_available()
    timer.start()
    took = timer.stop()
    assert (took is None) == (not torch.cuda.is_available())
