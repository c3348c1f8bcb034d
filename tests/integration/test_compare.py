"""`replayrl compare` and `replayrl advise` against a real MLflow store (sqlite under
tmp_path) holding synthetic lineage runs with known curves, logged with the keys, steps and
tags the lineages use: the first-reach ratios, the files, and the comparison run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from replayrl.cli.main import main
from replayrl.errors import ReplayRLError
from replayrl.experiments.compare import COMPARISON_KIND, experiment_mu, read_lineages, run_compare

pytestmark = pytest.mark.integration
EXPERIMENT = "synthetic"
# (arm, seed) -> pass@1 at iterations 0, 10, 20, 30 (the same curves as tests/unit).
PASS1 = {
    ("on-policy", 0): (0.20, 0.30, 0.40, 0.50),
    ("on-policy", 1): (0.20, 0.34, 0.44, 0.54),
    ("replay", 0): (0.20, 0.35, 0.55, 0.60),
    ("replay", 1): (0.20, 0.33, 0.53, 0.58),
}


def log_lineage(
    client: MlflowClient,
    experiment_id: str,
    arm: str,
    seed: int,
    *,
    lr="1e-4",
    pass1=None,
    cpu_share=None,
    device_share=None,
    sampled_offset=None,
    extra_params=None,
):
    """One lineage run: per iteration the ledger's cumulative metrics at step = gradient step
    (iteration t at 4t), eval every 10.
    On-policy: 256 fresh rollouts (1.5 s, 1000 tokens), replay: 128 (0.75 s, 500 tokens);
    both train on 256 rows (0.5 s). Measured μ = 3 in both. `cpu_share`: also log the CPU
    clock, each part's CPU seconds being that share of its wall seconds (generation,
    training), as a lineage on a shared machine would. `device_share`: the same for the
    device clock (CUDA events), as a lineage on a GPU logs it. `sampled_offset`: also log
    eval/pass1_sampled = pass@1 + offset, as a lineage with eval.pass1_temperature does."""
    fresh, tokens, gen_s = (256, 1000, 1.5) if arm == "on-policy" else (128, 500, 0.75)
    lineage = f"task-{arm}-s{seed}"
    run = client.create_run(
        experiment_id, run_name=lineage, tags={"lineage": lineage, "arm": arm, "seed": str(seed)}
    )
    params = {
        "seed": str(seed),
        "train.lr": lr,
        "train.batch_size": "64",
        "train.steps_per_iteration": "4",
        "rollout.samples_per_prompt": "8",
        "rollout.prompts_per_iteration": str(fresh // 8),
        "rollout.backend": "transformers",
        "storage.run_root": f"/tmp/{lineage}",
        **(extra_params or {}),
    }
    metrics = []
    for t in range(31):
        values = {}
        if t > 0:
            values = {
                "cumulative/generated_tokens": tokens * t,
                "cumulative/seconds": (gen_s + 0.5) * t,
                "cumulative/generation_seconds": gen_s * t,
                "cumulative/training_seconds": 0.5 * t,
                "cumulative/rollouts_generated": fresh * t,
                "cumulative/rollouts_trained": 256 * t,
            }
            if cpu_share is not None:
                gen_cpu, train_cpu = gen_s * cpu_share[0] * t, 0.5 * cpu_share[1] * t
                values.update(
                    {
                        "cumulative/cpu_seconds": gen_cpu + train_cpu,
                        "cumulative/generation_cpu_seconds": gen_cpu,
                        "cumulative/training_cpu_seconds": train_cpu,
                    }
                )
            if device_share is not None:
                gen_dev, train_dev = gen_s * device_share[0] * t, 0.5 * device_share[1] * t
                values.update(
                    {
                        "cumulative/device_seconds": gen_dev + train_dev,
                        "cumulative/generation_device_seconds": gen_dev,
                        "cumulative/training_device_seconds": train_dev,
                    }
                )
        if t % 10 == 0:
            p = (pass1 or PASS1[(arm, seed)])[t // 10]
            values.update({"eval/pass1": p, "eval/pass_at_4": p + 0.2, "eval/entropy": 0.5})
            if sampled_offset is not None:
                values["eval/pass1_sampled"] = p + sampled_offset
        values["iteration"] = t
        # At the engines' MLflow step: the gradient step iteration t ends on (S = 4).
        metrics += [Metric(k, float(v), 1000 + t, 4 * t) for k, v in values.items()]
    client.log_batch(
        run.info.run_id, metrics=metrics, params=[Param(k, v) for k, v in params.items()]
    )
    return run.info.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store for the module (a new sqlite store takes ~10 s of migrations here); tests
    that add lineages do it in experiments of their own."""
    tmp_path = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment(EXPERIMENT, artifact_location=f"file://{tmp_path}/artifacts")
    for arm, seed in PASS1:
        log_lineage(client, exp, arm, seed)
    return uri, client, exp


def test_compare_reads_lineages_and_logs_a_comparison_run(store, tmp_path):
    uri, client, exp = store
    done = run_compare(
        tracking_uri=uri, experiment=EXPERIMENT, out_dir=tmp_path / "out", what_if_mu=5.3
    )
    r = done.result
    assert r["target_pass1"] == pytest.approx(0.52)
    rep = r["arms"]["replay"]
    assert rep["to_target"]["generated_tokens"] == 10_000
    assert rep["ratio_to_on_policy"]["generated_tokens"] == pytest.approx(1 / 3)
    assert rep["ratio_to_on_policy"]["seconds"] == pytest.approx(25 / 60)
    assert rep["ratio_to_on_policy"]["cost_units"] == pytest.approx(12800 / 30720)  # own μ = 3
    assert rep["ratio_to_on_policy"]["cost_units_what_if"] == pytest.approx(18688 / 48384)
    assert rep["ratio_ci"] is None  # 2 seeds: no bootstrap below 8
    # Per seed: on-policy seed 0 ends at 0.50 < 0.52 (only it missed: 0); seed 1 reaches the
    # target at 30 (30,000 tokens), replay seed 1 at 20 (10,000).
    assert r["paired"]["replay"]["first"]["generated_tokens"]["ratios"] == [
        0.0,
        pytest.approx(1 / 3),
    ]
    assert r["mu_own"] == pytest.approx(3.0)
    assert r["config_differences"]["rollout.prompts_per_iteration"] == {
        "on-policy": "32",
        "replay": "16",
    }
    eq = r["arms"]["on-policy"]["at_equal_compute"]["generated_tokens"]
    assert eq["pass1_unsmoothed"] == pytest.approx(0.37)  # smoothed over 3 evaluations: 0.367
    assert eq["pass1"] == pytest.approx(0.3667, abs=1e-4)
    assert r["seconds_label"] == "CPU wall seconds"  # these lineages logged no CPU clock

    out = tmp_path / "out"
    assert json.loads((out / "comparison.json").read_text())["target_pass1"] == pytest.approx(0.52)
    report = (out / "comparison.md").read_text()
    assert "| replay | 2 | 20 | 10,000 | 0.33 |" in report and "what-if μ = 5.3" in report
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".*tmp*")), "no temporary file left behind"

    run = client.get_run(done.mlflow_run_id)
    assert run.data.tags["kind"] == COMPARISON_KIND and "arm" not in run.data.tags
    assert run.data.metrics["replay/ratio_to_on_policy/generated_tokens"] == pytest.approx(1 / 3)
    assert sorted(a.path for a in client.list_artifacts(done.mlflow_run_id)) == [
        "comparison.json",
        "comparison.md",
        "comparison.png",
    ]
    # The comparison run is not read back as a lineage: a second comparison sees 4 lineages.
    again = run_compare(tracking_uri=uri, experiment=EXPERIMENT, out_dir=tmp_path / "again")
    assert again.result == r  # the bootstrap's RNG is seeded: the same report
    assert len(read_lineages(tracking_uri=uri, experiment=EXPERIMENT).curves) == 4


def test_named_lineages_are_the_only_ones_read_and_must_all_be_there(store):
    uri, _, _ = store
    every = read_lineages(tracking_uri=uri, experiment=EXPERIMENT).curves
    two = sorted({c.lineage for c in every})[:2]
    chosen = read_lineages(tracking_uri=uri, experiment=EXPERIMENT, lineages=two).curves
    assert sorted(c.lineage for c in chosen) == two and len(every) > 2
    with pytest.raises(ReplayRLError, match="Lineage\\(s\\) gone have no evaluated run"):
        read_lineages(tracking_uri=uri, experiment=EXPERIMENT, lineages=[two[0], "gone"])


def test_same_key_reuses_its_comparison_run(store, tmp_path):
    uri, client, exp = store
    a = run_compare(tracking_uri=uri, experiment=EXPERIMENT, out_dir=tmp_path / "a", key="kfp-1")
    b = run_compare(tracking_uri=uri, experiment=EXPERIMENT, out_dir=tmp_path / "b", key="kfp-1")
    assert a.mlflow_run_id == b.mlflow_run_id


def test_the_measured_axis_is_the_cpu_clock_when_every_lineage_has_it(store, tmp_path):
    """On a busy machine wall seconds grow with the neighbours: here on-policy's lineages
    got their CPU for only half their wall time while replay's got all of it (generation,
    training). The CPU clock measures the method: replay needs 0.75 + 0.5 CPU seconds per
    iteration against on-policy's 0.75 + 0.25, whatever the wall clock said. A lineage
    without the CPU clock makes the whole comparison fall back to wall seconds."""
    uri, client, _ = store
    exp = client.create_experiment("busy", artifact_location=f"file://{tmp_path}/artifacts")
    for arm, seed in PASS1:
        log_lineage(client, exp, arm, seed, cpu_share=(0.5, 0.5) if arm == "on-policy" else (1, 1))
    result = run_compare(tracking_uri=uri, experiment="busy", out_dir=tmp_path / "busy")
    r = result.result
    assert r["seconds_label"] == "CPU seconds (process time)"
    rep = r["arms"]["replay"]
    # replay reaches the on-policy target (0.52) at iteration 20: 20 × 1.25 CPU seconds;
    # on-policy at 30 × 1.0 (its wall seconds would say 30 × 2.0).
    assert rep["ratio_to_on_policy"]["seconds"] == pytest.approx(25 / 30)
    # μ from the CPU clock: generation and training slowed alike, so still 3 in every lineage.
    assert r["mu_own"] == pytest.approx(3.0)
    log_lineage(client, exp, "replay", 2, pass1=PASS1[("replay", 0)])  # no CPU clock
    again = run_compare(tracking_uri=uri, experiment="busy", out_dir=tmp_path / "mixed")
    assert again.result["seconds_label"] == "CPU wall seconds"


def test_the_measured_axis_is_the_device_clock_when_every_lineage_has_it(store, tmp_path):
    """GPU lineages log device seconds (CUDA events) beside wall and CPU seconds; the
    comparison measures compute with them when every lineage has them, and says so. Here
    replay's generation held the device for only a third of its wall time (the host was the
    bottleneck) and its training for all of it, on-policy's both fully: replay needs
    0.25 + 0.5 device seconds per iteration against on-policy's 1.5 + 0.5."""
    uri, client, _ = store
    exp = client.create_experiment("gpu", artifact_location=f"file://{tmp_path}/artifacts")
    gpu = {"rollout.backend": "vllm"}
    for arm, seed in PASS1:
        share = (1, 1) if arm == "on-policy" else (1 / 3, 1)
        log_lineage(client, exp, arm, seed, cpu_share=(1, 1), device_share=share, extra_params=gpu)
    r = run_compare(tracking_uri=uri, experiment="gpu", out_dir=tmp_path / "gpu").result
    assert r["seconds_label"] == "device seconds (CUDA events)"
    # replay reaches the target at iteration 20, on-policy at 30: 20 × 0.75 over 30 × 2.0.
    assert r["arms"]["replay"]["ratio_to_on_policy"]["seconds"] == pytest.approx(15 / 60)
    # μ from the device clock: on-policy (1.5 / 256) / (0.5 / 256) = 3, replay
    # (0.25 / 128) / (0.5 / 256) = 1; the median of 3, 3, 1, 1.
    assert r["mu_own"] == pytest.approx(2.0)
    report = (tmp_path / "gpu" / "comparison.md").read_text()
    assert "(the `seconds` axis and own μ): device seconds (CUDA events)" in report
    # One lineage without the device clock (an older run): wall seconds, as before.
    log_lineage(client, exp, "replay", 2, pass1=PASS1[("replay", 0)], extra_params=gpu)
    again = run_compare(tracking_uri=uri, experiment="gpu", out_dir=tmp_path / "mixed")
    assert again.result["seconds_label"] == "GPU-seconds"


def test_an_arm_mixing_configs_is_refused(store):
    uri, client, _ = store
    exp = client.create_experiment("mixed")
    log_lineage(client, exp, "replay", 0)
    log_lineage(client, exp, "replay", 1, lr="3e-4")
    with pytest.raises(ReplayRLError, match=r"different configs \(differing: train.lr\)"):
        read_lineages(tracking_uri=uri, experiment="mixed")


def test_missing_store_or_experiment_says_what_exists(store, tmp_path):
    uri, _, _ = store
    with pytest.raises(ReplayRLError, match="No MLflow store"):
        read_lineages(tracking_uri=f"sqlite:///{tmp_path / 'nope.db'}", experiment=EXPERIMENT)
    assert not (tmp_path / "nope.db").exists()
    with pytest.raises(ReplayRLError, match="it has: .*synthetic"):
        read_lineages(tracking_uri=uri, experiment="typo")


def test_advise_reads_mu_and_the_shape_from_the_ledger(store, capsys):
    uri, _, _ = store
    mu, source, shape = experiment_mu(tracking_uri=uri, experiment=EXPERIMENT)
    assert mu == pytest.approx(3.0) and "median of 4 lineage(s)" in source
    assert shape == dict(batch_size=64, steps_per_iteration=4, samples_per_prompt=8)
    argv = ["advise", "--experiment", EXPERIMENT, "--tracking-uri", uri]
    assert main([*argv, "--rho", "0.5", "--alpha", "0.25", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # x* < S = 4, so y = sqrt(3 / (0.5 + 1/4)) = 2 at x = 4: 16 prompts of 8, N = R_iter = 128.
    assert doc["mu"] == pytest.approx(3.0) and doc["mu_source"].startswith("measured")
    assert doc["settings"] == {"rollout.prompts_per_iteration": 16, "buffer.capacity": 128}


def test_cli_compare_and_advise(store, tmp_path, capsys):
    uri, _, _ = store
    cli = [sys.executable, "-m", "replayrl.cli.main"]
    proc = subprocess.run(
        [*cli, "compare", "--experiment", EXPERIMENT, "--tracking-uri", uri]
        + ["--out", str(tmp_path / "cli"), "--mu", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| replay | 2 | 20 | 10,000 |" in proc.stdout and "what-if μ = 0" in proc.stdout
    # In-process (a second interpreter costs seconds here): the one-line user error.
    advise = ["advise", "--experiment", "typo", "--tracking-uri", uri, "--rho", "0.5"]
    assert main([*advise, "--alpha", "0.25"]) == 2
    err = capsys.readouterr().err
    assert "No MLflow experiment 'typo'" in err and "Traceback" not in err


def test_metric_and_peak_choose_what_is_compared_and_a_file_is_restated(store, tmp_path, capsys):
    """--metric pass1_sampled reads eval/pass1_sampled (here greedy − 0.1): the target is
    on-policy's final median of it, 0.42 (greedy: 0.52), which on-policy seed 0 never reaches
    (0.40) and seed 1 reaches at iteration 30; replay's seeds at 20. --peak shows each seed's
    best. Without the metric logged, the user is told how to log it. --from-json restates a
    written result."""
    uri, client, _ = store
    exp = client.create_experiment("sampled", artifact_location=f"file://{tmp_path}/artifacts")
    for arm, seed in PASS1:
        log_lineage(client, exp, arm, seed, sampled_offset=-0.1)
    out = tmp_path / "sampled"
    argv = ["compare", "--experiment", "sampled", "--tracking-uri", uri, "--out", str(out)]
    assert main([*argv, "--metric", "pass1_sampled", "--peak", "--mu", "0"]) == 0
    r = json.loads((out / "comparison.json").read_text())
    assert r["metric"]["name"] == "pass1_sampled" and r["accuracy_reported"] == "peak"
    assert r["target_pass1"] == pytest.approx(0.42)
    paired = r["paired"]["replay"]["first"]["generated_tokens"]
    assert paired["ratios"] == [0.0, pytest.approx(1 / 3)]  # s0: only on-policy missed
    assert r["arms"]["replay"]["peak_pass1"]["median"] == pytest.approx(0.49)
    report = capsys.readouterr().out
    assert "| peak sampled pass@1 (eval.pass1_temperature) | peak pass@4 |" in report
    assert "No bootstrap interval" in report

    assert main([*argv, "--metric", "pass_at_k", "--mu", "0"]) == 0
    r = json.loads((out / "comparison.json").read_text())
    assert r["target_pass1"] == pytest.approx(0.72)  # pass@4 = pass@1 + 0.2
    assert r["arms"]["replay"]["ratio_to_on_policy"]["generated_tokens"] == pytest.approx(1 / 3)

    plain = ["compare", "--experiment", EXPERIMENT, "--tracking-uri", uri, "--out", str(out)]
    assert main([*plain, "--metric", "pass1_sampled"]) == 2
    err = capsys.readouterr().err
    assert "eval/pass1_sampled" in err and "eval.pass1_temperature" in err

    restated = tmp_path / "restated"
    assert (
        main(["compare", "--from-json", str(out / "comparison.json"), "--out", str(restated)]) == 0
    )
    text = (restated / "comparison.md").read_text()
    assert "**Restated**" in text and "Per-seed paired ratios" in text
    assert (
        main(["compare", "--from-json", str(tmp_path / "nope.json"), "--out", str(restated)]) == 2
    )
    assert "Cannot read" in capsys.readouterr().err


def test_compare_takes_the_what_if_mu_its_lineages_name(store):
    import argparse

    from replayrl.cli.analysis import _lineages_what_if_mu
    from replayrl.engine.tracking import _param_value
    from replayrl.experiments.statistics import PAPER_MU

    uri, client, _ = store
    exp = client.create_experiment("named-mu")
    for arm, seed in PASS1:
        log_lineage(client, exp, arm, seed, extra_params={"model.paper_mu": "6.84"})
    args = argparse.Namespace(mu=None, tracking_uri=uri, experiment="named-mu")
    assert _lineages_what_if_mu(args) == 6.84  # model.paper_mu of the preset they ran
    args.mu = 2.0  # --mu wins
    assert _lineages_what_if_mu(args) == 2.0
    unnamed = argparse.Namespace(mu=None, tracking_uri=uri, experiment=EXPERIMENT)
    assert _lineages_what_if_mu(unnamed) == PAPER_MU
    # A preset without a paper μ (the tiny one): its lineages log the param as the tracker
    # writes None; compare then takes the default (it raised "could not convert 'null'").
    exp = client.create_experiment("no-paper-mu")
    for arm, seed in PASS1:
        log_lineage(client, exp, arm, seed, extra_params={"model.paper_mu": _param_value(None)})
    none = argparse.Namespace(mu=None, tracking_uri=uri, experiment="no-paper-mu")
    assert _lineages_what_if_mu(none) == PAPER_MU


H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


def _tagged_experiment(store, name: str, model_of) -> dict[tuple[str, int], str]:
    """The four synthetic lineages in experiment `name`, each tagged by the lineages' own
    writer (`Tracker.record_accelerator`) with `model_of(arm, seed)`; None = no tag (a
    lineage recorded before the tag was)."""
    from replayrl.engine.tracking import Tracker

    uri, client, _ = store
    tracker = Tracker(uri, name)
    runs = {key: log_lineage(client, tracker.experiment_id, *key) for key in PASS1}
    for key, run_id in runs.items():
        if model_of(*key) is not None:
            tracker.record_accelerator(run_id, model_of(*key), 8)
    return runs


def test_lineages_generated_on_different_accelerators_are_refused_unless_told(
    store, tmp_path, capsys
):
    """Generation seconds are not comparable across GPU models: a comparison whose arms ran
    on an H100 and an A100 is refused in one line naming both, unless told."""
    uri, client, _ = store
    _tagged_experiment(store, "hardware", lambda arm, seed: H100 if arm == "replay" else A100)
    with pytest.raises(ReplayRLError) as refused:
        run_compare(tracking_uri=uri, experiment="hardware", out_dir=tmp_path / "refused")
    line = str(refused.value)
    assert "\n" not in line and "--allow-mixed-hardware" in line
    assert f"{A100} (task-on-policy-s0, task-on-policy-s1)" in line
    assert f"{H100} (task-replay-s0, task-replay-s1)" in line
    assert not (tmp_path / "refused").exists()

    argv = ["compare", "--experiment", "hardware", "--tracking-uri", uri]
    assert main([*argv, "--out", str(tmp_path / "cli")]) == 2
    err = capsys.readouterr().err
    assert H100 in err and A100 in err and "Traceback" not in err
    assert main([*argv, "--out", str(tmp_path / "cli"), "--allow-mixed-hardware"]) == 0
    compared = json.loads((tmp_path / "cli" / "comparison.json").read_text())
    assert compared["accelerators"]["task-replay-s0"] == H100
    assert compared["accelerators"]["task-on-policy-s0"] == A100
    assert compared["arms"]["replay"]["ratio_to_on_policy"]["generated_tokens"] == pytest.approx(
        1 / 3
    )


def test_lineages_of_one_accelerator_model_are_compared(store, tmp_path):
    uri, client, _ = store
    runs = _tagged_experiment(store, "one-model", lambda arm, seed: H100)
    done = run_compare(tracking_uri=uri, experiment="one-model", out_dir=tmp_path / "one")
    assert set(done.result["accelerators"].values()) == {H100}
    tags = client.get_run(runs[("replay", 0)]).data.tags
    assert (tags["system.accelerator"], tags["system.accelerator_count"]) == (H100, "8")
    # A lineage whose retried pod generated on another model lists both, and no longer
    # compares with the H100-only ones.
    from replayrl.engine.tracking import Tracker

    Tracker(uri, "one-model").record_accelerator(runs[("replay", 1)], A100, 4)
    tags = client.get_run(runs[("replay", 1)]).data.tags
    assert (tags["system.accelerator"], tags["system.accelerator_count"]) == (
        f"{A100} + {H100}",
        "8",
    )
    with pytest.raises(ReplayRLError, match=rf"{A100} \+ {H100} \(task-replay-s1\)"):
        read_lineages(tracking_uri=uri, experiment="one-model")


def test_lineages_recorded_before_the_accelerator_tag_compare_with_a_warning(
    store, tmp_path, caplog
):
    uri, _, _ = store
    _tagged_experiment(store, "older", lambda arm, seed: H100 if arm == "replay" else None)
    with caplog.at_level("WARNING", logger="replayrl.experiments.compare"):
        done = run_compare(tracking_uri=uri, experiment="older", out_dir=tmp_path / "older")
    assert done.result["accelerators"]["task-on-policy-s0"] is None
    (warning,) = [r.getMessage() for r in caplog.records if "accelerator model" in r.getMessage()]
    assert warning.startswith("Lineages task-on-policy-s0, task-on-policy-s1 record no accelerator")
