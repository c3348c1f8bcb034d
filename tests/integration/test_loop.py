"""The inline engine end to end on a tiny, fast configuration: rows, checkpoints, state,
MLflow metrics, resume, determinism, and the CLI's one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_config
import torch
from metric_schema_check import assert_logs_the_declared_metrics
from mlflow.tracking import MlflowClient

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.core.ledger import WALL_PARTS
from replayrl.engine.inline import run_inline
from replayrl.engine.metric_schema import INLINE
from replayrl.engine.tracking import this_accelerator

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
EMPTY = Path(__file__).parents[1] / "data" / "empty.jsonl"


def small(tmp_path: Path, *extra: str, arm: str | None = None, root: str = "runs"):
    """The suite's tiny config (`tiny_config`): 3 iterations, a plain FIFO buffer."""
    return tiny_config.config(
        tmp_path / root,
        "iterations=3",
        "buffer.positive_bias=0.0",  # plain FIFO, so row counts are exact
        *extra,
        arm=arm,
    )


def metric_history(cfg, run_id: str) -> dict[str, list[tuple[int, float]]]:
    uri = f"sqlite:///{storage.normalize_root(cfg.storage.run_root)}/mlflow.db"
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    out = {}
    for key in run.data.metrics:
        out[key] = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
    return out


def assert_ages_in_gradient_steps(usage, hist, *, steps_per_iteration: int) -> None:
    """The logged sample ages and steps since last use are the paper's, in gradient steps,
    recomputed here from the usage log: the k-th step of the iteration training v is
    v·S + k, a row of policy v was created at step v·S."""
    s = steps_per_iteration
    uses = sorted(
        (u["policy_version_at_use"] * s + u["train_step"], u["rollout_id"], u)
        for u in usage.to_pylist()
    )
    last: dict[str, int] = {}
    ages: dict[int, list[int]] = {}
    gaps: dict[int, list[int]] = {}
    for step in sorted({g for g, _, _ in uses}):
        now = [(rid, u) for g, rid, u in uses if g == step]
        for rid, u in now:
            ages.setdefault(u["iteration"], []).append(step - u["rollout_policy_version"] * s)
            gaps.setdefault(u["iteration"], []).append(step - last[rid] if rid in last else -1)
        last.update({rid: step for rid, _ in now})
    logged = {k: dict(hist[k]) for k in hist if k.startswith("replay/")}
    for t in sorted(ages):
        at = t * s  # MLflow's step: the gradient step iteration t ends on
        assert logged["replay/sample_age_max"][at] == max(ages[t])
        assert logged["replay/sample_age_mean"][at] == pytest.approx(sum(ages[t]) / len(ages[t]))
        seen = [g for g in gaps[t] if g >= 0]
        assert logged["replay/frac_first_use"][at] == pytest.approx(1 - len(seen) / len(gaps[t]))
        if seen:
            mean = sum(seen) / len(seen)
            assert logged["replay/steps_since_last_use_mean"][at] == pytest.approx(mean)
    # Iteration 1 only has fresh rows: ages 0 .. S - 1. Later, rows of the previous iteration
    # are S steps older than they would be counted in policy versions.
    assert max(ages[1]) <= s - 1 and max(ages[3]) >= s
    assert (
        "replay/steps_since_last_use_mean" in logged and len(logged["replay/sample_age_p50"]) == 3
    )


def test_replay_loop_writes_rows_checkpoints_state_and_metrics(tmp_path):
    cfg = small(tmp_path)
    summary = run_inline(cfg)
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    state = storage.read_state(paths)
    assert state.next_iteration == 4 and state.policy_version == 3
    assert storage.complete_versions(paths)[-1] == 3
    buf = ReplayBuffer(paths.buffer)
    rows = buf.read()
    # R = 32 per iteration, capacity 64: the two newest iterations remain.
    assert rows.num_rows == 64
    assert sorted(set(rows.column("iteration").to_pylist())) == [2, 3]
    assert rows.num_rows == len(set(rows.column("rollout_id").to_pylist()))
    usage = buf.read_usage()
    assert usage.num_rows == 3 * 64  # S·B uses per iteration
    hist = metric_history(cfg, summary.mlflow_run_id)
    # MLflow steps are gradient steps (S = 4); the iteration is a metric beside them.
    assert hist["iteration"] == [(0, 0), (4, 1), (8, 2), (12, 3)]
    assert [s for s, _ in hist["train/loss"]] == [4, 8, 12]
    assert [s for s, _ in hist["eval/pass1"]] == [0, 4, 8, 12]
    assert_logs_the_declared_metrics(summary.tracking_uri, summary.mlflow_run_id, INLINE)
    tokens = [v for _, v in hist["cumulative/generated_tokens"]]
    assert tokens == sorted(tokens) and tokens[0] > 0
    assert all(v == 2.0 for _, v in hist["replay/ratio"])  # S·B / R = 4·16 / 32
    # eval against inference compute: steps are cumulative generated tokens / 1000
    assert len(hist["eval_by_ktokens/pass1"]) >= 2
    # The headline charts, in the section MLflow's chart view lists first: copies of both.
    assert hist["accuracy/pass1"] == hist["eval/pass1"]
    assert hist["accuracy/pass1_by_ktokens"] == hist["eval_by_ktokens/pass1"]
    assert sorted(k.split("/")[0] for k in hist if "/" in k)[0] == "accuracy"
    assert hist["ledger/mu"][0][1] > 0
    # Every part is read on the CPU clock too; the parts fit inside the iteration's total.
    cpu_axis = [v for _, v in hist["cumulative/cpu_seconds"]]
    assert cpu_axis == sorted(cpu_axis) and cpu_axis[0] > 0
    assert all(v > 0 for _, v in hist["ledger/training_cpu_seconds"])
    for step, total in hist["ledger/total_cpu_seconds"]:
        parts = sum(dict(hist[f"ledger/{p}_cpu_seconds"])[step] for p in WALL_PARTS)
        assert 0 < parts <= total + 1e-6
    assert summary.rows[-1].cumulative_cpu_seconds == cpu_axis[-1]
    if not torch.cuda.is_available():
        # No device clock on the CPU: its metrics are absent, not 0.
        assert not [k for k in hist if "device" in k]
    assert_ages_in_gradient_steps(usage, hist, steps_per_iteration=4)
    assert all(v == 0 for _, v in hist["buffer/bias_rows"]) and "buffer/bias_age_max" not in hist
    client = MlflowClient(summary.tracking_uri)
    run = client.get_run(summary.mlflow_run_id)
    assert run.data.params["buffer.capacity"] == "64"
    assert run.data.tags["arm"] == "replay" and run.data.tags["lineage"] == cfg.lineage
    assert run.data.tags["config_hash"] == cfg.config_hash()
    # What generated the rollouts, for `replayrl compare` to refuse mixing models.
    model, count = this_accelerator()
    assert run.data.tags["system.accelerator"] == model and model.startswith(("cpu: ", "NVIDIA"))
    assert run.data.tags["system.accelerator_count"] == str(count)


def test_on_policy_uses_each_row_exactly_once(tmp_path):
    cfg = small(tmp_path, arm="on-policy")
    assert cfg.rollouts_per_iteration == cfg.buffer.capacity == 64
    run_inline(cfg)
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    buf = ReplayBuffer(paths.buffer)
    usage = buf.read_usage()
    for t in (1, 2, 3):
        ids = [
            r
            for r, it in zip(
                usage.column("rollout_id").to_pylist(),
                usage.column("iteration").to_pylist(),
                strict=True,
            )
            if it == t
        ]
        assert len(ids) == 64 == len(set(ids))


def test_resume_equals_uninterrupted_and_same_seed_is_deterministic(tmp_path):
    a = small(tmp_path, root="a")
    run_inline(a)
    b1 = small(tmp_path, "iterations=1", root="b")
    run_inline(b1)  # stop after one iteration, then resume to three
    b = small(tmp_path, root="b")
    sb = run_inline(b)
    assert sb.resumed_from == 2
    ha = metric_history(
        a, storage.read_state(storage.lineage_paths(a.storage.run_root, a.lineage)).mlflow_run_id
    )
    hb = metric_history(b, sb.mlflow_run_id)
    # Attempt-dependent: timing, and where a task ended (a checkpoint is written there).
    timing = ("seconds", "mu", "per_rollout", "cumulative/flops", "coverage", "checkpoint_written")
    for key, values in ha.items():
        if any(t in key for t in timing):
            continue
        assert hb[key] == values, key
    pa_rows = ReplayBuffer(storage.lineage_paths(a.storage.run_root, a.lineage).buffer).read()
    pb_rows = ReplayBuffer(storage.lineage_paths(b.storage.run_root, b.lineage).buffer).read()
    key = ["rollout_id", "completion", "reward", "advantage"]
    assert (
        pa_rows.select(key).sort_by("rollout_id").equals(pb_rows.select(key).sort_by("rollout_id"))
    )


def test_interrupted_iteration_is_redone_without_duplicates(tmp_path):
    from replayrl.engine import steps
    from replayrl.engine.lineage import open_lineage

    cfg = small(tmp_path, "iterations=2")
    paths, state, _ = open_lineage(cfg)
    # A crash after generate(1) and compact(1), before the iteration was recorded.
    steps.generate(cfg, paths, iteration=1, policy_version=0)
    steps.compact(cfg, paths, iteration=1, current_policy_version=0)
    summary = run_inline(cfg)
    assert summary.resumed_from == 1
    rows = ReplayBuffer(paths.buffer).read()
    ids = rows.column("rollout_id").to_pylist()
    assert len(ids) == len(set(ids)) == 64


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "replayrl.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--set", "buffer.capacty=3"], "Did you mean 'capacity'"),
        (["--arm", "sideways"], "Unknown arm 'sideways'"),
        (["--set", "model.source=/nonexistent/model"], "not a Hugging Face checkpoint directory"),
        (["--run-root", "/proc/forbidden"], "cannot be written"),
        (
            [
                "--set",
                "task.name=gsm8k",
                "--set",
                "task.path=/nonexistent.jsonl",
                "--set",
                "task.options={}",
            ],
            "nonexistent",
        ),
        (
            ["--set", "task.name=gsm8k", "--set", f"task.path={EMPTY}", "--set", "task.options={}"],
            "empty",
        ),
    ],
)
def test_cli_user_errors_are_one_line_without_traceback(tmp_path, args, message):
    base = ["run", "--config", str(PRESET), "--iterations", "1"]
    if "--run-root" not in args:
        base += ["--run-root", str(tmp_path / "runs")]
    proc = run_cli(*base, *args, "--set", f"model.cache_dir={tmp_path / 'cache'}")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    # nothing half-written: no lineage folder was created
    leftovers = [p.name for p in (tmp_path / "runs").glob("*") if p.is_dir()]
    assert leftovers == [], leftovers


def test_malformed_yaml_cli(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {lr: [\n")
    proc = run_cli("run", "--config", str(bad))
    assert (
        proc.returncode == 2 and "Malformed YAML" in proc.stderr and "Traceback" not in proc.stderr
    )


def test_buffer_stats_cli(tmp_path):
    cfg = small(tmp_path, "iterations=1")
    run_inline(cfg)
    proc = run_cli("buffer", "stats", "--run-root", cfg.storage.run_root, "--lineage", cfg.lineage)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert stats["rows"] == 32
