"""Crash safety: a lineage stopped dead at any point and resumed ends exactly where an
uninterrupted run with the same seed ends: the same rollout ids and rows, no duplicates,
the same usage log, the same checkpoint versions and weights, each metric once per step.

Two kinds of stop, both at named points inside generate, compact, train, evaluate and the
commit (`POINTS`), the k-th time the point is reached:

- in-process: the point raises `Crash` (a BaseException nothing in the library catches),
  and the same process resumes with a fresh engine; cheap, so every point is hit;
- SIGKILL: a child process (a fresh interpreter, never a fork) runs the loop and kills
  itself at the point, or the parent kills it at a seeded random time; the next child
  resumes. This file is also that child's script (`python test_crash_safety.py ...`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

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

    from replayrl import lineage, steps, storage
    from replayrl.buffer import ReplayBuffer

    return {
        "generate:before_append": (ReplayBuffer, "append", "before"),
        "generate:after_append": (ReplayBuffer, "append", "after"),
        "compact:after_retention_delete": (DeltaTable, "delete", "after"),
        "compact:after_bin_pack": (TableOptimizer, "compact", "after"),
        "compact:after_vacuum": (DeltaTable, "vacuum", "after"),
        "train:after_sample": (ReplayBuffer, "sample", "after"),
        "train:between_gradient_steps": (steps, "gradient_step", "after"),
        "train:checkpoint_files_written": (storage, "upload_dir", "after"),
        "train:checkpoint_files_written_in_place": (steps, "save_policy", "after"),
        "train:checkpoint_marked": (storage, "mark_complete", "after"),
        "train:after_prune": (storage, "prune_checkpoints", "after"),
        "train:after_usage_log": (ReplayBuffer, "log_usage", "after"),
        "evaluate:after": (steps, "evaluate", "after"),
        "record:before_commit": (storage, "advance_state", "before"),
        "record:after_commit": (storage, "advance_state", "after"),
        "record:after_metrics": (lineage, "_log_groups", "after"),
    }


class Crash(BaseException):
    """Raised at a stop point; BaseException so no `except Exception` in the library eats it."""


def arm(patch, name: str, iteration: int, stop) -> None:
    """Patch point `name` to call `stop()` the first time it is reached while the loop is
    in `iteration` (the iteration of the latest `steps.generate` call). `patch(owner, attr,
    value)` installs a patch (monkeypatch.setattr, or setattr in a child)."""
    from replayrl import steps

    owner, attr, when = points()[name]
    original = getattr(owner, attr)
    generate = steps.generate
    now = {"iteration": None, "fired": False}

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
# lineage has 4 iterations; retention deletes from iteration 3 on, evaluation runs at 2 and
# 4, bin-packing once there are 2 files. Each stop is resumed by the next trial.
IN_PROCESS_TRIALS = [
    ("generate:before_append", 1),
    ("generate:after_append", 1),
    ("compact:after_bin_pack", 2),
    ("compact:after_vacuum", 2),
    ("train:after_sample", 2),
    ("train:between_gradient_steps", 2),
    ("train:checkpoint_files_written", 2),
    ("train:checkpoint_files_written_in_place", 2),
    ("train:checkpoint_marked", 2),
    ("train:after_prune", 2),
    ("train:after_usage_log", 2),
    ("evaluate:after", 2),
    ("record:before_commit", 2),
    ("record:after_commit", 2),
    ("compact:after_retention_delete", 3),
    ("record:after_metrics", 3),
    ("generate:after_append", 4),
    ("evaluate:after", 4),
    ("record:after_commit", 4),
]


def run_with_stops(cfg, trials, monkeypatch) -> list[str]:
    """Run the lineage, stopping at each trial's point in turn; then to the end. Returns
    the points that really stopped it (a trial whose point is never reached runs the
    lineage to its end, and the trials after it stop nothing)."""
    from replayrl.loop import run_inline

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


@pytest.mark.integration
@pytest.mark.slow
def test_stops_at_every_point_resume_to_the_uninterrupted_end_state_local(tmp_path, monkeypatch):
    from replayrl.loop import run_inline

    ref = crash_config(tmp_path, str(tmp_path / "ref"))
    run_inline(ref)
    cfg = crash_config(tmp_path, str(tmp_path / "crashed"))
    # locally checkpoints are written in place: there is no upload to stop in
    trials = [t for t in IN_PROCESS_TRIALS if t[0] != "train:checkpoint_files_written"]
    stopped = run_with_stops(cfg, trials, monkeypatch)
    assert stopped == [n for n, _ in trials]
    assert_same_end_state(end_state(cfg), end_state(ref))


@pytest.mark.integration
@pytest.mark.slow
def test_stops_at_every_point_resume_to_the_uninterrupted_end_state_s3(
    tmp_path, s3_root, monkeypatch
):
    from replayrl.loop import run_inline

    ref = crash_config(tmp_path, f"{s3_root}/ref")
    run_inline(ref)
    cfg = crash_config(tmp_path, f"{s3_root}/crashed")
    trials = [t for t in IN_PROCESS_TRIALS if t[0] != "train:checkpoint_files_written_in_place"]
    stopped = run_with_stops(cfg, trials, monkeypatch)
    assert stopped == [n for n, _ in trials]
    assert_same_end_state(end_state(cfg), end_state(ref))


# ---------------------------------------------------------------- SIGKILL


def child_main(argv: list[str]) -> None:
    """The child: run the lineage; SIGKILL itself at the spec's point and iteration, if any."""
    spec = json.loads(argv[0])
    from replayrl.config import load_config
    from replayrl.loop import run_inline

    cfg = load_config(PRESET, overrides=spec["overrides"])
    if spec.get("point"):
        arm(setattr, spec["point"], spec["iteration"], lambda: os.kill(os.getpid(), signal.SIGKILL))
    print("READY", flush=True)
    run_inline(cfg)
    print("DONE", flush=True)


def run_child(spec: dict, *, kill_after_s: float | None = None) -> int:
    """Run one child to its end or its death; returns its exit code (-9 when killed)."""
    proc = subprocess.Popen(
        [sys.executable, __file__, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout.readline().strip() == "READY"
    if kill_after_s is not None:
        try:
            proc.wait(timeout=kill_after_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)  # our own child, by its pid
    return proc.wait(timeout=600)


@pytest.mark.integration
@pytest.mark.slow
def test_sigkill_at_points_and_random_times_then_resume_s3(tmp_path, s3_root):
    """Two lineages: one SIGKILLed at named points (a checkpoint upload cut short, the
    commit done but its metrics not logged), one at seeded random times; each resumed to
    the end state of an uninterrupted run."""
    from replayrl.loop import run_inline

    ref = crash_config(tmp_path, f"{s3_root}/ref")
    run_inline(ref)  # also warms the shared model cache for the children
    start = time.perf_counter()
    run_inline(crash_config(tmp_path, f"{s3_root}/timing"))
    lineage_s = time.perf_counter() - start

    named = [("train:checkpoint_files_written", 2), ("record:after_commit", 3)]
    overrides = crash_overrides(tmp_path, f"{s3_root}/named")
    codes = [
        run_child({"overrides": overrides, "point": point, "iteration": iteration})
        for point, iteration in named
    ]
    assert codes == [-signal.SIGKILL] * len(named)

    # a resumed child redoes its interrupted iteration, so later kills land later on
    rng = random.Random(1234)
    overrides = crash_overrides(tmp_path, f"{s3_root}/random")
    for fraction in (0.2, 0.5):
        code = run_child(
            {"overrides": overrides}, kill_after_s=rng.uniform(0.8, 1.2) * fraction * lineage_s
        )
        codes.append(code)
    killed = sum(c == -signal.SIGKILL for c in codes)
    assert killed >= len(named) + 1, codes

    want = end_state(ref)
    for name in ("named", "random"):
        cfg = crash_config(tmp_path, f"{s3_root}/{name}")
        run_inline(cfg)
        assert_same_end_state(end_state(cfg), want)
    print(f"SIGKILL trials: {len(codes)} children, {killed} killed")


if __name__ == "__main__":
    child_main(sys.argv[1:])
