"""No engine leaves a process behind or hangs: `replayrl run` as a user starts it (a real
subprocess, real signals, the tiny config).

- SIGKILL of an asynchronous run's parent: every role process (and the trainer group's
  follower rank) dies within seconds; SIGTERM of the next run stops it with one line, its
  children stopped and its lease released; a third run finishes the lineage with every
  guarantee of an asynchronous lineage.
- SIGSTOP of a worker (the on-policy queue: the trainer waits on it), then of the trainer: the
  watchdog stops each after asynchronous.stall_timeout_s + stop_grace_s and starts it again,
  and the lineage finishes with every row used once.
- SIGTERM of an inline run: it stops between iterations with one line, exit 143, lease
  released; the same command then resumes it to the end. The same for `replayrl experiment`
  and `replayrl sweep run`, which hold one StopSignals across their lineages.
- An asynchronous run paused past its lease and taken over by a newer owner stops, once
  continued, with one error line; its roles stop too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_async import PRESET, assert_async_invariants, small, tables

from replayrl.config import load_config
from replayrl.engine.asynchronous import board
from replayrl.storage import lease, lineage_paths, paths_of

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("processes")]
CLI = str(Path(sys.executable).parent / "replayrl")


class Run:
    """`replayrl run ...` in a subprocess, its output in a file (read while it runs)."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        *,
        engine: str = "async",
        arm=None,
        env=None,
        argv: list[str] | None = None,
    ):
        """`args` are `--set` overrides of `replayrl run`; `argv`, when given, is another
        command's whole argument list instead (`experiment ...`, `sweep run ...`)."""
        if argv is None:
            argv = ["run", "--config", str(PRESET), "--engine", engine]
            argv += ["--arm", arm] if arm else []
            for a in args:
                argv += ["--set", a]
        cmd = [CLI, *argv]
        self.log = log
        self.out = open(log, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            cmd, stdout=self.out, stderr=subprocess.STDOUT, text=True, env=env
        )

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, predicate, *, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended before {what}:\n{self.text()[-3000:]}")
            found = predicate()
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}:\n{self.text()[-3000:]}")

    def wait(self, timeout_s: float = 900) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.out.close()

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            for p in self.descendants():
                p.kill()
            self.proc.kill()
        self.out.close()


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def pid_alive(pid: int) -> bool:
    try:
        return bool(alive([psutil.Process(pid)]))
    except psutil.NoSuchProcess:
        return False


def seconds_until_gone(procs: list[psutil.Process], *, timeout_s: float) -> float:
    start = time.monotonic()
    while alive(procs) and time.monotonic() - start < timeout_s:
        time.sleep(0.1)
    left = alive(procs)
    assert not left, [(p.pid, p.cmdline()) for p in left]
    return time.monotonic() - start


def released(paths) -> bool:
    current = lease.read(paths)
    return current is None or current.expires_at <= time.time()


def committed(paths) -> int:
    """The inline lineage's last committed iteration (0 before its first)."""
    state = Path(paths.state)
    return json.loads(state.read_text())["next_iteration"] - 1 if state.exists() else 0


def assert_stopped_between_iterations(run: Run, code: int, paths, *, iterations: int) -> int:
    """The run stopped on SIGTERM after its second commit and before its last, with exit 143,
    one last line naming the next iteration, no traceback, and its lease released. Returns
    the last committed iteration."""
    lines = run.text().strip().splitlines()
    assert code == 128 + signal.SIGTERM, lines[-20:]
    last = committed(paths)
    assert 2 <= last < iterations
    assert lines[-1] == (
        f"replayrl: stopped by SIGTERM before iteration {last + 1}; "
        "re-run the same command to resume"
    ), lines[-5:]
    assert "Traceback" not in run.text()
    assert released(paths)
    return last


def assert_finished(cfg, *, publish_every: int) -> None:
    """What every finished asynchronous lineage satisfies (as test_async checks)."""
    paths = paths_of(cfg)
    assert_async_invariants(cfg, publish_every=publish_every)
    assert board.latest(paths).version == cfg.total_gradient_steps
    _, usage = tables(cfg)
    steps = usage.column("iteration").to_numpy()
    assert sorted(set(steps.tolist())) == list(range(1, cfg.total_gradient_steps + 1))
    state = json.loads(Path(paths.state).read_text())
    assert state["policy_version"] == cfg.total_gradient_steps


def test_a_killed_async_run_leaves_no_process_and_a_stopped_one_releases_its_lease(tmp_path):
    # T = 2 trainers: the trainer role has a child of its own (the follower rank).
    args = small(
        tmp_path, "iterations=6", "asynchronous.trainers=2", "asynchronous.publish_every=4"
    )
    cfg = load_config(PRESET, overrides=args)
    paths = paths_of(cfg)

    first = Run(args, tmp_path / "first.log")
    try:
        first.wait_for(
            lambda: board.read_trainer(paths).gradient_step >= 4,
            timeout_s=300,
            what="4 gradient steps",
        )
        kids = first.descendants()
        assert len(kids) >= 4, [p.cmdline() for p in kids]  # trainer, its rank 1, eval, worker
        first.proc.send_signal(signal.SIGKILL)
        orphans_died_s = seconds_until_gone(kids, timeout_s=15)
    finally:
        first.kill()
    print(f"children of the SIGKILLed parent gone after {orphans_died_s:.2f} s")

    second = Run(args, tmp_path / "second.log")
    try:
        reached = board.read_trainer(paths).gradient_step
        second.wait_for(
            lambda: board.read_trainer(paths).gradient_step >= reached + 4,
            timeout_s=300,
            what="4 more gradient steps",
        )
        kids = second.descendants()
        second.proc.send_signal(signal.SIGTERM)
        code = second.wait(timeout_s=120)
        stopped_s = seconds_until_gone(kids, timeout_s=15)
    finally:
        second.kill()
    lines = second.text().strip().splitlines()
    assert code == 128 + signal.SIGTERM, lines[-20:]
    assert lines[-1].startswith("replayrl: stopped by SIGTERM at gradient step "), lines[-5:]
    assert lines[-1].endswith("; re-run the same command to resume")
    assert "Traceback" not in second.text()
    assert released(paths)
    print(f"SIGTERM: children gone {stopped_s:.2f} s after the run exited")

    third = Run(args, tmp_path / "third.log")
    assert third.wait() == 0, third.text()[-3000:]
    assert_finished(cfg, publish_every=4)


def test_an_async_run_whose_lease_was_taken_stops_with_one_line(tmp_path):
    """The run, its roles included, is stopped (SIGSTOP: a paused machine) past its lease;
    another owner takes the lineage over; the run is continued: it stops, its roles with it,
    with one error line, and leaves the new owner's lease alone."""
    ttl_s = 3.0  # renewed every second; taken over 4 s after the last renewal
    args = small(tmp_path, "iterations=100", "asynchronous.publish_every=4")
    cfg = load_config(PRESET, overrides=args)
    paths = paths_of(cfg)
    env = {**os.environ, "REPLAYRL_LEASE_TTL_S": str(ttl_s)}
    run = Run(args, tmp_path / "run.log", env=env)
    try:
        run.wait_for(
            lambda: board.read_trainer(paths).gradient_step >= 4,
            timeout_s=300,
            what="4 gradient steps",
        )
        kids = run.descendants()
        for p in [psutil.Process(run.proc.pid), *kids]:
            p.suspend()  # SIGSTOP
        time.sleep(ttl_s * 4 / 3 + 2)
        with lease.held(paths, owner="the-newer-run", ttl_s=ttl_s) as newer:
            newer.hold()
            for p in [psutil.Process(run.proc.pid), *kids]:
                p.resume()  # SIGCONT
            code = run.wait(timeout_s=120)
            gone_s = seconds_until_gone(kids, timeout_s=15)
            assert lease.read(paths).owner == "the-newer-run"
    finally:
        for p in alive([psutil.Process(run.proc.pid), *kids]) if run.proc.poll() is None else []:
            p.resume()
        run.kill()
    lines = run.text().strip().splitlines()
    assert code == 2, lines[-20:]
    assert board.read_trainer(paths).gradient_step < cfg.total_gradient_steps
    assert lines[-1].startswith("replayrl: error: "), lines[-5:]
    assert "lease" in lines[-1] or "newer" in lines[-1], lines[-1]
    print(f"lease lost: the run stopped with {lines[-1]!r}; roles gone {gone_s:.2f} s later")


def test_a_stopped_worker_and_a_stopped_trainer_are_restarted_by_the_watchdog(tmp_path):
    """On the default weight path (broadcast), whose workers hold a connection to the stopped
    trainer's weight group while it is replaced by one listening elsewhere: they used to sit
    30 s in torch's store client at the segment's end, which the watchdog took for a stall."""
    timeout_s, grace_s = 10.0, 2.0
    args = small(
        tmp_path,
        "iterations=8",
        "asynchronous.publish_every=4",
        f"asynchronous.stall_timeout_s={timeout_s}",
        f"asynchronous.stop_grace_s={grace_s}",
    )
    cfg = load_config(PRESET, overrides=args, arm="on-policy")
    paths = paths_of(cfg)
    run = Run(args, tmp_path / "run.log", arm="on-policy")
    limit = timeout_s + grace_s + 5  # the documented limit, plus polls and a loaded machine
    try:
        worker = run.wait_for(
            lambda: (s := board.read_worker(paths, 0)).batches >= 2 and s,
            timeout_s=300,
            what="the worker's second batch",
        )
        stopped = time.monotonic()
        os.kill(worker.pid, signal.SIGSTOP)
        run.wait_for(
            lambda: "worker0 made no progress" in run.text() and "starting it again" in run.text(),
            timeout_s=limit,
            what="the watchdog to restart the stopped worker",
        )
        worker_restarted_s = time.monotonic() - stopped
        assert not pid_alive(worker.pid)
        step = board.read_trainer(paths).gradient_step
        trainer = run.wait_for(
            lambda: (s := board.read_trainer(paths)).gradient_step >= step + 4 and s,
            timeout_s=300,
            what="4 more gradient steps after the worker's restart",
        )
        stopped = time.monotonic()
        os.kill(trainer.pid, signal.SIGSTOP)
        run.wait_for(
            lambda: (
                "trainer0 made no progress" in run.text()
                and run.text().count("starting it again") == 2
            ),
            timeout_s=limit,
            what="the watchdog to restart the stopped trainer",
        )
        trainer_restarted_s = time.monotonic() - stopped
        assert not pid_alive(trainer.pid)
        code = run.wait()
    finally:
        run.kill()
    out = run.text()
    assert code == 0, out[-3000:]
    assert "worker0 x1" in out and "trainer0 x1" in out, out[-2000:]
    print(
        f"watchdog ({timeout_s:.0f} s + {grace_s:.0f} s grace): worker restarted after "
        f"{worker_restarted_s:.1f} s, trainer after {trainer_restarted_s:.1f} s"
    )
    # The queue's guarantee survives both: every row used exactly once, each step once.
    rows, usage = tables(cfg)
    used = usage.column("rollout_id").to_pylist()
    assert len(used) == len(set(used)) == cfg.total_gradient_steps * cfg.train.batch_size
    steps = usage.column("iteration").to_numpy()
    assert sorted(set(steps.tolist())) == list(range(1, cfg.total_gradient_steps + 1))
    assert not set(used) & set(rows.column("rollout_id").to_pylist())


def test_sigterm_stops_an_inline_run_between_iterations_and_the_same_command_resumes(tmp_path):
    from tiny_config import overrides

    args = overrides(tmp_path / "runs", "iterations=6", "eval.every=3")
    cfg = load_config(PRESET, overrides=args)
    paths = paths_of(cfg)

    run = Run(args, tmp_path / "first.log", engine="inline")
    try:
        run.wait_for(lambda: committed(paths) >= 2, timeout_s=300, what="two iterations")
        sent = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        code = run.wait(timeout_s=120)
        stop_s = time.monotonic() - sent
    finally:
        run.kill()
    last = assert_stopped_between_iterations(run, code, paths, iterations=6)
    print(f"inline run stopped {stop_s:.1f} s after SIGTERM, at iteration {last + 1}")

    again = Run(args, tmp_path / "second.log", engine="inline")
    assert again.wait() == 0, again.text()[-3000:]
    assert committed(paths) == 6
    _, usage = tables(cfg)
    uses = usage.group_by("iteration").aggregate([("rollout_id", "count")])
    assert sorted(uses.column("iteration").to_pylist()) == list(range(1, 7))
    assert set(uses.column("rollout_id_count").to_pylist()) == {
        cfg.train.steps_per_iteration * cfg.train.batch_size
    }


@pytest.mark.parametrize("command", ["experiment", "sweep"])
def test_sigterm_stops_an_experiment_or_sweep_with_one_line_and_the_same_command_resumes(
    tmp_path, command
):
    """`replayrl experiment` and `replayrl sweep run` hold one StopSignals for the whole
    command: a SIGTERM during a lineage stops it between iterations (exit 143, one line, its
    lease released, no comparison written), and the same command finishes what is left."""
    from tiny_config import overrides

    out = tmp_path / "out"
    sets = overrides(tmp_path / "unused", "iterations=6", "eval.every=3")
    sets = [s for s in sets if not s.startswith("storage.run_root=")]
    flags = [arg for s in sets for arg in ("--set", s)]
    if command == "experiment":
        args = ["experiment", "--config", str(PRESET), "--seeds", "1", "--out", str(out), *flags]
        lineages = ["chain_sum-on-policy-s0", "chain_sum-replay-s0"]
    else:
        args = ["sweep", "run", "--config", str(PRESET), "--grid", "N=64,128", "--out", str(out)]
        args += flags
        lineages = ["chain_sum-replay-N64", "chain_sum-replay-N128"]
    runs = str(out / "runs")
    paths = lineage_paths(runs, lineages[0])  # the one the signal stops

    run = Run([], tmp_path / "first.log", argv=args)
    try:
        run.wait_for(lambda: committed(paths) >= 2, timeout_s=300, what="two iterations")
        run.proc.send_signal(signal.SIGTERM)
        code = run.wait(timeout_s=120)
    finally:
        run.kill()
    assert_stopped_between_iterations(run, code, paths, iterations=6)
    assert not (out / "comparison.json").exists()

    again = Run([], tmp_path / "second.log", argv=args)
    assert again.wait() == 0, again.text()[-3000:]
    assert [committed(lineage_paths(runs, name)) for name in lineages] == [6, 6]
    text = again.text()
    assert text.count(": running") == 2, text[-3000:]  # the stopped one resumed, the next ran
    if command == "experiment":
        assert json.loads((out / "comparison.json").read_text())["arms"]["replay"]["seeds"] == [0]
