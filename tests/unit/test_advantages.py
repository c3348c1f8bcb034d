"""Advantages against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from replayrl.core.advantages import (
    LOSS_NAMES,
    asymre_advantages,
    compute_advantages,
    grpo_advantages,
)

pytestmark = pytest.mark.unit


def test_grpo_one_correct_of_four():
    # mean 0.25; population var = (0.75^2 + 3 * 0.25^2) / 4 = 0.1875; std = 0.4330127
    # correct: 0.75 / 0.4330127 = 1.7320508; wrong: -0.25 / 0.4330127 = -0.5773503
    adv = grpo_advantages(rewards=np.array([1.0, 0.0, 0.0, 0.0]), group_ids=np.array([7, 7, 7, 7]))
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, [1.7320508, -0.5773503, -0.5773503, -0.5773503], rtol=1e-5)


def test_grpo_uses_population_std_not_sample_std():
    # [1, 0]: mean 0.5, population std 0.5 -> +-0.5 / 0.5 = +-1 (sample std 0.7071 would give 0.7071)
    adv = grpo_advantages(rewards=np.array([1.0, 0.0]), group_ids=np.array([0, 0]))
    np.testing.assert_allclose(adv, [1.0, -1.0], rtol=1e-5)


def test_grpo_groups_are_independent_and_order_is_kept():
    # Interleaved string ids: group "a" = [1, 0] -> [+1, -1]; group "b" = [0, 0, 1, 1]
    # -> mean 0.5, std 0.5 -> [-1, -1, +1, +1]. Output follows input order.
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    group_ids = np.array(["a", "b", "a", "b", "b", "b"])
    adv = grpo_advantages(rewards=rewards, group_ids=group_ids)
    np.testing.assert_allclose(adv, [1.0, -1.0, -1.0, -1.0, 1.0, 1.0], rtol=1e-5)


def test_grpo_group_of_one_and_all_equal_group_are_exactly_zero():
    # 0.1 * 3 / 3 = 0.10000000000000002 in float64, so plain (r - mean) / (std + eps) would
    # give a nonzero residue of about -1e-11; an all-equal group must be exactly 0.
    rewards = np.array([0.1, 0.1, 0.1, 5.0, 1.0, 0.0])
    group_ids = np.array([1, 1, 1, 2, 3, 3])
    adv = grpo_advantages(rewards=rewards, group_ids=group_ids)
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(adv[4:], [1.0, -1.0], rtol=1e-5)


def test_asymre_all_equal_group_gets_plus_delta():
    # r - (mean + delta_v) = 1 - (1 - 0.1) = +0.1 for every member
    adv = asymre_advantages(
        rewards=np.array([1.0, 1.0, 1.0, 1.0]), group_ids=np.array([0, 0, 0, 0])
    )
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, [0.1, 0.1, 0.1, 0.1], rtol=1e-6)


def test_asymre_mixed_group_hand_values():
    # group "p": [1, 0, 0, 0], mean 0.25, baseline 0.25 - 0.1 = 0.15 -> [0.85, -0.15, -0.15, -0.15]
    # group "q": [0.5, 1.0], mean 0.75, baseline 0.65 -> [-0.15, 0.35]. No std scaling.
    rewards = np.array([1.0, 0.5, 0.0, 0.0, 1.0, 0.0])
    group_ids = np.array(["p", "q", "p", "p", "q", "p"])
    adv = asymre_advantages(rewards=rewards, group_ids=group_ids)
    np.testing.assert_allclose(adv, [0.85, -0.15, -0.15, -0.15, 0.35, -0.15], rtol=1e-6)


def test_asymre_delta_v_zero_is_plain_mean_centring():
    adv = asymre_advantages(rewards=np.array([2.0, 0.0]), group_ids=np.array([0, 0]), delta_v=0.0)
    np.testing.assert_allclose(adv, [1.0, -1.0])


def test_nan_reward_raises_with_count():
    with pytest.raises(ValueError, match="2 of 5 rewards are NaN"):
        grpo_advantages(
            rewards=np.array([1.0, np.nan, 0.0, np.nan, 1.0]), group_ids=np.zeros(5, dtype=int)
        )


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="one group id per reward"):
        asymre_advantages(rewards=np.array([1.0, 0.0]), group_ids=np.array([0]))


def test_empty_input_gives_empty_float32():
    adv = grpo_advantages(rewards=np.array([]), group_ids=np.array([], dtype=int))
    assert adv.shape == (0,) and adv.dtype == np.float32


def test_compute_advantages_dispatches_by_name():
    rewards, group_ids = np.array([1.0, 0.0]), np.array([0, 0])
    np.testing.assert_allclose(
        compute_advantages(loss="grpo", rewards=rewards, group_ids=group_ids),
        [1.0, -1.0],
        rtol=1e-5,
    )
    # asymre: mean 0.5, baseline 0.5 - 0.2 = 0.3 -> [0.7, -0.3]
    np.testing.assert_allclose(
        compute_advantages(loss="asymre", rewards=rewards, group_ids=group_ids, delta_v=-0.2),
        [0.7, -0.3],
        rtol=1e-6,
    )
    assert set(LOSS_NAMES) == {"grpo", "asymre"}


def test_compute_advantages_unknown_loss_names_valid_ones():
    with pytest.raises(ValueError, match="grpo, asymre"):
        compute_advantages(loss="ppo", rewards=np.array([1.0]), group_ids=np.array([0]))
