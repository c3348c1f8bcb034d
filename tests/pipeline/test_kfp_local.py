"""`replayrl run --engine kfp-local`: the replay_loop pipeline under kfp.local (one
subprocess per task, or per step) gives the same rows, checkpoint and metrics as the inline
engine for the same config and seed (timing metrics aside), and leaves the KFP UI
artifacts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kfp_helpers import PRESET, small, small_overrides
from mlflow.tracking import MlflowClient

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.engine.inline import run_inline
from replayrl.errors import ReplayRLError
from replayrl.kfp.local import run_kfp_local
from replayrl.storage import lease

pytestmark = [pytest.mark.pipeline, pytest.mark.slow]
# Attempt-dependent: timing, and where the engine wrote full checkpoints.
TIMING = ("seconds", "mu", "per_rollout", "cumulative/flops", "coverage", "checkpoint_written")


def histories(cfg) -> dict[str, list[tuple[int, float]]]:
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    state = storage.read_state(paths)
    client = MlflowClient(state.tracking_uri)
    run = client.get_run(state.mlflow_run_id)
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
    }


@pytest.fixture(scope="module")
def inline_run(tmp_path_factory):
    """The inline engine's lineage both layouts are compared with, and its wall time."""
    tmp_path = tmp_path_factory.mktemp("inline")
    inline = small(tmp_path, root="inline")
    start = time.perf_counter()
    run_inline(inline)
    return inline, time.perf_counter() - start


@pytest.mark.parametrize("layout", ["task", "step"])
def test_kfp_local_gives_the_same_rows_checkpoint_and_metrics_as_inline(
    tmp_path, layout, inline_run
):
    inline, inline_s = inline_run

    # "task": two tasks of one iteration each, so the second starts from the first's
    # checkpoint in a fresh process.
    pods = [f"kubernetes.layout={layout}", "kubernetes.iterations_per_task=1"]
    kfp = small(tmp_path, *pods, root="kfp")
    sets = [arg for o in small_overrides(tmp_path, *pods, root="kfp") for arg in ("--set", o)]
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "replayrl.cli.main", "run", "--config", str(PRESET)]
        + ["--engine", "kfp-local", *sets],
        capture_output=True,
        text=True,
        timeout=900,
    )
    kfp_s = time.perf_counter() - start
    print(f"wall time, 2 iterations: inline {inline_s:.1f} s, kfp-local {kfp_s:.1f} s")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "pass@1" in proc.stdout  # the same summary table as the inline engine

    a = storage.lineage_paths(inline.storage.run_root, inline.lineage)
    b = storage.lineage_paths(kfp.storage.run_root, kfp.lineage)
    sa, sb = storage.read_state(a), storage.read_state(b)
    assert (
        (sb.next_iteration, sb.policy_version) == (sa.next_iteration, sa.policy_version) == (3, 2)
    )

    ha, hb = histories(inline), histories(kfp)
    compared = [k for k in ha if not any(t in k for t in TIMING)]
    assert "eval/pass1" in compared and "train/loss" in compared and "buffer/rows" in compared
    for key in compared:
        assert hb[key] == ha[key], key
    s = kfp.train.steps_per_iteration  # MLflow steps are gradient steps: iteration t at t·S
    assert hb["iteration"] == [(0, 0), (s, 1), (2 * s, 2)]

    columns = ["rollout_id", "completion", "reward", "advantage", "behavior_logprobs"]
    rows_a = ReplayBuffer(a.buffer).read().select(columns).sort_by("rollout_id")
    rows_b = ReplayBuffer(b.buffer).read().select(columns).sort_by("rollout_id")
    assert rows_a.num_rows >= inline.rollouts_per_iteration and rows_b.equals(rows_a)

    weights = Path(storage.checkpoint_files_uri(a.checkpoint(2))) / "model.safetensors"
    theirs = Path(storage.checkpoint_files_uri(b.checkpoint(2))) / "model.safetensors"
    assert weights.read_bytes() == theirs.read_bytes()

    # What the KFP UI shows: a Markdown report per task (or iteration), and with one pod per
    # step the Metrics artifacts of the steps.
    outputs = Path(kfp.storage.run_root).resolve() / ".kfp-local" / kfp.lineage

    def logged_metrics(task: str) -> list[dict]:
        found = [
            json.loads(p.read_text())
            for p in outputs.rglob("*/executor_output.json")
            if re.fullmatch(rf"{task}(-\d+)*", p.parent.name)
        ]
        return [a["metadata"] for e in found for a in e["artifacts"]["metrics"]["artifacts"]]

    # v0's evaluation is a task of its own (a GPU pod on a cluster; opening runs on CPU).
    (initial,) = logged_metrics("evaluate-initial")
    assert [(0, initial["pass1"])] == [(s, v) for s, v in ha["eval/pass1"] if s == 0]
    if layout == "step":
        logged = logged_metrics("evaluate")
        assert sorted(m["pass1"] for m in logged) == sorted(v for s, v in ha["eval/pass1"] if s > 0)
    reporter = "record-iteration" if layout == "step" else "run-iterations"
    reports = sorted(p.read_text() for p in outputs.rglob(f"{reporter}*/report"))
    assert len(reports) == 2 and all(kfp.lineage in r for r in reports)
    from replayrl.storage import lease

    assert lease.read(b) is None, "the run's last step releases the lease"


def test_the_exit_task_frees_the_lineage_after_a_failed_task(tmp_path):
    """A task that fails (here: a bfloat16 config on a machine without CUDA, refused when
    the trainer starts) leaves the lineage opened but free at once: the pipeline's exit task
    released the run's lease, so the next run need not wait for it to expire. The failing
    task is retried as on a cluster (kubernetes.retries), 1 s apart instead of a minute."""
    cfg = small(tmp_path, "train.dtype=bfloat16", "kubernetes.retry_backoff_s=1", root="failing")
    with pytest.raises(ReplayRLError) as e:
        run_kfp_local(cfg, quiet=True)
    assert "train.dtype=bfloat16 needs a CUDA GPU" in str(e.value)
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    state = storage.read_state(paths)
    assert (state.next_iteration, state.policy_version) == (1, 0)  # opened, nothing committed
    outputs = Path(cfg.storage.run_root).resolve() / ".kfp-local" / cfg.lineage
    assert list(outputs.rglob("evaluate-initial*")), "v0 was evaluated by its own task"
    assert list(outputs.rglob("release-lineage*")), "the exit task ran"
    assert lease.read(paths) is None
    assert lease.hold(paths, owner="the-next-run", ttl_s=60).owner == "the-next-run"


def test_a_killed_kfp_local_run_leaves_no_task_running(tmp_path):
    """SIGKILL of `replayrl run --engine kfp-local` while a task runs: the task (a Python
    process under kfp.local's `sh -c`, not a child of the run) exits within 15 s."""
    import signal

    import psutil

    sets = [arg for o in small_overrides(tmp_path, root="orphan") for arg in ("--set", o)]
    run = subprocess.Popen(
        [sys.executable, "-m", "replayrl.cli.main", "run", "--config", str(PRESET)]
        + ["--engine", "kfp-local", *sets],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        tasks: list[psutil.Process] = []
        while not tasks:
            assert run.poll() is None, "the run ended before a task started"
            assert time.monotonic() < deadline, "no kfp.local task started"
            tasks = [
                p
                for p in psutil.Process(run.pid).children(recursive=True)
                if "executor_main" in " ".join(p.cmdline())
            ]
            time.sleep(0.2)
        everything = psutil.Process(run.pid).children(recursive=True)
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
        gone, alive = psutil.wait_procs(everything, timeout=15)
        left = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"still running 15 s after the run died: {[p.name() for p in left]}"
    finally:
        if run.poll() is None:
            run.kill()
