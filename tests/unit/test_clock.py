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
