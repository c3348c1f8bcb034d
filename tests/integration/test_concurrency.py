"""Two writers on one lineage: exactly one advances each iteration (compare-and-swap on
state.json, an S3 conditional write), the other stops with a clear error, and the lineage
ends as if only one had run: no duplicate rows, usage or metrics."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fault_helpers import (
    PRESET,
    assert_same_end_state,
    crash_config,
    crash_overrides,
    end_state,
    rows,
)

from replayrl import storage
from replayrl.engine import steps
from replayrl.engine.inline import run_inline
from replayrl.engine.iteration import record_iteration
from replayrl.engine.lineage import open_lineage
from replayrl.errors import ReplayRLError

pytestmark = pytest.mark.integration


def one_iteration(cfg, paths, state):
    """generate, compact, train, evaluate of state.next_iteration, as an engine runs them."""
    t, v = state.next_iteration, state.policy_version
    gen = steps.generate(cfg, paths, iteration=t, policy_version=v)
    comp = steps.compact(cfg, paths, iteration=t, current_policy_version=v)
    tr = steps.train(cfg, paths, iteration=t, policy_version=v, buffer_version=comp.buffer_version)
    ev = (
        steps.evaluate(cfg, paths, policy_version=tr.policy_version)
        if steps.eval_due(cfg, t)
        else None
    )
    return dict(gen=gen, comp=comp, tr=tr, ev=ev)


def test_the_second_writer_of_an_iteration_loses_and_logs_nothing(tmp_path, s3_root):
    # The steps run here one by one, as pods do, checkpoint every iteration; so does the
    # reference.
    every = "train.checkpoint_every=1"
    ref = crash_config(tmp_path, f"{s3_root}/ref", "iterations=2", every)
    run_inline(ref)
    cfg = crash_config(tmp_path, f"{s3_root}/two", "iterations=2", every)
    paths, state, tracker = open_lineage(cfg)
    # both writers did the work of iteration 1 before either committed it
    work_a = one_iteration(cfg, paths, state)
    work_b = one_iteration(cfg, paths, state)
    new_state, _ = record_iteration(cfg, paths, state, tracker, **work_a)
    with pytest.raises(ReplayRLError, match="another run is advancing this lineage"):
        record_iteration(cfg, paths, state, tracker, **work_b)
    # the loser cannot overwrite what the winner's commit points at
    with pytest.raises(ReplayRLError, match="Iteration 1 .* already committed"):
        steps.generate(cfg, paths, iteration=1, policy_version=0)
    with pytest.raises(ReplayRLError, match="already committed"):
        steps.train(
            cfg, paths, iteration=1, policy_version=0, buffer_version=work_b["comp"].buffer_version
        )
    assert storage.read_state(paths) == new_state
    run_inline(cfg)
    assert_same_end_state(end_state(cfg), end_state(ref))


@pytest.mark.slow
def test_two_processes_on_one_lineage(tmp_path, s3_root):
    """Two `replayrl run` processes started together on an existing lineage (two schedules
    overlapping): whatever the interleaving, the lineage ends as one run would leave it."""
    ref = crash_config(tmp_path, f"{s3_root}/ref", "iterations=3")
    run_inline(ref)
    cfg = crash_config(tmp_path, f"{s3_root}/race", "iterations=3")
    open_lineage(cfg)  # the lineage exists; both runs resume it
    overrides = crash_overrides(tmp_path, f"{s3_root}/race", "iterations=3")
    sets = [a for o in overrides for a in ("--set", o)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "replayrl.cli.main", "run", "--config", str(PRESET), *sets],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes in ([0, 0], [0, 2], [2, 2]), results
    for code, err in results:
        assert "Traceback" not in err
        if code == 2:
            # Stopped by the lineage's lease (before writing), or by the state's swap.
            assert (
                "is being advanced by run" in err or "another run is advancing this lineage" in err
            ), err
    run_inline(cfg)  # finishes the lineage if both stopped
    assert_same_end_state(end_state(cfg), end_state(ref))
    print(f"two writers: exit codes {codes}")


def test_readers_see_whole_snapshots_during_compaction_and_vacuum(s3_root):
    """A reader of the latest version, and one pinned to an old version, while a writer
    appends, deletes (retention), bin-packs and vacuums: every read is one whole version
    (whole iterations, a window of the newest), and the pinned version stays readable and
    unchanged for the grace period."""
    import threading

    from replayrl.buffer.table import ReplayBuffer

    root = storage.join(s3_root, "buf")
    options = storage.delta_storage_options(root)
    writer = ReplayBuffer(root, storage_options=options)
    writer.append(rows(1), iteration=1)
    writer.append(rows(2), iteration=2)
    pinned_version = writer.version()
    pinned = ReplayBuffer(root, storage_options=options).read(version=pinned_version)
    done = threading.Event()
    seen, problems = [], []

    def read_latest():
        reader = ReplayBuffer(root, storage_options=options)
        while not done.is_set():
            try:
                table = reader.read(columns=["iteration", "rollout_id"])
            except Exception as e:  # any failure is a problem here
                problems.append(repr(e))
                continue
            its = table.column("iteration").to_pylist()
            counts = {i: its.count(i) for i in set(its)}
            seen.append(tuple(sorted(counts)))
            if any(c != 8 for c in counts.values()):
                problems.append(f"partial iteration: {counts}")
            if sorted(counts) != list(range(min(counts), max(counts) + 1)):
                problems.append(f"not a window of iterations: {sorted(counts)}")

    def read_pinned():
        reader = ReplayBuffer(root, storage_options=options)
        while not done.is_set():
            try:
                if not reader.read(version=pinned_version).equals(pinned):
                    problems.append("pinned version changed")
            except Exception as e:
                problems.append(f"pinned: {e!r}")

    threads = [threading.Thread(target=read_latest), threading.Thread(target=read_pinned)]
    for t in threads:
        t.start()
    try:
        for it in range(3, 9):
            writer.append(rows(it), iteration=it)
            writer.compact(
                capacity=24,  # three iterations of 8 rows
                current_policy_version=it,
                min_files_to_compact=2,
                vacuum_grace_s=3600,
            )
    finally:
        done.set()
        for t in threads:
            t.join()
    assert problems == []
    assert len(seen) >= 5
    final = writer.read(columns=["iteration"]).column("iteration").to_pylist()
    assert sorted(set(final)) == [6, 7, 8] and len(final) == 24
    # after the grace period has passed (grace 0 here) the pinned version's files go, and a
    # reader pinned to it gets a clear error, never part of the rows
    writer.vacuum(grace_s=0)
    with pytest.raises(ReplayRLError, match="vacuum"):
        ReplayBuffer(root, storage_options=options).read(version=pinned_version)
