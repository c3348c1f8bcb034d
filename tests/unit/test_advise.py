"""The advisor's compute model: on-policy when generation is cheap (μ small, as on this
CPU), replay when it dominates (the paper's μ ≈ 5), and the feasible settings it names."""

from __future__ import annotations

import math

import pytest

from replayrl.advise import (
    advise,
    fit_penalty,
    optimal_replay_ratio,
    relative_cost,
    render,
)
from replayrl.errors import ReplayRLError

pytestmark = pytest.mark.unit
TINY = dict(batch_size=64, steps_per_iteration=4, samples_per_prompt=8)  # S·B = 256, G = 8


def test_formula_is_the_minimum_of_the_modelled_cost():
    y = optimal_replay_ratio(mu=5.3, rho=0.75, staleness_horizon=4)
    assert y == pytest.approx(math.sqrt(5.3))
    costs = {z: relative_cost(replay_ratio=z, mu=5.3, a=1.0) for z in (y * 0.9, y, y * 1.1)}
    assert min(costs, key=costs.get) == y
    assert relative_cost(replay_ratio=1.0, mu=5.3, a=1.0) == pytest.approx(1.0)


@pytest.mark.parametrize("mu", [0.0, 0.3, 0.5, 1.0])
def test_small_mu_recommends_strict_on_policy(mu):
    a = advise(mu=mu, **TINY)
    assert a.on_policy and a.replay_ratio == 1.0
    assert a.fresh_rollouts == a.buffer_capacity == 256
    assert "on-policy" in render(a, source="test")


def test_paper_mu_recommends_replay_with_a_buffer_of_x_star_fresh_batches():
    a = advise(mu=5.3, **TINY)
    assert not a.on_policy
    assert a.replay_ratio == pytest.approx(256 / 112)  # 14 prompts × 8: nearest feasible to 2.30
    assert (a.prompts_per_iteration, a.fresh_rollouts, a.buffer_capacity) == (14, 112, 448)
    assert a.relative_cost < 0.9
    text = render(a, source="test")
    assert "buffer.capacity = 448" in text and "6.30 on-policy" in text


def test_replay_grows_with_mu_and_shrinks_with_the_penalty():
    ys = [advise(mu=mu, **TINY).replay_ratio for mu in (2.0, 5.3, 20.0)]
    assert ys == sorted(ys) and ys[0] > 1
    assert advise(mu=5.3, rho=10.0, **TINY).on_policy


def test_fitted_penalty_inverts_the_step_model():
    a = 0.4
    y = 2.0
    q = (1 + a * y) / (1 + a)
    assert fit_penalty(steps_ratio=q, replay_ratio=y) == pytest.approx(a)
    assert fit_penalty(steps_ratio=0.9, replay_ratio=y) == 0.0
    assert math.isinf(fit_penalty(steps_ratio=2.5, replay_ratio=y))
    assert advise(mu=5.3, a=math.inf, **TINY).on_policy
    assert advise(mu=5.3, a=0.0, **TINY).replay_ratio == 8.0  # capped: the model is local


def test_bad_inputs_say_what_to_change():
    with pytest.raises(ReplayRLError, match="whole groups"):
        advise(mu=1.0, batch_size=10, steps_per_iteration=1, samples_per_prompt=8)
    with pytest.raises(ReplayRLError, match="μ must be"):
        advise(mu=-1.0, **TINY)
