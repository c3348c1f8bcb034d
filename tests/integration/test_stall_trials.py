"""Stall trials: an owner stopped (SIGSTOP) at a named point — inside a Delta commit, a
checkpoint write, a restore, a vacuum, between a write and its commit — loses its lineage
to the next run once its lease expires; the next run takes over (a higher fencing epoch)
and commits iterations; then the stopped owner is continued (SIGCONT). It must stop at its
next durable write without landing anything, and the lineage, run to its end, must equal an
uninterrupted run's (rows, usage log, checkpoints, weights, each metric once per step).

The trials are one chain of child processes on one lineage (forked from a server that only
imported the engine, `children`, and running this file's `child_main`, like the kill trials
of test_crash_safety.py): child k takes the lineage
over from child k-1 (stopped at its point), commits at least one iteration, then stops at
its own point; child k-1 is continued once a newer epoch has committed an iteration, and
must exit as a stale owner. A local run root and the S3 server each get the whole chain.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import children
import pytest
from fault_helpers import PRESET, assert_same_end_state, crash_config, crash_overrides, end_state

# The CLI lease TTL of the children: a stopped child's lineage is taken over this long plus
# a third of it after its last renewal (renewed every third).
TTL_S = 6.0
STALE_EXIT = 3
ITERATIONS = ["iterations=12", "train.checkpoint_every=2"]


def points() -> dict[str, tuple[object, str, str]]:
    """Named stall points: (object, attribute, 'before' | 'after' the call)."""
    from deltalake import DeltaTable

    from replayrl.buffer import table as table_module
    from replayrl.buffer.table import ReplayBuffer
    from replayrl.storage import checkpoints, state

    return {
        # between a write and its commit: the rows are in, state.json does not name them
        "generate:after_append": (ReplayBuffer, "append", "after"),
        # inside a Delta commit: the fence was checked, the commit not yet made
        "delta:inside_commit": (table_module, "write_deltalake", "before"),
        "compact:inside_retention_delete": (DeltaTable, "delete", "before"),
        # inside a checkpoint write: every file written, the COMPLETE marker not yet
        "train:inside_checkpoint_write": (checkpoints, "mark_complete", "before"),
        "train:after_usage_log": (ReplayBuffer, "log_usage", "after"),
        "record:before_commit": (state, "advance_state", "before"),
        "record:after_commit": (state, "advance_state", "after"),
        "checkpoint:inside_vacuum": (DeltaTable, "vacuum", "before"),
        # inside the restore of a rewind (reached while a run resumes after a stall)
        "rewind:inside_restore": (DeltaTable, "restore", "before"),
        "checkpoint:inside_prune": (checkpoints, "prune_checkpoints", "before"),
    }


# The chain, in order: (point, commits this child makes before it may stop there). A
# rewind's restore comes before any commit of the run that rewinds.
TRIALS = [
    ("generate:after_append", 1),
    ("delta:inside_commit", 1),
    ("train:inside_checkpoint_write", 1),
    ("compact:inside_retention_delete", 1),
    ("train:after_usage_log", 1),
    # the run that takes over from the one above rewinds (its rows are uncommitted)
    ("rewind:inside_restore", 0),
    ("record:before_commit", 1),
    ("checkpoint:inside_vacuum", 1),
    ("record:after_commit", 1),
    ("checkpoint:inside_prune", 1),
]


def arm(name: str, commits_first: int) -> None:
    """Stop this process (SIGSTOP) the first time point `name` is reached after it has
    committed `commits_first` iterations."""
    import threading

    from replayrl.engine import inline
    from replayrl.storage import lease

    owner, attr, when = points()[name]
    original = getattr(owner, attr)
    record = inline.record_iteration
    now = {"commits": 0, "fired": False}
    # The named point is the main thread's; the lease heartbeat (another thread) must not be
    # stopped inside its renewal, which on a local run root holds the lease's lock file: a
    # process stopped holding it blocks every other process's lease update (ReplayRLError
    # "Lock ... held for over 60 s", the documented outcome) and the chain could not go on.
    renewing = threading.Lock()
    renew = lease.renew

    def guarded_renew(*args, **kwargs):
        with renewing:
            return renew(*args, **kwargs)

    def counting_record(*args, **kwargs):
        result = record(*args, **kwargs)
        now["commits"] += 1
        return result

    def maybe_stop():
        if now["commits"] >= commits_first and not now["fired"]:
            now["fired"] = True
            with renewing:
                print(f"STALLED {name}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)

    def wrapper(*args, **kwargs):
        if when == "before":
            maybe_stop()
        result = original(*args, **kwargs)
        if when == "after":
            maybe_stop()
        return result

    lease.renew = guarded_renew
    inline.record_iteration = counting_record
    setattr(owner, attr, wrapper)


def child_main(argv: list[str]) -> None:
    """The child: run the lineage, stopping at the spec's point; a stale owner's refusal
    exits with STALE_EXIT and its one line."""
    spec = json.loads(argv[0])
    from replayrl.config import load_config
    from replayrl.engine.inline import run_inline
    from replayrl.errors import ReplayRLError

    cfg = load_config(PRESET, overrides=spec["overrides"])
    if spec.get("point"):
        arm(spec["point"], spec["commits_first"])
    print("READY", flush=True)
    try:
        run_inline(cfg)
    except ReplayRLError as e:
        print(f"STALE {type(e).__name__}: {e}", flush=True)
        sys.exit(STALE_EXIT)
    print("DONE", flush=True)


def _start(spec: dict, folder: Path) -> children.Child:
    env = {"REPLAYRL_LEASE_TTL_S": str(TTL_S)}
    return children.start(__file__, [json.dumps(spec)], folder, env=env)


def _stopped(proc: children.Child) -> bool:
    try:
        return Path(f"/proc/{proc.pid}/stat").read_text().split(")")[-1].split()[0] == "T"
    except OSError:
        return False


def _wait(predicate, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _lineage(cfg):
    from replayrl import storage

    return storage.paths_of(cfg)


def run_chain(tmp_path: Path, run_root: str) -> list[dict]:
    """Run the stall chain on `run_root`; returns what each trial saw."""
    from replayrl import storage
    from replayrl.storage import lease

    overrides = crash_overrides(tmp_path, run_root, *ITERATIONS)
    cfg = crash_config(tmp_path, run_root, *ITERATIONS)
    paths = _lineage(cfg)
    stalled: list[tuple[children.Child, str, int, int]] = []  # (proc, point, epoch, next it.)
    folder = tmp_path / ("children-s3" if run_root.startswith("s3://") else "children-local")
    seen = []

    def continue_stale_owners() -> None:
        state = storage.read_state(paths)
        for entry in list(stalled):
            proc, point, epoch, next_iteration = entry
            if state.epoch > epoch and state.next_iteration > next_iteration:
                os.kill(proc.pid, signal.SIGCONT)
                proc.wait(timeout=120)
                out, err = proc.output()
                seen.append(
                    {"point": point, "code": proc.returncode, "out": out, "err": err[-2000:]}
                )
                stalled.remove(entry)

    for point, commits_first in TRIALS:
        if stalled:
            # The stopped owner's lease must run out before another run may take it.
            _wait(
                lambda: (
                    (held := lease.read(paths)) is None
                    or time.time() > held.expires_at + lease.skew_allowance_s(TTL_S)
                ),
                timeout_s=60,
                what="the stopped owner's lease to expire",
            )
        proc = _start(
            {"overrides": overrides, "point": point, "commits_first": commits_first}, folder
        )
        _wait(
            lambda proc=proc: _stopped(proc) or proc.poll() is not None,
            timeout_s=600,
            what=f"a child to reach {point}",
        )
        assert proc.poll() is None, f"{point} never reached: {proc.output()}"
        state = storage.read_state(paths)
        stalled.append((proc, point, state.epoch, state.next_iteration))
        continue_stale_owners()
    # The last one stopped is continued once a fresh run has taken over and committed.
    _wait(
        lambda: (
            (held := lease.read(paths)) is None
            or time.time() > held.expires_at + lease.skew_allowance_s(TTL_S)
        ),
        timeout_s=60,
        what="the last stopped owner's lease to expire",
    )
    last = _start({"overrides": overrides}, folder)
    last.wait(timeout=900)
    assert last.returncode == 0, last.output()[1][-3000:]
    continue_stale_owners()
    assert not stalled, f"owners never continued: {[s[1] for s in stalled]}"
    return seen


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_stalled_owners_are_fenced_out_local_and_s3(tmp_path, s3_root):
    """Ten stall trials on a local run root and ten on S3 (side by side): every stopped
    owner, once continued, stops as a stale owner without landing a write, and each lineage
    ends exactly like an uninterrupted run."""
    from concurrent.futures import ThreadPoolExecutor

    from replayrl.engine.inline import run_inline

    roots = {"local": str(tmp_path / "stalled"), "s3": f"{s3_root}/stalled"}
    ref = crash_config(tmp_path, str(tmp_path / "ref"), *ITERATIONS)
    with children.same_threads():  # the children's thread count: compared exactly
        run_inline(ref)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {name: pool.submit(run_chain, tmp_path, root) for name, root in roots.items()}
            results = {name: f.result() for name, f in futures.items()}
    finally:
        children.kill_all()
    want = end_state(ref)
    for name, root in roots.items():
        seen = results[name]
        assert [s["point"] for s in seen] == [p for p, _ in TRIALS], name
        for s in seen:
            assert s["code"] == STALE_EXIT, f"{name} {s['point']}: {s['out'][-1500:]} {s['err']}"
            # Stopped by the fence (or by its heartbeat finding the lease gone), not by a
            # commit that merely lost a race: fencing is what refused it.
            assert re.search(r"^STALE (StaleOwnerError|LeaseLost): ", s["out"], re.M), s["out"]
            assert "Traceback" not in s["out"], s["out"]
        cfg = crash_config(tmp_path, root, *ITERATIONS)
        assert_same_end_state(end_state(cfg), want)


if __name__ == "__main__":
    child_main(sys.argv[1:])
