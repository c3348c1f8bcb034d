"""`replayrl experiment` end to end on a tiny configuration: both arms for two seeds into one
MLflow experiment, the comparison files and run, and a re-run that skips finished lineages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from replayrl.cli.main import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


def tiny(tmp_path: Path) -> list[str]:
    overrides = [
        f"model.cache_dir={tmp_path.parent / 'shared-cache'}",
        "iterations=2",
        "task.num_train=200",
        "task.num_eval=16",
        "eval.num_prompts=16",
        "eval.every=1",
        "model.warm_start_max_steps=0",  # no signal needed: this tests the plumbing
        "rollout.prompts_per_iteration=2",
        "buffer.capacity=32",
        "train.batch_size=16",
        "train.steps_per_iteration=2",
    ]
    return [arg for o in overrides for arg in ("--set", o)]


def test_experiment_runs_both_arms_per_seed_then_compares_and_resumes(tmp_path, capsys):
    out = tmp_path / "exp"
    argv = [
        "experiment",
        "--config",
        str(PRESET),
        "--seeds",
        "2",
        "--out",
        str(out),
        *tiny(tmp_path),
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "| replay | 2 |" in captured.out and "| on-policy | 2 |" in captured.out
    assert "interleaved seed by seed" in captured.out
    assert "[4/4] chain_sum-replay-s1" in captured.err

    result = json.loads((out / "comparison.json").read_text())
    assert result["experiment"] == "tiny-cpu"  # the config file's name
    assert set(result["arms"]) == {"on-policy", "replay"}
    for arm in result["arms"].values():
        assert arm["seeds"] == [0, 1] and arm["final_iteration"] == 2
        assert arm["final_compute"]["seconds"] > 0 and arm["measured_mu"] > 0
    # Same S·B rows trained per iteration; replay generates half the fresh rollouts (y = 2).
    rep, on = (result["arms"][a]["final_compute"] for a in ("replay", "on-policy"))
    assert rep["cost_units"] < on["cost_units"]
    assert (out / "comparison.png").stat().st_size > 10_000

    client = MlflowClient(f"sqlite:///{out / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny-cpu")
    runs = client.search_runs([exp.experiment_id])
    lineages = sorted(r.data.tags["lineage"] for r in runs if "lineage" in r.data.tags)
    assert lineages == [f"chain_sum-{a}-s{s}" for a in ("on-policy", "replay") for s in (0, 1)]
    assert [r.data.tags.get("kind") for r in runs].count("comparison") == 1

    assert result["accuracy_reported"] == "final" and result["metric"]["name"] == "pass1"

    # Re-running skips the finished lineages and compares again, here on the peaks.
    assert main([*argv, "--peak"]) == 0
    err = capsys.readouterr().err
    assert err.count("finished earlier, skipped") == 4
    assert json.loads((out / "comparison.json").read_text())["accuracy_reported"] == "peak"
