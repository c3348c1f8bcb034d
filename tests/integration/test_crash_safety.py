"""Crash safety: a lineage stopped dead at any point and resumed ends exactly where an
uninterrupted run with the same seed ends: the same rollout ids and rows, no duplicates,
the same usage log, the same checkpoint versions and weights, each metric once per step.

Stops land at named points inside generate, compact, train, evaluate, the commit, the
maintenance after a full checkpoint and the rewind to one (`POINTS`), in a given iteration:

- in-process: the point raises `Crash` (a BaseException nothing in the library catches),
  and the same process resumes with fresh workers; cheap, so every point is hit;
- SIGKILL (the kill trials): a child process runs the lineage as one task of 5 iterations
  with a full checkpoint every 3 and kills itself at the point; the next child resumes
  (rewinding to the last full checkpoint) and is killed at the next point. A child is never
  a fork of the test process (its threads, servers and state): it is forked from a server
  that has only imported the engine (`children`), and runs this file's `child_main` (it is
  also a script: `python test_crash_safety.py SPEC` runs one by hand).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import children
import pytest
from fault_helpers import (
    PRESET,
    assert_same_end_state,
    crash_config,
    crash_overrides,
    end_state,
)


def points() -> dict[str, tuple[object, str, str]]:
    """Named stop points: (object, attribute, 'before' | 'after' the call)."""
    from deltalake import DeltaTable
    from deltalake.table import TableOptimizer

    from replayrl.buffer.mirror import BufferMirror
    from replayrl.buffer.table import ReplayBuffer
    from replayrl.engine import lineage
    from replayrl.engine import resources as workers
    from replayrl.engine.tracking import Tracker
    from replayrl.storage import checkpoints, state, transfer

    return {
        "generate:before_append": (ReplayBuffer, "append", "before"),
        "generate:after_append": (ReplayBuffer, "append", "after"),
        "compact:after_retention_delete": (DeltaTable, "delete", "after"),
        "compact:after_bin_pack": (TableOptimizer, "compact", "after"),
        "train:after_sample": (BufferMirror, "sample", "after"),
        "train:between_gradient_steps": (workers, "gradient_step", "after"),
        "train:checkpoint_files_written": (transfer, "upload_dir", "after"),
        "train:checkpoint_files_written_in_place": (workers, "save_policy", "after"),
        "train:checkpoint_marked": (checkpoints, "mark_complete", "after"),
        "train:after_usage_log": (ReplayBuffer, "log_usage", "after"),
        "evaluate:after": (steps_module(), "evaluate", "after"),
        "record:before_commit": (state, "advance_state", "before"),
        "record:after_commit": (state, "advance_state", "after"),
        "record:after_metrics": (Tracker, "log_groups", "after"),
        "checkpoint:after_prune": (checkpoints, "prune_checkpoints", "after"),
        "checkpoint:after_vacuum": (ReplayBuffer, "vacuum", "after"),
        # Reached only while a resumed run rewinds (iteration 0 = before any iteration).
        "rewind:after_restore": (ReplayBuffer, "restore", "after"),
        "rewind:after_state": (lineage, "rewind", "after"),
    }


def steps_module():
    from replayrl.engine import steps

    return steps


class Crash(BaseException):
    """Raised at a stop point; BaseException so no `except Exception` in the library eats it."""


def arm(patch, name: str, iteration: int, stop) -> None:
    """Patch point `name` to call `stop()` the first time it is reached while the loop is
    in `iteration` (the iteration of the latest `steps.generate` call; 0 = before the first
    one). `patch(owner, attr, value)` installs a patch (monkeypatch.setattr, or setattr in a
    child)."""
    from replayrl.engine import steps

    owner, attr, when = points()[name]
    original = getattr(owner, attr)
    generate = steps.generate
    now = {"iteration": 0, "fired": False}

    def tracking_generate(*args, **kwargs):
        now["iteration"] = kwargs["iteration"]
        return generate(*args, **kwargs)

    def maybe_stop():
        if now["iteration"] == iteration and not now["fired"]:
            now["fired"] = True
            stop()

    def wrapper(*args, **kwargs):
        if when == "before":
            maybe_stop()
        result = original(*args, **kwargs)
        if when == "after":
            maybe_stop()
        return result

    patch(steps, "generate", tracking_generate)
    patch(owner, attr, wrapper)


# ---------------------------------------------------------------- in-process stops

# (point, iteration): stop the first time the point is reached in that iteration. The
# lineage has 4 iterations, one task, a full checkpoint after iteration 3 and 4 (the end);
# retention deletes from iteration 3 on, evaluation runs at 2 and 4, bin-packing once there
# are 2 files. A stop before iteration 3's checkpoint rewinds to v0, one after it to v3.
IN_PROCESS_TRIALS = [
    ("generate:before_append", 1),
    ("generate:after_append", 1),
    ("compact:after_bin_pack", 2),
    ("train:after_sample", 2),
    ("train:between_gradient_steps", 2),
    ("evaluate:after", 2),
    # before the commit trials: a redone iteration does not log its metrics again
    ("record:after_metrics", 2),
    ("record:before_commit", 2),
    ("record:after_commit", 2),
    ("rewind:after_restore", 0),
    ("compact:after_retention_delete", 3),
    ("train:checkpoint_files_written", 3),
    ("train:checkpoint_files_written_in_place", 3),
    ("train:checkpoint_marked", 3),
    ("train:after_usage_log", 3),
    # Once iteration 3 (a checkpoint) is committed it is never redone: one stop after it.
    ("checkpoint:after_vacuum", 3),
    ("generate:after_append", 4),
    ("rewind:after_state", 0),
    ("evaluate:after", 4),
    ("checkpoint:after_prune", 4),
]


def run_with_stops(cfg, trials, monkeypatch) -> list[str]:
    """Run the lineage, stopping at each trial's point in turn; then to the end. Returns
    the points that really stopped it (a trial whose point is never reached runs the
    lineage to its end, and the trials after it stop nothing)."""
    from replayrl.engine.inline import run_inline

    stopped = []
    for name, iteration in trials:
        with monkeypatch.context() as m:

            def stop(name: str = name):
                raise Crash(name)

            arm(m.setattr, name, iteration, stop)
            try:
                run_inline(cfg)
            except Crash:
                stopped.append(name)
    run_inline(cfg)
    return stopped


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The end state of the uninterrupted lineage both in-process trials are compared with
    (4 iterations, a full checkpoint every 3), run once, on a local run root: where a
    lineage is stored does not change where it ends."""
    from replayrl.engine.inline import run_inline

    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    ref = crash_config(tmp_path, str(tmp_path / "ref"), "train.checkpoint_every=3")
    run_inline(ref)
    return end_state(ref)


# One worker runs both (pytest-xdist --dist loadgroup), so the reference above runs once.
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.xdist_group("crash-in-process")
def test_stops_at_every_point_resume_to_the_uninterrupted_end_state_local(
    tmp_path, monkeypatch, uninterrupted
):
    cfg = crash_config(tmp_path, str(tmp_path / "crashed"), "train.checkpoint_every=3")
    # locally checkpoints are written in place: there is no upload to stop in
    trials = [t for t in IN_PROCESS_TRIALS if t[0] != "train:checkpoint_files_written"]
    stopped = run_with_stops(cfg, trials, monkeypatch)
    assert stopped == [n for n, _ in trials]
    assert_same_end_state(end_state(cfg), uninterrupted)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.xdist_group("crash-in-process")
def test_stops_at_every_point_resume_to_the_uninterrupted_end_state_s3(
    tmp_path, s3_root, monkeypatch, uninterrupted
):
    cfg = crash_config(tmp_path, f"{s3_root}/crashed", "train.checkpoint_every=3")
    trials = [t for t in IN_PROCESS_TRIALS if t[0] != "train:checkpoint_files_written_in_place"]
    stopped = run_with_stops(cfg, trials, monkeypatch)
    assert stopped == [n for n, _ in trials]
    assert_same_end_state(end_state(cfg), uninterrupted)


# ---------------------------------------------------------------- SIGKILL

# The kill trials: one task of 5 iterations, a full checkpoint after iteration 3 and at the
# end (5). In order: a child is killed at each (point, iteration) in turn, the next resumes.
# Iterations 1-3 rewind to v0, 4-5 to v3; the "rewind" points die inside such a rewind.
KILL_TRIALS = [
    ("generate:before_append", 1),
    ("generate:after_append", 1),
    ("train:after_sample", 1),
    ("compact:after_bin_pack", 2),
    ("train:between_gradient_steps", 2),
    ("train:after_usage_log", 2),
    ("evaluate:after", 2),
    # before the commit trials: a redone iteration does not log its metrics again
    ("record:after_metrics", 2),
    ("record:before_commit", 2),
    ("record:after_commit", 2),
    ("rewind:after_restore", 0),
    ("compact:after_retention_delete", 3),
    ("train:checkpoint_files_written", 3),
    ("train:checkpoint_files_written_in_place", 3),
    ("train:checkpoint_marked", 3),
    ("record:before_commit", 3),
    # Once iteration 3 (a checkpoint) is committed it is never redone: one kill after it.
    ("checkpoint:after_prune", 3),
    ("generate:after_append", 4),
    ("record:after_commit", 4),
    ("rewind:after_restore", 0),
    ("rewind:after_state", 0),
    ("train:between_gradient_steps", 5),
    ("train:checkpoint_marked", 5),
    ("record:before_commit", 5),
    ("checkpoint:after_vacuum", 5),
]
KILL_OVERRIDES = ["iterations=5", "train.checkpoint_every=3"]


def child_main(argv: list[str]) -> None:
    """The child: run the lineage; SIGKILL itself at the spec's point and iteration, if any."""
    spec = json.loads(argv[0])
    from replayrl.config import load_config
    from replayrl.engine.inline import run_inline

    cfg = load_config(PRESET, overrides=spec["overrides"])
    if spec.get("point"):
        arm(setattr, spec["point"], spec["iteration"], lambda: os.kill(os.getpid(), signal.SIGKILL))
    print("READY", flush=True)
    run_inline(cfg)
    print("DONE", flush=True)


def run_child(spec: dict, folder: Path) -> int:
    """Run one child to its end or its death; returns its exit code (-9 when killed)."""
    child = children.start(__file__, [json.dumps(spec)], folder)
    child.wait_for_line("READY")
    return child.wait(timeout=600)


def kill_trials(overrides: list[str], trials, folder: Path) -> list[tuple[str, int, int]]:
    """Each trial in a fresh child on the same lineage; (point, iteration, exit code)."""
    return [
        (
            point,
            iteration,
            run_child({"overrides": overrides, "point": point, "iteration": iteration}, folder),
        )
        for point, iteration in trials
    ]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_kill_trials_local_and_s3_resume_to_the_uninterrupted_end_state(tmp_path, s3_root):
    """SIGKILL at 23 distinct points of a 5-iteration task with checkpoint_every=3, on a
    local run root and on S3 (the two sequences run side by side); each resumed lineage
    ends exactly like an uninterrupted one."""
    from concurrent.futures import ThreadPoolExecutor

    from replayrl.engine.inline import run_inline

    roots = {"local": str(tmp_path / "killed"), "s3": f"{s3_root}/killed"}
    skip = {
        "local": "train:checkpoint_files_written",
        "s3": "train:checkpoint_files_written_in_place",
    }
    trials = {name: [t for t in KILL_TRIALS if t[0] != skip[name]] for name in roots}
    ref = crash_config(tmp_path, str(tmp_path / "ref"), *KILL_OVERRIDES)
    with children.same_threads():  # the children's thread count: compared exactly
        run_inline(ref)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {
                name: pool.submit(
                    kill_trials,
                    crash_overrides(tmp_path, root, *KILL_OVERRIDES),
                    trials[name],
                    tmp_path / f"children-{name}",
                )
                for name, root in roots.items()
            }
            results = {name: f.result() for name, f in futures.items()}
    finally:
        children.kill_all()
    want = end_state(ref)
    for name, root in roots.items():
        killed = [(p, i) for p, i, code in results[name] if code == -signal.SIGKILL]
        assert killed == trials[name], f"{name}: points not reached: {results[name]}"
        assert len(set(killed)) >= 20 and len(killed) == 24
        cfg = crash_config(tmp_path, root, *KILL_OVERRIDES)
        with children.same_threads():
            run_inline(cfg)
        assert_same_end_state(end_state(cfg), want)


if __name__ == "__main__":
    child_main(sys.argv[1:])
