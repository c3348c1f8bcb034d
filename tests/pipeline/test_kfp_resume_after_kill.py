"""A run whose task pod dies mid-task (node loss, eviction: here the task's process under
kfp.local is SIGKILLed, with no retry left) is resumed by the next recurring run with nothing
lost or doubled.

Three runs of `replay_iteration` (what a recurring run starts, one iteration each) drive one
lineage: the first commits iteration 1; the second is killed after iteration 2's rows are in
the buffer but before the iteration is committed, and its exit task still frees the lineage;
the third rewinds to the last full checkpoint (the buffer by Delta time travel) and redoes
iteration 2. The lineage then equals an uninterrupted inline run of the same config: the
same rows, usage log, checkpoint bytes and metrics, each iteration committed once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from kfp_helpers import small
from test_kfp_local import TIMING, histories

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.engine.inline import run_inline
from replayrl.storage import lease

pytestmark = [pytest.mark.pipeline, pytest.mark.slow]

PODS = ("kubernetes.iterations_per_task=1", "kubernetes.retries=0")
# One run of the recurring `replay_iteration` pipeline under kfp.local.
RUN = """
import sys
from replayrl.config import load_config
from replayrl.kfp.local import run_kfp_local
run_kfp_local(load_config(text=open(sys.argv[1]).read()), pipeline="iteration", quiet=True)
"""


def _start(config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RUN, str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _commits(buffer_uri: str) -> int:
    log = Path(buffer_uri) / "rollouts" / "_delta_log"
    return len(list(log.glob("*.json"))) if log.is_dir() else 0


def _tasks(run: subprocess.Popen) -> list[psutil.Process]:
    """The kfp.local task processes (Python under `sh -c`) of `run`."""
    found = []
    for p in psutil.Process(run.pid).children(recursive=True):
        try:
            if "executor_main" in " ".join(p.cmdline()) and "python" in p.name():
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def test_the_next_run_resumes_a_lineage_whose_task_was_killed(tmp_path):
    # One iteration per run, as a recurring run; each run stops at its failure: a killed task
    # is not retried here (kubernetes.retries 0), so the next run is what resumes the lineage.
    cfg = small(tmp_path, *PODS, root="kfp")
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    config = tmp_path / "config.yaml"
    config.write_text(cfg.to_yaml())

    first = _start(config)
    out, _ = first.communicate(timeout=900)
    assert first.returncode == 0, out[-3000:]
    assert storage.read_state(paths).next_iteration == 2
    committed = _commits(paths.buffer)

    # The second run: SIGKILL its task once iteration 2's rows are in the buffer.
    second = _start(config)
    try:
        deadline = time.monotonic() + 600
        while _commits(paths.buffer) == committed:
            assert second.poll() is None, "the run ended before iteration 2 appended rows"
            assert time.monotonic() < deadline, "iteration 2 appended no rows"
            time.sleep(0.02)
        killed = _tasks(second)
        assert killed, "no task process to kill"
        for p in killed:
            os.kill(p.pid, signal.SIGKILL)
        out, _ = second.communicate(timeout=600)
    finally:
        if second.poll() is None:
            second.kill()
    assert second.returncode != 0, "the run whose task died must fail"
    state = storage.read_state(paths)
    assert (state.next_iteration, state.policy_version) == (2, 1), "killed before its commit"
    rows = ReplayBuffer(paths.buffer).read(columns=["iteration"]).column("iteration")
    assert 2 in rows.to_pylist(), "iteration 2's uncommitted rows were in the buffer"
    assert lease.read(paths) is None, "the exit task freed the lineage for the next run"

    third = _start(config)
    out, _ = third.communicate(timeout=900)
    assert third.returncode == 0, out[-3000:]

    # The uninterrupted reference: the same config in one inline run.
    ref = small(tmp_path, *PODS, root="inline")
    run_inline(ref)
    a = storage.lineage_paths(ref.storage.run_root, ref.lineage)

    sa, sb = storage.read_state(a), storage.read_state(paths)
    assert (sb.next_iteration, sb.policy_version) == (sa.next_iteration, sa.policy_version)
    assert (sb.next_iteration, sb.policy_version) == (3, 2)

    columns = ["rollout_id", "iteration", "completion", "reward", "advantage", "behavior_logprobs"]
    rows_a = ReplayBuffer(a.buffer).read().select(columns).sort_by("rollout_id")
    rows_b = ReplayBuffer(paths.buffer).read().select(columns).sort_by("rollout_id")
    ids = rows_b.column("rollout_id").to_pylist()
    assert len(ids) == len(set(ids)), "no rollout stored twice"
    assert rows_b.equals(rows_a)

    # Each gradient step's uses logged once, as in the uninterrupted run.
    use = ["iteration", "train_step", "rollout_id"]
    keys = [(k, "ascending") for k in use]
    usage_a = ReplayBuffer(a.buffer).read_usage().select(use).sort_by(keys)
    usage_b = ReplayBuffer(paths.buffer).read_usage().select(use).sort_by(keys)
    assert usage_b.num_rows > 0 and usage_b.equals(usage_a)

    weights = Path(storage.checkpoint_files_uri(a.checkpoint(2))) / "model.safetensors"
    theirs = Path(storage.checkpoint_files_uri(paths.checkpoint(2))) / "model.safetensors"
    assert weights.read_bytes() == theirs.read_bytes()

    # Every metric at every step once, with the uninterrupted run's values; the Delta table's
    # version number aside (the rewind's restore is a commit of its own).
    ha, hb = histories(ref), histories(cfg)
    compared = [k for k in ha if not any(t in k for t in (*TIMING, "buffer/version"))]
    assert "eval/pass1" in compared and "train/loss" in compared
    for key in compared:
        assert hb[key] == ha[key], key
