"""The arithmetic of the replay vs on-policy comparison, on curves whose answers are known:
compute to first reach a target, ratios and their split, medians with IQR over seeds, the
bootstrap CI (deterministic, and excluding or including 1 where it must), three arms and the
config keys that differ between them."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from replayrl.errors import ReplayRLError
from replayrl.experiments.arms import (
    arm_config_differences,
    compare,
    config_differences,
    group_by_arm,
)
from replayrl.experiments.report import markdown
from replayrl.experiments.seeds import lineage_configs
from replayrl.experiments.statistics import (
    LineageCurve,
    arm_curve,
    censored_ratio,
    first_reach,
    measured_mu,
    percentile_interval,
    quantile,
    summary,
    value_at,
)

pytestmark = pytest.mark.unit
EVALS = (0, 10, 20, 30)


def curve(arm: str, seed: int, pass1, *, evals=EVALS) -> LineageCurve:
    """On-policy: 256 rollouts generated and trained per iteration, 1000 tokens, 1.5 s of
    generation + 0.5 s of training (μ = 3). Replay arms: half the fresh rollouts at the same
    cost per rollout (128, 500 tokens, 0.75 s) and the same 256 trained rows (0.5 s)."""
    fresh, tokens, gen_s = (256, 1000, 1.5) if arm == "on-policy" else (128, 500, 0.75)
    return LineageCurve(
        lineage=f"task-{arm}-s{seed}",
        arm=arm,
        seed=seed,
        iterations=tuple(evals),
        pass1=tuple(pass1),
        pass_at_k=tuple(p + 0.2 for p in pass1),
        entropy=tuple(0.5 - 0.01 * t for t in evals),
        generated_tokens=tuple(float(tokens * t) for t in evals),
        seconds=tuple((gen_s + 0.5) * t for t in evals),
        rollouts_generated=tuple(float(fresh * t) for t in evals),
        rollouts_trained=tuple(256.0 * t for t in evals),
        k=4,
        generation_seconds_total=gen_s * evals[-1],
        training_seconds_total=0.5 * evals[-1],
        rollouts_generated_total=fresh * evals[-1],
        rollouts_trained_total=256.0 * evals[-1],
    )


def known_curves() -> list[LineageCurve]:
    return [
        curve("on-policy", 0, (0.20, 0.30, 0.40, 0.50)),
        curve("on-policy", 1, (0.20, 0.34, 0.44, 0.54)),  # mean: .20 .32 .42 .52
        curve("replay", 0, (0.20, 0.35, 0.55, 0.60)),
        curve("replay", 1, (0.20, 0.33, 0.53, 0.58)),  # mean: .20 .34 .54 .59
    ]


def test_first_reach_is_the_first_evaluation_at_or_above_the_target():
    assert first_reach([0, 10, 20, 30], [0.2, 0.3, 0.5, 0.4], 0.45) == 20
    assert first_reach([0, 10, 20], [0.2, 0.3, 0.5], 0.5) == 20  # equal counts
    assert first_reach([0, 10, 20], [0.2, 0.3, 0.4], 0.5) is None
    assert first_reach([0, 10], [0.6, 0.7], 0.5) == 0  # the warm start already there


def test_value_at_interpolates_linearly_inside_and_is_nan_outside():
    assert value_at([0, 10, 20], [0.2, 0.4, 0.3], 5) == pytest.approx(0.3)
    assert value_at([0, 10, 20], [0.2, 0.4, 0.3], 20) == pytest.approx(0.3)
    assert math.isnan(value_at([0, 10, 20], [0.2, 0.4, 0.3], 21))


def test_median_and_iqr_use_linear_interpolation_not_the_mean():
    assert quantile([0.1, 0.2, 0.3, 0.9], 0.5) == pytest.approx(0.25)  # the mean is 0.375
    s = summary([0.9, 0.1, 0.3, 0.2, math.nan])
    assert s == pytest.approx(dict(median=0.25, q25=0.175, q75=0.45, min=0.1, max=0.9))
    assert summary([math.nan])["median"] is None


def test_arm_curve_is_the_median_over_seeds_with_an_iqr_band():
    seeds = [
        curve("on-policy", s, (0.2, p / 2, p), evals=(0, 10, 20))
        for s, p in enumerate((0.1, 0.2, 0.3, 0.9))  # final median 0.25, mean 0.375
    ]
    a = arm_curve(seeds, mus={"cost_units": 5.3})
    assert a.iterations == (0, 10, 20) and a.seeds == (0, 1, 2, 3)
    assert a.pass1_median == pytest.approx((0.2, 0.125, 0.25))
    assert a.pass1_q25 == pytest.approx((0.2, 0.0875, 0.175))
    assert a.pass1_q75 == pytest.approx((0.2, 0.225, 0.45))
    assert a.compute["cost_units"][-1] == pytest.approx(20 * (5.3 * 256 + 256))
    assert compare(seeds)["target_pass1"] == pytest.approx(0.25)


def test_seeds_with_different_evaluations_are_compared_on_the_common_ones():
    short = curve("replay", 2, (0.2, 0.3, 0.4), evals=(0, 10, 20))
    a = arm_curve([known_curves()[2], short], mus={"cost_units": 1.0})
    assert a.iterations == (0, 10, 20)
    assert a.final_pass1 == pytest.approx((0.55, 0.4))


def test_compare_gives_the_known_first_reach_ratios_own_and_what_if_mu():
    r = compare(known_curves(), what_if_mu=5.3)
    assert r["target_pass1"] == pytest.approx(0.52)  # on-policy's final median (of 2: mean)
    assert r["mu_own"] == pytest.approx(3.0) and r["mu_what_if"] == 5.3
    on, rep = r["arms"]["on-policy"], r["arms"]["replay"]
    # On-policy reaches its own final median at iteration 30; replay at iteration 20.
    assert (on["iterations_to_target"], rep["iterations_to_target"]) == (30, 20)
    assert on["to_target"] == pytest.approx(
        {
            "generated_tokens": 30_000,
            "seconds": 60.0,
            "cost_units": 30 * (3 * 256 + 256),  # own μ = 3, measured
            "cost_units_what_if": 30 * 6.3 * 256,
        }
    )
    assert rep["to_target"]["cost_units"] == 20 * (3 * 128 + 256)
    assert rep["to_target"]["cost_units_what_if"] == pytest.approx(20 * (5.3 * 128 + 256))
    assert rep["ratio_to_on_policy"]["generated_tokens"] == pytest.approx(1 / 3)
    assert rep["ratio_to_on_policy"]["seconds"] == pytest.approx(25 / 60)
    assert rep["ratio_to_on_policy"]["cost_units"] == pytest.approx(12800 / 30720)
    assert rep["ratio_to_on_policy"]["cost_units_what_if"] == pytest.approx(18688 / 48384)
    # Equal compute: the replay arm's total (15,000 tokens) bounds the common budget;
    # on-policy's median curve there is half-way between iterations 10 and 20. Read on the
    # curves smoothed over 3 evaluations: on-policy .26 .3133 .42 .47, replay .27 .36 .49 .565.
    eq = {arm: r["arms"][arm]["at_equal_compute"]["generated_tokens"] for arm in r["arms"]}
    assert eq["on-policy"]["budget"] == eq["replay"]["budget"] == 15_000
    assert eq["on-policy"]["pass1"] == pytest.approx((0.94 / 3 + 0.42) / 2)
    assert eq["on-policy"]["pass1_unsmoothed"] == pytest.approx(0.37)
    assert eq["replay"]["pass1"] == pytest.approx(0.565)
    assert eq["replay"]["pass1_unsmoothed"] == pytest.approx(0.59)
    assert rep["final_pass1"] == pytest.approx(
        dict(median=0.59, q25=0.585, q75=0.595, min=0.58, max=0.60)
    )
    assert on["measured_mu"] == pytest.approx(3.0) and rep["measured_mu"] == pytest.approx(3.0)
    assert rep["rollouts_trained_to_target"] == pytest.approx(20 * 256)
    assert [s["to_target"]["generated_tokens"] for s in on["per_seed"]] == [None, 30_000]


def test_the_ratio_splits_into_cost_per_iteration_times_iterations():
    r = compare(known_curves(), what_if_mu=5.3)
    rep = r["arms"]["replay"]
    for axis in r["axes"]:
        sp = rep["ratio_split"][axis]
        assert sp["per_iteration"] * sp["iterations"] == pytest.approx(
            rep["ratio_to_on_policy"][axis]
        )
        assert sp["iterations"] == pytest.approx(20 / 30)
    # Half the fresh rollouts and tokens per iteration; μ = 3: (3·128 + 256) / (3·256 + 256).
    assert rep["ratio_split"]["generated_tokens"]["per_iteration"] == pytest.approx(0.5)
    assert rep["ratio_split"]["cost_units"]["per_iteration"] == pytest.approx(640 / 1024)


def test_without_what_if_mu_only_the_own_mu_axis_is_reported():
    r = compare(known_curves(), what_if_mu=None)
    assert r["axes"] == ["generated_tokens", "seconds", "cost_units"]
    assert "what-if" not in markdown(r)


def test_a_given_target_changes_only_the_target():
    r = compare(known_curves(), target=0.30, what_if_mu=0.0)
    assert r["target_source"] == "given"
    # μ = 0: cost units are rows trained on, the same for both arms per iteration.
    assert r["arms"]["replay"]["to_target"]["cost_units_what_if"] == 10 * 256
    assert r["arms"]["replay"]["ratio_to_on_policy"]["cost_units_what_if"] == pytest.approx(1.0)


def test_unreached_target_is_none_and_shows_as_not_reached():
    r = compare(known_curves(), target=0.95, bootstrap_min_seeds=2)
    rep = r["arms"]["replay"]
    assert rep["to_target"]["seconds"] is None and rep["ratio_to_on_policy"]["seconds"] is None
    assert rep["ratio_split"]["seconds"] is None
    # Neither arm's median ever reaches 0.95: every resample is undefined, reported as such.
    assert rep["ratio_ci"]["seconds"]["undefined_fraction"] == 1.0
    assert rep["ratio_ci"]["arm_reached_fraction"] == 0.0
    table = markdown(r, seconds_label="CPU seconds")
    assert "not reached" in table and "CPU seconds" in table


def test_censored_ratios_and_percentile_interval():
    got = censored_ratio(np.array([10, np.inf, 5, np.inf, 0]), np.array([20, 5, np.inf, np.inf, 0]))
    np.testing.assert_array_equal(got, [0.5, np.inf, 0.0, np.nan, 1.0])
    assert percentile_interval(np.arange(1, 41.0)) == (1.0, 39.0)
    # The upper bound is the 39th of 40: one infinite ratio in 40 is within the 2.5 %, two not.
    assert percentile_interval(np.array([0.5] * 39 + [np.inf])) == (0.5, 0.5)
    assert percentile_interval(np.array([0.5] * 38 + [np.inf] * 2))[1] == np.inf


def eight_seeds(arm: str, finals_at) -> list[LineageCurve]:
    """Each of four curves for two seeds: 8 seeds, the fewest the bootstrap is shown for."""
    return [curve(arm, s, p) for s, p in enumerate([*finals_at, *finals_at])]


def test_bootstrap_ci_excludes_1_when_every_seed_of_replay_is_cheaper():
    on = eight_seeds("on-policy", [(0.2, 0.3, 0.4, 0.5 + d) for d in (0, 0.01, 0.02, 0.03)])
    rep = eight_seeds("replay", [(0.2, 0.4, 0.55 + d, 0.6) for d in (0, 0.01, 0.02, 0.03)])
    r = compare(on + rep, what_if_mu=None)
    ci = r["arms"]["replay"]["ratio_ci"]
    assert r["statistics"]["ci"] == {"resamples": 2000, "seed": 0, "level": 0.95, "paired": True}
    # Replay reaches 0.515 at iteration 20 in every resample, on-policy at 30, and replay's
    # iterations cost half the tokens: every resampled ratio is 1/3.
    assert ci["generated_tokens"]["low"] == ci["generated_tokens"]["high"] == pytest.approx(1 / 3)
    assert ci["seconds"]["high"] < 1 and ci["seconds"]["fraction_below_1"] == 1.0
    assert r["arms"]["on-policy"]["ratio_ci"] is None
    assert compare(on + rep, what_if_mu=None) == r  # the fixed RNG seed: reproducible


def test_bootstrap_ci_includes_1_when_replay_seeds_disagree_and_some_never_reach():
    on = eight_seeds("on-policy", [(0.2, 0.3, 0.4, 0.5)] * 4)
    rep = eight_seeds(
        "replay",
        [(0.2, 0.5, 0.5, 0.5), (0.2, 0.3, 0.5, 0.5), (0.2, 0.3, 0.4, 0.45), (0.2, 0.3, 0.4, 0.4)],
    )
    r = compare(on + rep, what_if_mu=0.0)  # μ = 0: equal cost per iteration
    rep_r = r["arms"]["replay"]
    assert rep_r["to_target"]["cost_units_what_if"] is None  # the median misses 0.5
    ci = rep_r["ratio_ci"]["cost_units_what_if"]
    assert ci["low"] < 1 and ci["high"] is None  # [<1, ∞): includes 1
    assert 0 < ci["fraction_below_1"] < 1
    assert 0 < rep_r["ratio_ci"]["arm_reached_fraction"] < 1
    assert rep_r["ratio_ci"]["on_policy_reached_fraction"] == 1.0
    assert "∞)" in markdown(r)


def test_markdown_shows_medians_iqr_ci_split_and_both_mus():
    r = compare(known_curves(), what_if_mu=5.3, bootstrap_min_seeds=2)
    table = markdown(r, seconds_label="CPU seconds")
    row = next(line for line in table.splitlines() if line.startswith("| replay | 2 | 20 |"))
    assert "10,000 | 0.33 [" in row and "0.42 [" in row
    assert "0.590 [0.585, 0.595]" in table
    assert "own μ = 3.00" in table and "what-if μ = 5.3" in table
    assert "2000 resamples, RNG seed 0" in table and "Fewer than 4 seeds" in table
    assert "| = per iteration | × iterations |" in table


def test_without_on_policy_a_target_is_needed():
    with pytest.raises(ReplayRLError, match="--target"):
        compare(known_curves()[2:])
    assert compare(known_curves()[2:], target=0.5)["arms"]["replay"]["to_target"]["seconds"] == 25


def test_without_a_measured_mu_the_own_cost_units_are_refused():
    blind = [dataclasses.replace(c, training_seconds_total=0.0) for c in known_curves()]
    with pytest.raises(ReplayRLError, match="own μ cannot be measured"):
        compare(blind)


def test_three_arms_each_replay_arm_against_on_policy_with_every_differing_key():
    plain = [
        dataclasses.replace(
            curve("replay-plain", s, (0.2, 0.25, 0.35, 0.52)), lineage=f"plain-s{s}"
        )
        for s in (0, 1)
    ]
    curves = [*known_curves(), *plain]
    assert list(group_by_arm(curves[::-1])) == ["on-policy", "replay", "replay-plain"]

    def p(arm, seed, **kw):
        base = {"arm": arm, "seed": str(seed), "storage.run_root": f"/r/{arm}{seed}"}
        return {**base, "train.lr": "1e-4", "buffer.capacity": "512", **kw}

    params = {
        "task-on-policy-s0": p("on-policy", 0, **{"buffer.capacity": "256"}),
        "task-on-policy-s1": p("on-policy", 1, **{"buffer.capacity": "256"}),
        "task-replay-s0": p("replay", 0, **{"buffer.positive_bias": "0.5"}),
        "task-replay-s1": p("replay", 1, **{"buffer.positive_bias": "0.5"}),
        "plain-s0": p("replay-plain", 0, **{"buffer.positive_bias": "0.0"}),
        "plain-s1": p("replay-plain", 1, **{"buffer.positive_bias": "0.0"}),
    }
    r = compare(curves, params=params, bootstrap_min_seeds=2)
    assert r["arms"]["replay-plain"]["iterations_to_target"] == 30
    assert r["arms"]["replay-plain"]["ratio_to_on_policy"]["generated_tokens"] == 0.5
    assert r["arms"]["replay-plain"]["ratio_ci"]["generated_tokens"]["low"] is not None
    assert r["config_differences"] == {
        "buffer.capacity": {"on-policy": "256", "replay": "512", "replay-plain": "512"},
        "buffer.positive_bias": {"on-policy": "(unset)", "replay": "0.5", "replay-plain": "0.0"},
    }
    table = markdown(r)
    assert "| replay-plain | 2 | 30 |" in table
    assert "| buffer.positive_bias | (unset) | 0.5 | 0.0 |" in table


def test_arm_config_differences_show_iterations_that_differ_within_an_arm():
    diffs = arm_config_differences(
        {
            "on-policy": [{"iterations": "30"}, {"iterations": "30"}],
            "replay": [{"iterations": "30"}, {"iterations": "40"}],
        }
    )
    assert diffs == {"iterations": {"on-policy": "30", "replay": "30/40"}}


def test_measured_mu_and_config_differences_within_an_arm():
    assert measured_mu(known_curves()[0]) == pytest.approx(3.0)
    params = [{"seed": "0", "train.lr": "1e-4", "storage.run_root": "a"}]
    params.append({"seed": "1", "train.lr": "1e-4", "storage.run_root": "b"})
    assert config_differences(params) == []
    params.append({"seed": "2", "train.lr": "3e-4", "storage.run_root": "c"})
    assert config_differences(params) == ["train.lr"]


def test_plain_replay_adds_a_third_arm_interleaved_seed_by_seed(tmp_path):
    preset = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"  # positive_bias 0.5
    configs = lineage_configs(config_path=preset, seeds=2, out_dir=tmp_path, plain_replay=True)
    assert [(c.arm, c.seed) for c in configs] == [
        (arm, s) for s in (0, 1) for arm in ("on-policy", "replay", "replay-plain")
    ]
    by_arm = {c.arm: c for c in configs if c.seed == 0}
    assert by_arm["replay"].buffer.positive_bias == 0.5
    assert by_arm["replay-plain"].buffer.positive_bias == 0.0
    assert by_arm["replay-plain"].lineage == "chain_sum-replay-plain-s0"
    assert by_arm["replay-plain"].buffer.capacity == by_arm["replay"].buffer.capacity
    with pytest.raises(ReplayRLError, match="already has 0"):
        lineage_configs(
            config_path=preset,
            seeds=1,
            out_dir=tmp_path,
            plain_replay=True,
            overrides=["buffer.positive_bias=0"],
        )


def test_the_measured_axis_is_the_device_clock_only_when_every_lineage_has_it():
    from replayrl.experiments.compare import CPU_SECONDS, DEVICE_SECONDS, measured_axis

    def clocks(c: LineageCurve, share: float) -> LineageCurve:
        other = dict(
            seconds=tuple(share * s for s in c.seconds),
            generation_seconds_total=share * c.generation_seconds_total,
            training_seconds_total=share * c.training_seconds_total,
        )
        return dataclasses.replace(c, cpu_clock=dict(other), device_clock=other)

    gpu = [clocks(c, 0.5) for c in known_curves()]
    on_device, label = measured_axis(gpu, {"gpu"})
    assert label == DEVICE_SECONDS
    assert on_device[0].seconds == tuple(0.5 * s for s in gpu[0].seconds)
    assert all(c.device_clock is None and c.cpu_clock is None for c in on_device)
    # One lineage without the device clock: on a CPU machine the CPU clock, on a GPU wall.
    mixed = [*gpu[:-1], dataclasses.replace(gpu[-1], device_clock=None)]
    assert measured_axis(mixed, {"cpu"})[1] == CPU_SECONDS
    curves, label = measured_axis(mixed, {"gpu"})
    assert label == "GPU-seconds" and curves[0].seconds == gpu[0].seconds
