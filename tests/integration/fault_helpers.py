"""Helpers of the fault tests (crashes, outages, concurrency, bad input): the fast config
they share, what a lineage ends with (state, rows, usage log, checkpoints, weights and
metrics, each logged once per step) to compare a disturbed run with an undisturbed one,
valid rollout rows to write straight into a buffer, and the CLI run as a user runs it
(`cli`) with what its outcome must look like (`ok`, `one_error_line`)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from replayrl.buffer.schema import ROLLOUT_SCHEMA, rollout_id

PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
# Metrics that measure this attempt (time, table layout), not the result.
ATTEMPT_METRICS = ("seconds", "mu", "per_rollout", "flops", "buffer/version", "buffer/files")
ATTEMPT_METRICS += ("buffer/bytes", "buffer/rows_deleted", "coverage", "checkpoint_written")
ATTEMPT_METRICS += ("system/",)  # the machine's CPU, memory and disk while this attempt ran


# The tiny loop (the suite's tiny config, `tiny_config`), with bin-packing and vacuum every
# iteration so stops land inside both.
CRASH_OVERRIDES = [
    "iterations=4",
    "eval.num_prompts=8",
    "eval.every=2",
    "rollout.prompts_per_iteration=4",
    "buffer.capacity=64",
    "buffer.positive_bias=0.0",  # plain FIFO: a predictable number of rows and files
    "buffer.compact_min_files=2",
    "buffer.vacuum_grace_s=0",
    "train.batch_size=16",
    "train.steps_per_iteration=3",
]


def crash_overrides(tmp_path: Path, run_root: str, *extra: str) -> list[str]:
    """Overrides for a lineage under `run_root`, tracked in a sqlite store of its own: MLflow
    finds a lineage's run by its name, so lineages compared with each other must not share
    a store. (Imported here, not at the top: a kill trial's child imports this module from
    tests/integration alone.)"""
    import tiny_config

    store = "".join(c if c.isalnum() else "_" for c in run_root)[-60:]
    return tiny_config.overrides(
        run_root,
        f"tracking.uri=sqlite:///{tmp_path}/mlflow-{store}.db",
        *CRASH_OVERRIDES,
        *extra,
    )


def crash_config(tmp_path: Path, run_root: str, *extra: str):
    from replayrl.config import load_config

    return load_config(PRESET, overrides=crash_overrides(tmp_path, run_root, *extra))


def end_state(cfg) -> dict:
    """Everything a resumed lineage must agree on with an uninterrupted one."""
    from mlflow.tracking import MlflowClient

    from replayrl import storage
    from replayrl.buffer.table import ReplayBuffer

    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    state = storage.read_state(paths)
    buf = ReplayBuffer(paths.buffer, storage_options=storage.delta_storage_options(paths.buffer))
    rows = buf.read(
        columns=["rollout_id", "iteration", "policy_version", "completion", "reward", "advantage"]
    )
    usage = buf.read_usage().select(["iteration", "train_step", "rollout_id"])
    versions = storage.complete_versions(paths)
    files = storage.checkpoint_files_uri(paths.checkpoint(versions[-1]))
    weights = storage.read_bytes(storage.join(files, "model.safetensors"))
    client = MlflowClient(state.tracking_uri)
    metrics = {}
    for key in client.get_run(state.mlflow_run_id).data.metrics:
        entries = client.get_metric_history(state.mlflow_run_id, key)
        steps_logged = [m.step for m in entries]
        # eval_by_ktokens/* and accuracy/pass1_by_ktokens steps are thousands of generated
        # tokens, which several iterations can share; the comparison with the reference
        # catches repeats there
        # System metrics are samples of each process's machine, not the lineage's results:
        # a stopped run continued after another took over samples on until it exits.
        repeats_allowed = key.startswith("system/")
        if not key.startswith("eval_by_ktokens/") and not key.endswith("_by_ktokens"):
            if not repeats_allowed:
                assert len(steps_logged) == len(set(steps_logged)), f"{key} twice: {steps_logged}"
        if not any(a in key for a in ATTEMPT_METRICS):
            metrics[key] = sorted((m.step, m.value) for m in entries)
    ids = rows.column("rollout_id").to_pylist()
    assert len(ids) == len(set(ids)), "duplicate rollout ids"
    return {
        "next_iteration": state.next_iteration,
        "policy_version": state.policy_version,
        "rows": rows.sort_by("rollout_id").to_pylist(),
        "usage": sorted(usage.to_pylist(), key=lambda r: (r["iteration"], r["train_step"])),
        "versions": versions,
        "weights": weights,
        "metrics": metrics,
        "buffer_files_damaged": buf.check(),
    }


def assert_same_end_state(got: dict, want: dict) -> None:
    assert got["buffer_files_damaged"] == []
    for key in ("next_iteration", "policy_version", "versions", "usage"):
        assert got[key] == want[key], key

    def same(name: str, a, b) -> bool:
        if a == b:
            return True
        # Token entropy is a float reduction over sampled completions whose order of
        # summation follows torch's thread pool: a resumed process has been seen to differ
        # from the reference in the 9th digit (5.5675745626 vs 5.5675745574). Every other
        # metric must match exactly.
        if name.endswith("/entropy") and a and b and len(a) == len(b):
            return all(
                sa == sb and math.isclose(va, vb, rel_tol=1e-6)
                for (sa, va), (sb, vb) in zip(a, b, strict=True)
            )
        return False

    differing = {
        name: (got["metrics"].get(name), want["metrics"].get(name))
        for name in sorted(set(got["metrics"]) | set(want["metrics"]))
        if not same(name, got["metrics"].get(name), want["metrics"].get(name))
    }
    assert not differing, f"metrics differ (got, want): {differing}"
    assert len(got["rows"]) == len(want["rows"]) and got["rows"] == want["rows"]
    assert got["weights"] == want["weights"], "final checkpoint weights differ"


def rows(iteration: int, n: int = 8, *, completion: str = " 42", tokens: int = 2) -> pa.Table:
    return pa.table(
        {
            "rollout_id": [
                rollout_id(lineage="bad", iteration=iteration, prompt_index=i, sample_index=0)
                for i in range(n)
            ],
            "lineage": ["bad"] * n,
            "iteration": [iteration] * n,
            "policy_version": [iteration] * n,
            "prompt_id": [f"p{i}" for i in range(n)],
            "group_id": [f"{iteration}/{i}" for i in range(n)],
            "prompt": ["40 + 2 ="] * n,
            "completion": [completion] * n,
            "prompt_token_ids": [[1, 2, 3]] * n,
            "completion_token_ids": [list(range(tokens))] * n,
            "behavior_logprobs": [[-0.5] * tokens] * n,
            "reward": [1.0] * n,
            "correct": [True] * n,
            "advantage": [0.5] * n,
            "finish_reason": ["stop"] * n,
            "created_at": [np.datetime64("2026-01-01T00:00:00", "us")] * n,
        }
    ).cast(ROLLOUT_SCHEMA)


def cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`replayrl ARGS` in a new process (`env`: its whole environment; default this one's)."""
    return subprocess.run(
        [sys.executable, "-m", "replayrl.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """A command that succeeded, with no traceback on its way."""
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


def one_error_line(result: subprocess.CompletedProcess, *needles: str) -> str:
    """The one `replayrl: error:` line of a command that failed with a ReplayRLError (exit
    2, no traceback), which contains every needle."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [x for x in result.stderr.splitlines() if x.startswith("replayrl: error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]
