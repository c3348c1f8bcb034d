"""Ages and steps since last use in gradient steps, on hand-built arrays (S > 1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replayrl.core.staleness import (
    gradient_step,
    sample_ages,
    steps_since_last_use,
    summarize_ages,
    summarize_since_last_use,
)

pytestmark = pytest.mark.unit

S = 3


def test_gradient_step_of_the_kth_step_of_the_iteration_training_policy_v():
    # Iteration t trains v = t - 1: its steps are (t - 1)·S + k.
    assert gradient_step(
        policy_version=np.array([0, 0, 2, 3]),
        train_step=np.array([0, 2, 1, 2]),
        steps_per_iteration=S,
    ).tolist() == [0, 2, 7, 11]
    with pytest.raises(ValueError, match="train_step"):
        gradient_step(policy_version=1, train_step=S, steps_per_iteration=S)


def test_ages_are_in_gradient_steps_not_policy_versions():
    # The docstring's example: a row of v2 used in the third step (k = 2) of the iteration
    # after its creation (v_use = 3) has age S + 2; the same row in the first step of its own
    # iteration has age 0, in its last step S - 1; two iterations later, first step, 2·S.
    ages = sample_ages(
        row_policy_version=np.array([2, 2, 2, 2]),
        policy_version_at_use=np.array([3, 2, 2, 4]),
        train_step=np.array([2, 0, 2, 0]),
        steps_per_iteration=S,
    )
    assert ages.tolist() == [S + 2, 0, S - 1, 2 * S]
    # One policy version at use for the whole draw (how `steps.train` calls it).
    assert sample_ages(
        row_policy_version=np.array([3, 1]),
        policy_version_at_use=3,
        train_step=np.array([1, 2]),
        steps_per_iteration=S,
    ).tolist() == [1, 2 * S + 2]
    assert summarize_ages(ages) == {"mean": (S + 2 + 0 + S - 1 + 2 * S) / 4, "max": 2 * S}
    assert all(math.isnan(v) for v in summarize_ages(np.array([])).values())


def test_steps_since_last_use_on_a_hand_built_usage_history():
    # History: "a" used at steps 2 and 6, "b" at step 4, "c" never. This iteration (v = 3,
    # steps 9, 10, 11) draws a@9, b@9, c@10, a@11, c@11 and, with replacement, b twice at 10.
    gaps = steps_since_last_use(
        rollout_id=np.array(["a", "b", "c", "b", "b", "a", "c"], dtype=object),
        step=np.array([9, 9, 10, 10, 10, 11, 11]),
        history_id=np.array(["a", "b", "a"], dtype=object),
        history_step=np.array([6, 4, 2]),
    )
    # a: 9 - 6; b: 9 - 4; c: first use; b at 10: 10 - 9, then 0 for its second copy (last
    # used by the first, in the same step); a at 11: 11 - 9; c at 11: 11 - 10.
    assert gaps.tolist() == [3, 5, -1, 1, 0, 2, 1]
    summary = summarize_since_last_use(gaps)
    assert summary["frac_first_use"] == pytest.approx(1 / 7)
    assert summary["mean"] == pytest.approx((3 + 5 + 1 + 0 + 2 + 1) / 6)
    assert summary["p50"] == 1.5


def test_steps_since_last_use_without_history_and_when_empty():
    gaps = steps_since_last_use(
        rollout_id=np.array(["x", "y", "x"]),
        step=np.array([0, 0, 2]),
        history_id=np.array([], dtype=object),
        history_step=np.array([], dtype=np.int64),
    )
    assert gaps.tolist() == [-1, -1, 2]
    first = summarize_since_last_use(np.array([-1, -1]))
    assert first["frac_first_use"] == 1.0 and math.isnan(first["mean"]) and math.isnan(first["p50"])
    assert (
        steps_since_last_use(
            rollout_id=np.array([]),
            step=np.array([]),
            history_id=np.array([]),
            history_step=np.array([]),
        ).tolist()
        == []
    )
