"""`replayrl sweep`: the grid and its lineage names, x and y realised through the loop's keys,
the report's numbers on known curves, the Fig. 2 histograms from known usage rows, the
Kubeflow path (compiled once per distinct pod setting, parsed strictly, each run's config
loading back), and end to end on the tiny config: 2 points x 2 iterations run, resumed,
skipped when finished, and reported."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from replayrl import storage
from replayrl.buffer.schema import usage_rows
from replayrl.cli.main import main
from replayrl.errors import ReplayRLError
from replayrl.experiments.statistics import LineageCurve, compute_to_fraction_of_best
from replayrl.experiments.sweep import parse_axis, read_sweep_file, sweep_points
from replayrl.experiments.sweep_report import Measured, distributions, report
from replayrl.kfp.sweep import plan_kubeflow

sys.path.insert(0, str(Path(__file__).parents[1] / "pipeline"))
from test_kfp_compile import parse  # noqa: E402  (the strict parse of compiled pipelines)

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


def test_grid_names_points_and_realises_x_and_y(tmp_path):
    assert parse_axis("W:T=6:2,4:4").values == (("6", "2"), ("4", "4"))
    s = sweep_points(
        config_path=PRESET,
        grid=["x=4,8", "y=2,4"],
        seeds=2,
        out_dir=tmp_path,
        overrides=["train.steps_per_iteration=4", "train.batch_size=16"],
    )
    # Seeds last, so the seeds of a cell run one after the other.
    assert [p.lineage for p in s.points][:3] == [
        "chain_sum-replay-x4-y2-s0",
        "chain_sum-replay-x4-y2-s1",
        "chain_sum-replay-x4-y4-s0",
    ]
    assert len(s.points) == 8 and s.experiment == "tiny-cpu-sweep"
    for p in s.points:
        x, y = float(p.values["x"]), float(p.values["y"])
        assert p.config.staleness_horizon == x and p.config.replay_ratio == y
        assert p.config.storage.run_root == str(tmp_path.resolve() / "runs")
    assert s.points[0].cell == "x=4, y=2"
    with pytest.raises(ReplayRLError, match="nearest whole number gives y"):
        sweep_points(config_path=PRESET, grid=["y=3"], out_dir=tmp_path)
    with pytest.raises(ReplayRLError, match="twice"):
        sweep_points(config_path=PRESET, grid=["N=64", "buffer.capacity=128"], out_dir=tmp_path)
    xy = sweep_points(config_path=PRESET, grid=[], named="xy", out_dir=tmp_path)
    assert {(p.config.staleness_horizon, p.config.replay_ratio) for p in xy.points} == {
        (x, y) for x in (8, 16, 32, 64) for y in (1, 2, 4, 8)
    }
    with pytest.raises(ReplayRLError, match="asynchronous.enabled=true"):
        sweep_points(config_path=PRESET, grid=[], named="wt-n", out_dir=tmp_path)
    with pytest.raises(ReplayRLError, match="Unknown named grid"):
        sweep_points(config_path=PRESET, grid=[], named="nope", out_dir=tmp_path)
    assert main(["sweep", "run", "--config", str(PRESET), "--grid", "N", "--out", "x"]) == 2
    # A sweep file: the config relative to it, the grid as a mapping.
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump({"config": str(PRESET), "grid": {"N": [512, 1024]}, "seeds": 2}))
    spec = read_sweep_file(f)
    s = sweep_points(
        config_path=spec["config"], grid=spec["grid"], seeds=spec["seeds"], out_dir=tmp_path
    )
    assert [p.lineage for p in s.points][-1] == "chain_sum-replay-N1024-s1"
    f.write_text("grids: {}")
    with pytest.raises(ReplayRLError, match="unknown key"):
        read_sweep_file(f)


def test_compute_to_fraction_of_best_is_the_first_evaluation_at_98_percent():
    assert compute_to_fraction_of_best([0, 10, 20, 30], [0.2, 0.49, 0.5, 0.4]) == 10
    assert compute_to_fraction_of_best([0, 10, 20], [0.2, 0.3, 0.5], fraction=1.0) == 20
    assert compute_to_fraction_of_best([0, 10], [math.nan, math.nan]) is None


def test_histograms_of_staleness_replay_ratio_and_steps_since_last_use():
    # S = 2. Iteration 1 trains v0: rows a, b (of v0) in step 0, a in step 1. Iteration 2
    # trains v1: a and c (of v1) in step 2, c in step 3.
    use = [
        usage_rows(
            lineage="l",
            iteration=it,
            train_step=ks,
            rollout_id=ids,
            policy_version_at_use=it - 1,
            rollout_policy_version=versions,
        )
        for it, ks, ids, versions in (
            (1, [0, 0, 1], ["a", "b", "a"], [0, 0, 0]),
            (2, [0, 0, 1], ["a", "c", "c"], [0, 1, 1]),
        )
    ]
    import pyarrow as pa

    h = distributions(
        pa.concat_tables(use), steps_per_iteration=2, asynchronous=False, rollouts_generated=4
    )
    assert h["staleness"] == {"values": [0, 1, 2], "counts": [3, 2, 1]}
    # a: 3 steps, b: 1, c: 2, and one generated rollout never used.
    assert h["replay_ratio"] == {"values": [0, 1, 2, 3], "counts": [1, 1, 1, 1]}
    assert h["steps_since_last_use"] == {"values": [1], "counts": [3]}


def _curve(name: str, seed: int, pass1: list[float], generated: list[float]) -> LineageCurve:
    n = len(pass1)
    return LineageCurve(
        lineage=name,
        arm="replay",
        seed=seed,
        iterations=tuple(range(n)),
        pass1=tuple(pass1),
        pass_at_k=(math.nan,) * n,
        entropy=(math.nan,) * n,
        generated_tokens=tuple(10 * g for g in generated),
        seconds=tuple(float(i) for i in range(n)),
        rollouts_generated=tuple(generated),
        rollouts_trained=(0.0, 64.0, 128.0),
    )


def _point(cell: str, seed: int, y: float) -> dict:
    return {
        "lineage": f"{cell}-s{seed}",
        "cell": cell,
        "values": {"y": cell[2:], "seed": str(seed)},
        "seed": seed,
        "arm": "replay",
        "asynchronous": False,
        "iterations": 2,
        "x": 8.0,
        "y": y,
        "buffer_capacity": 64,
        "prompts_per_iteration": 4,
        "batch_size": 16,
        "steps_per_iteration": 4,
        "samples_per_prompt": 8,
    }


def test_report_cells_frontier_and_advisor_on_known_curves(tmp_path):
    from replayrl.experiments.sweep_report import markdown, plot_heatmaps, plot_pareto

    curves = {
        ("y=1", 0): [0.1, 0.3, 0.5],
        ("y=1", 1): [0.1, 0.4, 0.45],
        ("y=2", 0): [0.1, 0.6, 0.4],
        ("y=2", 1): [0.1, 0.44, 0.6],
    }
    measured = [
        Measured(
            _point(cell, seed, float(cell[2:])),
            _curve(f"{cell}-s{seed}", seed, p, [0, 64, 128] if cell == "y=1" else [0, 32, 64]),
            None,
            None,
        )
        for (cell, seed), p in curves.items()
    ]
    manifest = {
        "experiment": "e",
        "run_root": str(tmp_path),
        "axes": [{"name": "y", "keys": ["y"]}, {"name": "seed", "keys": ["seed"]}],
        "points": [m.point for m in measured],
    }
    r = report(measured, manifest=manifest, rho=0.5, alpha=0.25, mu=2.0)
    a, b = r["cells"]["y=1"], r["cells"]["y=2"]
    # cost units = 2·generated + trained: y=1 [0, 192, 384], y=2 [0, 128, 256].
    assert a["best_pass1"] == pytest.approx(0.475) and b["best_pass1"] == pytest.approx(0.6)
    assert a["to_fraction_of_best"]["cost_units"] == 384
    assert b["to_fraction_of_best"]["cost_units"] == pytest.approx(192)  # median of 128, 256
    assert r["best_accuracy_cell"] == "y=2" and r["most_efficient_cell"] == "y=2"
    assert a["to_common_target"] is None  # never reaches 0.98 × 0.6
    assert [(p["cost_units"], p["pass1"]) for p in r["pareto"]["frontier"]["all"]] == [
        (0, 0.1),
        (128, pytest.approx(0.52)),
    ]
    assert r["advisor"]["mu"] == 2.0 and r["advisor"]["nearest_cell"] in r["cells"]
    assert "Nearest grid cell" in markdown(r)
    # Paired by seed: best pass@1 of y=1 over y=2 is 0.5/0.6 (seed 0) and 0.45/0.6 (seed 1).
    (effect,) = r["axis_effects"]
    assert (effect["axis"], effect["a"], effect["b"]) == ("y", "1", "2")
    assert (effect["pairs"], effect["a_higher"], effect["b_higher"]) == (2, 0, 2)
    assert effect["sign_p"] == pytest.approx(0.5) and effect["independent"]
    assert effect["median_ratio"] == pytest.approx((0.5 / 0.6 + 0.45 / 0.6) / 2)
    assert (effect["seeds_a_higher_in_every_pair"], effect["seeds_b_higher_in_every_pair"]) == (
        0,
        2,
    )
    assert "| y | 1 vs 2 | 2 | 0 | 2 | 0 | 0.792 | 0.5 | 0 / 2 of 2 |" in markdown(r)
    bad = report(measured, manifest=manifest, rho=2.0, alpha=0.25, mu=2.0)
    assert "ρ must be in [0, 1]" in bad["advisor"]["error"] and bad["cells"] == r["cells"]
    assert "no prediction" in markdown(bad)
    plot_heatmaps(r, tmp_path / "h.png")
    plot_pareto(r, tmp_path / "p.png")
    assert (tmp_path / "h.png").stat().st_size > 5_000 and (
        tmp_path / "p.png"
    ).stat().st_size > 5_000


def test_kubeflow_path_compiles_once_per_pod_setting_and_parses_strictly(tmp_path):
    from replayrl.kfp.runtime import resolve

    s = sweep_points(
        config_path=PRESET,
        grid=["N=128,256", "kubernetes.iterations_per_task=1,2"],
        out_dir=tmp_path,
        run_root="s3://bucket/sweep",
        overrides=["iterations=2"],
    )
    runs = plan_kubeflow(s, packages_dir=tmp_path / "kfp", image="replayrl:test")
    assert len(runs) == 4 and len({r.package for r in runs}) == 2  # two pod settings
    for package in {r.package for r in runs}:
        spec, deployment, _ = parse(package)
        assert spec.pipeline_info.name == "replay-loop"
        assert {e.container.image for e in deployment.executors.values()} == {"replayrl:test"}
    for point, run in zip(s.points, runs, strict=True):
        cfg = resolve(
            run.params["config"],
            lineage=run.params["lineage"],
            run_root=run.params["run_root_s3_uri"],
        )
        assert cfg.lineage == point.lineage and cfg.buffer.capacity == point.config.buffer.capacity
        assert cfg.config_hash() == point.config.config_hash()
    assert len(json.loads((tmp_path / "kfp" / "runs.json").read_text())) == 4
    local = sweep_points(config_path=PRESET, grid=["N=128"], out_dir=tmp_path)
    with pytest.raises(ReplayRLError, match="run root the pods share"):
        plan_kubeflow(local, packages_dir=tmp_path / "no", image="x")


@pytest.mark.slow
def test_local_sweep_runs_resumes_skips_and_reports(tmp_path, tiny, capsys):
    out = tmp_path / "sweep"
    sets = [o for o in tiny.overrides(tmp_path) if not o.startswith("storage.run_root=")]
    argv = ["sweep", "run", "--config", str(PRESET), "--grid", "y=2,4", "--out", str(out)]
    argv += [a for o in sets for a in ("--set", o)]
    # One iteration each, then raised to 2: both resume; then both are finished.
    assert main([*argv, "--set", "iterations=1"]) == 0
    assert main([*argv, "--set", "iterations=2"]) == 0
    assert main([*argv, "--set", "iterations=2"]) == 0
    err = capsys.readouterr().err
    assert err.count(": running") == 4 and err.count("finished earlier, skipped") == 2
    names = ["chain_sum-replay-y2", "chain_sum-replay-y4"]
    states = [storage.read_state(storage.lineage_paths(str(out / "runs"), n)) for n in names]
    assert [s.next_iteration for s in states] == [3, 3]

    done_hists = {n: (out / "distributions" / f"{n}.json").read_text() for n in names}
    assert main(["sweep", "report", "--out", str(out)]) == 0
    result = json.loads((out / "sweep_report.json").read_text())
    client = MlflowClient(f"sqlite:///{out / 'runs' / 'mlflow.db'}")
    assert len({s.mlflow_run_id for s in states}) == 2  # resumed into the same runs
    for name, state in zip(names, states, strict=True):
        cell = result["cells"][f"y={name[-1]}"]
        history = client.get_metric_history(state.mlflow_run_id, "eval/pass1")
        assert cell["best_pass1"] == max(m.value for m in history)
        assert cell["lineages"][0]["evaluations"] == 3  # warm start + 2 iterations
        hists = json.loads((out / "distributions" / f"{name}.json").read_text())
        assert hists == json.loads(done_hists[name])  # written when it ran, the same again
        assert sum(hists["staleness"]["counts"]) == 2 * 4 * 16  # iterations × S × B uses
        logged = client.list_artifacts(state.mlflow_run_id, "distributions")
        assert {Path(f.path).name for f in logged} == {f"{name}.json", f"{name}.png"}
    assert result["advisor"] is not None and result["most_efficient_cell"] in result["cells"]
    for f in ("sweep_report.md", "heatmap.png", "pareto.png"):
        assert (out / f).stat().st_size > 500
    manifest = yaml.safe_load((out / "sweep.json").read_text())
    assert [p["lineage"] for p in manifest["points"]] == names


def test_axis_effects_pair_lineages_that_differ_in_one_value():
    """N x y x 2 seeds: N=2 beats N=1 in every (y, seed) pair; the 4 pairs share 2 seeds, so
    they are marked not independent, and each seed counts once per side."""
    from replayrl.experiments.sweep_report import axis_effects

    best = {  # (N, y, seed) -> best pass@1
        ("1", "1", 0): 0.30, ("1", "1", 1): 0.20, ("1", "2", 0): 0.25, ("1", "2", 1): 0.22,
        ("2", "1", 0): 0.40, ("2", "1", 1): 0.30, ("2", "2", 0): 0.35, ("2", "2", 1): 0.22,
    }  # fmt: skip
    cells = {}
    for (n, y, seed), b in best.items():
        cell = cells.setdefault(f"N={n}, y={y}", {"values": {"N": n, "y": y}, "lineages": []})
        cell["lineages"].append({"seed": seed, "best_pass1": b})
    cells["N=1, y=1"]["lineages"].append({"seed": 2})  # no evaluation yet: left out
    by = {(e["axis"], e["a"], e["b"]): e for e in axis_effects(cells)}
    n = by[("N", "1", "2")]
    assert (n["pairs"], n["a_higher"], n["b_higher"], n["ties"]) == (4, 0, 3, 1)
    assert n["sign_p"] == pytest.approx(0.25) and not n["independent"] and n["seeds"] == 2
    assert (n["seeds_a_higher_in_every_pair"], n["seeds_b_higher_in_every_pair"]) == (0, 1)
    y = by[("y", "1", "2")]
    assert (y["pairs"], y["a_higher"], y["b_higher"], y["ties"]) == (4, 3, 1, 0)
