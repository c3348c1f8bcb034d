"""An engine's child processes die with their parent (PR_SET_PDEATHSIG, and the exit at once
when the parent is already gone), report progress to a watchdog, and a run stops at its next
safe point on SIGTERM or SIGINT. Real processes and real signals; each test takes a second
or two."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from replayrl.engine import children
from replayrl.engine.asynchronous import watchdog
from replayrl.engine.stopping import Stopped, StopSignals

pytestmark = pytest.mark.unit

# A middle process that starts one adopted child (the spawn start method, as the engines do),
# writes the child's pid, then waits to be killed.
MIDDLE = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys, time
    from replayrl.engine import children

    def child(parent_pid, pulse):
        children.adopt(parent_pid, pulse)
        while True:
            children.beat()
            time.sleep(0.05)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        pulse = ctx.Array("d", 2, lock=False)
        p = ctx.Process(target=child, args=(os.getpid(), pulse))
        p.start()
        while pulse[0] == 0:  # the child has adopted its parent and reported once
            time.sleep(0.02)
        open(sys.argv[1], "w").write(str(p.pid))
        time.sleep(600)
    """
)


def wait_for(predicate, timeout_s: float) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.02)
    return time.monotonic() - start


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_adopted_child_dies_with_its_parent_even_a_sigkilled_one(tmp_path):
    script, pid_file = tmp_path / "middle.py", tmp_path / "child.pid"
    script.write_text(MIDDLE)
    middle = subprocess.Popen([sys.executable, str(script), str(pid_file)])
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), timeout_s=60)
        child = int(pid_file.read_text())
        assert not gone(child)
        middle.kill()  # SIGKILL: no handler, no atexit, no chance to stop the child
        middle.wait()
        assert wait_for(lambda: gone(child), timeout_s=5) < 5
    finally:
        middle.kill()


def test_a_child_whose_parent_is_already_gone_exits_at_once():
    # The race: the parent died between the spawn and the prctl call. A parent pid that is
    # not this child's parent stands for it.
    code = "from replayrl.engine import children; children.adopt(1); print('still here')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == children.EXIT_ORPHANED and "still here" not in done.stdout


def test_beat_reports_progress_and_the_slowest_interval(monkeypatch):
    pulse = [0.0, 0.0]
    monkeypatch.setattr(children, "_PULSE", pulse)
    monkeypatch.setattr(children, "_PARENT_PID", os.getppid())
    children.beat()
    assert pulse[0] > 0 and pulse[1] == 0
    time.sleep(0.05)
    children.beat()
    children.beat()
    assert 0.05 <= pulse[1] < 1
    monkeypatch.setattr(children, "_PARENT_PID", os.getppid() + 1)  # another parent: gone
    with pytest.raises(children.Orphaned):
        children.beat()


def test_the_stall_limit_is_derived_from_the_slowest_interval():
    limit = watchdog.stall_limit_s
    assert limit(slowest_s=None, timeout_s=None, startup_s=1800) == 1800  # no report yet
    assert limit(slowest_s=2.0, timeout_s=None, startup_s=1800) == watchdog.FLOOR_S
    assert limit(slowest_s=120.0, timeout_s=None, startup_s=1800) == 1200  # 10 x 2 minutes
    assert limit(slowest_s=120.0, timeout_s=30, startup_s=1800) == 30  # the config's
    import multiprocessing as mp

    pulse = watchdog.Pulse.new(mp.get_context("spawn"))
    assert pulse.slowest_s is None and pulse.stalled(timeout_s=1, startup_s=60) is None
    pulse.shared[0], pulse.shared[1] = time.monotonic() - 5, 0.5
    silent, limit_s = pulse.stalled(timeout_s=1, startup_s=60)
    assert silent >= 5 and limit_s == 1
    assert pulse.stalled(timeout_s=None, startup_s=60) is None  # max(600, 5) not reached


def test_a_signal_asks_for_a_stop_at_the_next_safe_point_and_a_second_one_does_not_wait():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as signals:
        signals.check("before iteration 1")  # nothing received: goes on
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: signals.received is not None, timeout_s=5)
        with pytest.raises(Stopped, match="stopped by SIGTERM before iteration 2; re-run"):
            signals.check("before iteration 2")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) is before  # restored


def test_exit_codes_of_errors_that_must_not_be_retried():
    from replayrl.errors import ReplayRLError, StaleOwnerError

    assert children.exit_code_of(StaleOwnerError("x")) == children.EXIT_SUPERSEDED
    assert children.exit_code_of(children.Superseded("x")) == children.EXIT_SUPERSEDED
    assert children.exit_code_of(children.Orphaned("x")) == children.EXIT_ORPHANED
    assert children.exit_code_of(ReplayRLError("x")) is None
