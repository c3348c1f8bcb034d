"""The arithmetic of the replay vs on-policy comparison, on curves whose answers are known:
compute to first reach a target, ratios, accuracy at equal compute, seed bands."""

from __future__ import annotations

import math

import pytest

from replayrl.comparison import (
    LineageCurve,
    arm_curve,
    compare,
    config_differences,
    first_reach,
    markdown,
    measured_mu,
    value_at,
)
from replayrl.errors import ReplayRLError

pytestmark = pytest.mark.unit
EVALS = (0, 10, 20, 30)


def curve(arm: str, seed: int, pass1, *, evals=EVALS) -> LineageCurve:
    """On-policy: 256 rollouts generated and trained per iteration, 1000 tokens, 1.5 s of
    generation + 0.5 s of training (μ = 3). Replay: half the fresh rollouts at the same cost
    per rollout (128, 500 tokens, 0.75 s) and the same 256 trained rows (0.5 s)."""
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


def test_arm_curve_averages_seeds_per_iteration_with_a_min_max_band():
    a = arm_curve(known_curves()[:2], mu=5.3)
    assert a.iterations == EVALS and a.seeds == (0, 1)
    assert a.pass1_mean == pytest.approx((0.20, 0.32, 0.42, 0.52))
    assert a.pass1_min == pytest.approx((0.20, 0.30, 0.40, 0.50))
    assert a.pass1_max == pytest.approx((0.20, 0.34, 0.44, 0.54))
    assert a.compute["cost_units"][-1] == pytest.approx(30 * (5.3 * 256 + 256))


def test_seeds_with_different_evaluations_are_compared_on_the_common_ones():
    short = curve("replay", 2, (0.2, 0.3, 0.4), evals=(0, 10, 20))
    a = arm_curve([known_curves()[2], short], mu=1.0)
    assert a.iterations == (0, 10, 20)
    assert a.final_pass1 == pytest.approx((0.55, 0.4))


def test_compare_gives_the_known_first_reach_ratios_and_equal_compute_accuracy():
    r = compare(known_curves(), mu=5.3)
    assert r["target_pass1"] == pytest.approx(0.52)  # on-policy's final mean
    on, rep = r["arms"]["on-policy"], r["arms"]["replay"]
    # On-policy reaches its own final mean at iteration 30; replay at iteration 20.
    assert on["to_target"] == pytest.approx(
        {"generated_tokens": 30_000, "seconds": 60.0, "cost_units": 30 * 6.3 * 256}
    )
    assert rep["to_target"] == pytest.approx(
        {"generated_tokens": 10_000, "seconds": 25.0, "cost_units": 20 * (5.3 * 128 + 256)}
    )
    assert rep["ratio_to_on_policy"]["generated_tokens"] == pytest.approx(1 / 3)
    assert rep["ratio_to_on_policy"]["seconds"] == pytest.approx(25 / 60)
    assert rep["ratio_to_on_policy"]["cost_units"] == pytest.approx(18688 / 48384)
    assert on["ratio_to_on_policy"]["seconds"] == pytest.approx(1.0)
    # Equal compute: the replay arm's total (15,000 tokens) bounds the common budget;
    # on-policy's mean curve there is half-way between iterations 10 and 20.
    eq = {arm: r["arms"][arm]["at_equal_compute"]["generated_tokens"] for arm in r["arms"]}
    assert eq["on-policy"]["budget"] == eq["replay"]["budget"] == 15_000
    assert eq["on-policy"]["pass1"] == pytest.approx(0.37)
    assert eq["replay"]["pass1"] == pytest.approx(0.59)
    assert rep["final_pass1"]["mean"] == pytest.approx(0.59)
    assert rep["final_pass1"]["std"] == pytest.approx(0.01)
    assert rep["final_pass_at_k"]["mean"] == pytest.approx(0.79)
    assert rep["final_entropy"]["mean"] == pytest.approx(0.2)
    assert on["measured_mu"] == pytest.approx(3.0) and rep["measured_mu"] == pytest.approx(3.0)
    assert rep["rollouts_trained_to_target"] == pytest.approx(20 * 256)
    assert [s["to_target"]["generated_tokens"] for s in on["per_seed"]] == [None, 30_000]


def test_a_given_target_and_mu_change_the_cost_axis_only_as_modelled():
    r = compare(known_curves(), target=0.30, mu=0.0)
    assert r["target_source"] == "given"
    # μ = 0: cost units are rows trained on, the same for both arms per iteration.
    assert r["arms"]["replay"]["to_target"]["cost_units"] == 10 * 256
    assert r["arms"]["replay"]["ratio_to_on_policy"]["cost_units"] == pytest.approx(1.0)


def test_unreached_target_is_none_and_shows_as_not_reached():
    r = compare(known_curves(), target=0.95)
    assert r["arms"]["replay"]["to_target"]["seconds"] is None
    assert r["arms"]["replay"]["ratio_to_on_policy"]["seconds"] is None
    table = markdown(r, seconds_label="CPU seconds")
    assert "not reached" in table and "CPU seconds" in table


def test_markdown_table_has_one_row_per_arm_with_the_ratios():
    table = markdown(compare(known_curves(), mu=5.3), seconds_label="CPU seconds")
    row = next(line for line in table.splitlines() if line.startswith("| replay | 2 |"))
    assert "10,000" in row and "0.33" in row and "0.42" in row  # tokens, ratios
    assert "0.590 ± 0.010" in table and "μ = 5.3" in table


def test_without_on_policy_a_target_is_needed():
    with pytest.raises(ReplayRLError, match="--target"):
        compare(known_curves()[2:])
    assert compare(known_curves()[2:], target=0.5)["arms"]["replay"]["to_target"]["seconds"] == 25


def test_measured_mu_and_config_differences():
    assert measured_mu(known_curves()[0]) == pytest.approx(3.0)
    params = [{"seed": "0", "train.lr": "1e-4", "storage.run_root": "a"}]
    params.append({"seed": "1", "train.lr": "1e-4", "storage.run_root": "b"})
    assert config_differences(params) == []
    params.append({"seed": "2", "train.lr": "3e-4", "storage.run_root": "c"})
    assert config_differences(params) == ["train.lr"]
