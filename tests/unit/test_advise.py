"""The advisor against Theorem 4.5 and its closed form (App. 9.3.2), computed here
independently from the paper's formulas; its edges (ρ = 0, α >= 1/2, α = 0, μ = 0); and the
loop settings it names, which must pass the config's own validation."""

from __future__ import annotations

import json
import math

import pytest

from replayrl.cli.main import main
from replayrl.config import load_config
from replayrl.errors import ReplayRLError
from replayrl.experiments.advisor import (
    advise,
    closed_form,
    discrete_argmin,
    numerical_argmin,
    objective,
    render,
    variance_cost,
)

pytestmark = pytest.mark.unit
TINY = dict(batch_size=64, steps_per_iteration=4, samples_per_prompt=8)  # S·B = 256, G = 8
GRID = [
    (mu, rho, alpha)
    for mu in (0.5, 5.28, 6.84, 20.0)
    for rho in (0.01, 0.1, 0.5, 1.0)
    for alpha in (0.05, 0.25, 0.45)
]


def paper(mu, rho, alpha):
    """App. 9.3.2 as printed: y* = (−α + sqrt(α² + μρ(1 − 2α)))/ρ, x* = y*²/(2α(μ + y*))."""
    y = (-alpha + math.sqrt(alpha**2 + mu * rho * (1 - 2 * alpha))) / rho
    return y * y / (2 * alpha * (mu + y)), y


@pytest.mark.parametrize("mu,rho,alpha", GRID)
def test_closed_form_is_the_papers_and_satisfies_theorem_4_5(mu, rho, alpha):
    x, y = closed_form(mu=mu, rho=rho, alpha=alpha)
    px, py = paper(mu, rho, alpha)
    assert (x, y) == (pytest.approx(px, rel=1e-9), pytest.approx(py, rel=1e-9))
    assert y == pytest.approx(math.sqrt(mu / (rho + 1 / x)), rel=1e-9)  # y* = sqrt(μ/(ρ+1/x*))
    # The numerical argmin of the continuous objective agrees to 1e-6, and x* is a minimum.
    assert numerical_argmin(mu=mu, rho=rho, alpha=alpha) == pytest.approx(x, rel=1e-6)
    f = objective(x, mu=mu, rho=rho, alpha=alpha)
    assert f < objective(x * 1.01, mu=mu, rho=rho, alpha=alpha)
    assert f < objective(x / 1.01, mu=mu, rho=rho, alpha=alpha)


@pytest.mark.parametrize("mu,rho,alpha", GRID[::3])
def test_discrete_sigma_bar_optimum_sits_at_or_above_the_continuous_one(mu, rho, alpha):
    x, _ = closed_form(mu=mu, rho=rho, alpha=alpha)
    h = discrete_argmin(mu=mu, rho=rho, alpha=alpha, x_hint=x)
    # Brute force over whole steps well past the search range.
    f = {
        k: objective(k, mu=mu, rho=rho, alpha=alpha, discrete=True)
        for k in range(1, 10 * int(x) + 200)
    }
    assert h == min(f, key=f.get)
    assert h >= math.floor(x)


def test_discrete_optimum_converges_relatively_to_the_closed_form_for_long_horizons():
    x, _ = closed_form(mu=6.84, rho=0.01, alpha=0.01)  # x* ≈ 977 steps
    h = discrete_argmin(mu=6.84, rho=0.01, alpha=0.01, x_hint=x)
    assert x > 900 and 0 <= (h - x) / x < 0.01
    x, _ = closed_form(mu=6.84, rho=0.5, alpha=0.25)  # x* ≈ 1.04: the whole-step σ̄ says 2
    assert discrete_argmin(mu=6.84, rho=0.5, alpha=0.25, x_hint=x) == 2


def test_rho_zero_is_the_limit_of_the_closed_form():
    mu, alpha = 6.84, 0.2
    x, y = closed_form(mu=mu, rho=0.0, alpha=alpha)
    assert y == pytest.approx(mu * (1 - 2 * alpha) / (2 * alpha))  # 10.26
    assert (x, y) == pytest.approx(paper(mu, 1e-7, alpha), rel=1e-5)
    assert numerical_argmin(mu=mu, rho=0.0, alpha=alpha) == pytest.approx(x, rel=1e-6)


@pytest.mark.parametrize("alpha", [0.5, 0.6, 1.0])
def test_alpha_at_least_half_has_no_interior_optimum(alpha):
    xs = [10.0**k for k in range(-6, 7)]
    fs = [objective(x, mu=6.84, rho=0.5, alpha=alpha) for x in xs]
    assert fs == sorted(fs)  # grows with x: the infimum is x → 0
    a = advise(mu=6.84, rho=0.5, alpha=alpha, **TINY)
    assert not a.closed_form and a.x_star == a.y_star == 0.0 == a.x_star_numerical
    assert "no interior optimum" in render(a, source="test")
    # The loop's shortest horizon is S, so the settings are those for x = S.
    assert a.x == 4.0 and a.y_target == pytest.approx(math.sqrt(6.84 / (0.5 + 1 / 4)))
    with pytest.raises(ReplayRLError, match="α < 1/2"):
        closed_form(mu=6.84, rho=0.5, alpha=alpha)


def test_worked_example_settings_for_the_tiny_shape():
    a = advise(mu=6.84, rho=0.5, alpha=0.25, **TINY)
    assert (a.x_star, a.y_star) == pytest.approx(paper(6.84, 0.5, 0.25))
    # x* ≈ 1.04 < S = 4: the horizon is S and y is re-optimised there: sqrt(6.84/0.75) = 3.02,
    # nearest whole prompts: 11 × 8 = 88 rollouts, y = 256/88 = 2.91; N = R_iter (x = S).
    assert a.y_target == pytest.approx(3.0199, abs=1e-4)
    assert (a.prompts_per_iteration, a.rollouts_per_iteration, a.buffer_capacity) == (11, 88, 88)
    assert (a.x, a.y) == (4.0, pytest.approx(256 / 88))
    assert a.settings == {"rollout.prompts_per_iteration": 11, "buffer.capacity": 88}
    assert 0 < a.variance_cost_vs_on_policy < 1


def test_one_step_per_iteration_follows_the_per_step_mapping():
    # S = 1: R_iter = R = B / y*, N = x*·R, exactly the theorem's quantities up to rounding.
    a = advise(
        mu=6.84, rho=0.1, alpha=0.1, batch_size=600, steps_per_iteration=1, samples_per_prompt=4
    )
    x, y = paper(6.84, 0.1, 0.1)  # x* = 15.7, y* = 6.47
    assert a.prompts_per_iteration == round(600 / y / 4)  # 23
    # N is the best capacity for the realised y (600/92, not y*): V·c in x is smallest at
    # x = (1 - 2α) / (2α(1/y + ρ)), within a row of it, and close to x*.
    x_for_y = (1 - 0.2) / (0.2 * (92 / 600 + 0.1))
    assert abs(a.buffer_capacity - x_for_y * 92) < 1
    assert a.y == pytest.approx(y, rel=0.03) and a.x == pytest.approx(x, rel=0.01)
    assert a.sample_with_replacement  # B = 600 > R_iter = 92
    assert "sample_with_replacement: true" in render(a, source="test")


@pytest.mark.parametrize(
    "mu,rho,alpha,shape",
    [
        (6.84, 0.5, 0.25, TINY),
        (6.84, 0.1, 0.1, TINY),
        (20.0, 0.05, 0.1, TINY),
        (0.5, 0.5, 0.25, TINY),
        (5.28, 0.0, 0.2, dict(batch_size=60, steps_per_iteration=2, samples_per_prompt=16)),
    ],
)
def test_settings_pass_the_configs_validation(mu, rho, alpha, shape):
    a = advise(mu=mu, rho=rho, alpha=alpha, **shape)
    sets = [
        f"train.batch_size={shape['batch_size']}",
        f"train.steps_per_iteration={shape['steps_per_iteration']}",
        f"rollout.samples_per_prompt={shape['samples_per_prompt']}",
    ]
    sets += [f"{k}={str(v).lower()}" for k, v in a.settings.items()]
    cfg = load_config(overrides=sets, arm="on-policy" if a.on_policy else "replay")
    assert cfg.replay_ratio == pytest.approx(a.y)
    assert cfg.train.steps_per_iteration * cfg.buffer.capacity / cfg.rollouts_per_iteration == a.x


@pytest.mark.parametrize("mu", [0.0, 0.3, 0.5])
def test_cheap_generation_recommends_strict_on_policy(mu):
    a = advise(mu=mu, rho=0.5, alpha=0.25, **TINY)
    assert a.on_policy and a.y == 1.0 and a.y_target <= 1
    assert a.prompts_per_iteration * 8 == a.buffer_capacity == 256
    assert "strict on-policy" in render(a, source="test")


def test_replay_grows_with_mu_and_shrinks_with_rho_and_alpha():
    def y(mu=6.84, rho=0.1, alpha=0.2):
        return closed_form(mu=mu, rho=rho, alpha=alpha)[1]

    assert y(mu=2) < y(mu=6.84) < y(mu=20)
    assert y(rho=0.0) > y(rho=0.1) > y(rho=1.0)
    assert y(alpha=0.05) > y(alpha=0.2) > y(alpha=0.45)


def test_bad_inputs_say_what_to_change():
    with pytest.raises(ReplayRLError, match=r"ρ must be in \[0, 1\]"):
        advise(mu=6.84, rho=1.5, alpha=0.25, **TINY)
    with pytest.raises(ReplayRLError, match="no finite x\\*"):
        advise(mu=6.84, rho=0.5, alpha=0.0, **TINY)
    with pytest.raises(ReplayRLError, match="μ must be"):
        advise(mu=-1.0, rho=0.5, alpha=0.25, **TINY)


def test_cli_json_is_the_closed_form(capsys):
    assert main(["advise", "--mu", "6.84", "--rho", "0.5", "--alpha", "0.25", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    x, y = paper(6.84, 0.5, 0.25)
    assert doc["x_star"] == pytest.approx(x, rel=1e-12) and doc["y_star"] == pytest.approx(
        y, rel=1e-12
    )
    assert doc["x_star_numerical"] == pytest.approx(x, rel=1e-6)
    assert doc["settings"] == {"rollout.prompts_per_iteration": 11, "buffer.capacity": 88}


def test_cli_reads_the_shape_from_a_config_and_refuses_bad_input(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "train: {batch_size: 60, steps_per_iteration: 1}\nrollout: {samples_per_prompt: 4}\n"
    )
    assert (
        main(["advise", "--mu", "6.84", "--rho", "0.1", "--alpha", "0.1", "--config", str(cfg)])
        == 0
    )
    out = capsys.readouterr().out
    assert "B = 60" in out and "rollout.prompts_per_iteration = 2 " in out
    assert main(["advise", "--mu", "6.84", "--rho", "2", "--alpha", "0.25"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ρ must be in [0, 1]" in err
    with pytest.raises(SystemExit):  # ρ and α are required: nothing measures them
        main(["advise", "--mu", "6.84"])


def test_the_closed_form_of_the_issue_still_holds():
    x, y = closed_form(mu=6.84, rho=0.5, alpha=0.25)
    assert (round(x, 4), round(y, 4)) == (1.0391, 2.1627)


def test_a_rounded_setting_worse_than_on_policy_is_not_recommended():
    # Nearest-y rounding then raising N to B recommended replay here at 1.42x on-policy's
    # variance x cost. The paper's B = 60 with G = 16 is not whole groups: on-policy advice
    # names the nearest batch that is (64), instead of raising.
    a = advise(
        mu=6.84, rho=1.0, alpha=0.49, batch_size=60, steps_per_iteration=1, samples_per_prompt=16
    )
    assert a.on_policy and a.variance_cost_vs_on_policy == 1.0
    assert a.settings == {
        "train.batch_size": 64,
        "rollout.prompts_per_iteration": 4,
        "buffer.capacity": 64,
    }
    text = render(a, source="test")
    assert "strict on-policy" in text and "train.batch_size = 64" in text
    # Every replay setting the loop could realise is worse there, by the same objective.
    on = variance_cost(1.0, 1.0, mu=6.84, rho=1.0, alpha=0.49)
    for p in (1, 2, 3):
        for n in range(max(16 * p, 60), 400):
            assert variance_cost(n / (16 * p), 60 / (16 * p), mu=6.84, rho=1.0, alpha=0.49) > on


def test_cheap_generation_with_a_batch_not_whole_groups_names_the_batch_to_use():
    a = advise(
        mu=0.5, rho=0.5, alpha=0.25, batch_size=10, steps_per_iteration=1, samples_per_prompt=8
    )
    assert a.on_policy and a.settings["train.batch_size"] == 8
    a = advise(
        mu=0.5, rho=0.5, alpha=0.25, batch_size=30, steps_per_iteration=2, samples_per_prompt=8
    )
    # S·B' whole groups of 8 with S = 2: B' a multiple of 4; 30 -> 32 (the tie goes up).
    assert a.on_policy and a.settings["train.batch_size"] == 32
    assert a.prompts_per_iteration == 8 and a.buffer_capacity == 64


PROPERTY_GRID = [
    (mu, rho, alpha, s, b, g)
    for mu in (0.5, 2.0, 6.84, 20.0)
    for rho in (0.0, 0.3, 1.0)
    for alpha in (0.05, 0.25, 0.49, 0.7)
    for s, b, g in ((1, 60, 16), (4, 64, 8), (2, 48, 4), (1, 7, 3))
]


@pytest.mark.parametrize("mu,rho,alpha,s,b,g", PROPERTY_GRID)
def test_the_recommendation_never_loses_to_on_policy_by_its_own_objective(mu, rho, alpha, s, b, g):
    a = advise(
        mu=mu, rho=rho, alpha=alpha, batch_size=b, steps_per_iteration=s, samples_per_prompt=g
    )
    on = variance_cost(float(s), 1.0, mu=mu, rho=rho, alpha=alpha)
    realised = variance_cost(a.x, a.y, mu=mu, rho=rho, alpha=alpha)
    assert realised <= on * (1 + 1e-12)
    assert a.variance_cost_vs_on_policy == pytest.approx(realised / on)
    if a.on_policy:
        assert a.variance_cost_vs_on_policy == 1.0 and (a.x, a.y) == (float(s), 1.0)
        assert (s * a.on_policy_batch_size) % g == 0
    else:
        assert a.variance_cost_vs_on_policy < 1
    # The settings are what the loop realises: whole prompts, N >= R_iter and N >= B.
    batch = a.on_policy_batch_size if a.on_policy else b
    assert a.rollouts_per_iteration == g * a.prompts_per_iteration
    assert a.buffer_capacity >= max(a.rollouts_per_iteration, batch)
    assert a.x == s * a.buffer_capacity / a.rollouts_per_iteration
    assert a.y == pytest.approx(s * batch / a.rollouts_per_iteration)
    # No other whole-prompt setting near it does better (a brute-force check of the search).
    if not a.on_policy:
        best = min(
            variance_cost(s * n / (g * p), s * b / (g * p), mu=mu, rho=rho, alpha=alpha)
            for p in range(1, max(1, s * b // g) + 1)
            for n in range(max(g * p, b), max(g * p, b) + 300)
        )
        assert realised <= best * (1 + 1e-12)
