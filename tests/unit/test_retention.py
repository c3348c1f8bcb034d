"""Retention policy on hand-made arrays: FIFO, positive bias, staleness, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from replayrl.buffer.retention import freshness_order, retained_mask, retention_parts

pytestmark = pytest.mark.unit

# The docstring's worked example: 6 rows of 3 iterations.
ITERATION = np.array([0, 0, 1, 1, 2, 2])
TIEBREAK = np.array(["a", "b", "c", "d", "e", "f"], dtype=object)
CORRECT = np.array([True, False, True, False, False, False])


def mask(**overrides):
    args = dict(
        iteration=ITERATION,
        tiebreak=TIEBREAK,
        policy_version=ITERATION,
        correct=CORRECT,
        capacity=4,
        current_policy_version=2,
    )
    args.update(overrides)
    return retained_mask(**args).tolist()


def test_worked_example_plain_fifo():
    assert mask() == [False, False, True, True, True, True]


def test_worked_example_positive_bias():
    assert mask(positive_bias=0.5) == [True, False, True, False, True, True]


def test_worked_example_bias_part_is_the_correct_rows_beyond_the_fifo_part():
    fifo, bias = retention_parts(
        iteration=ITERATION,
        tiebreak=TIEBREAK,
        policy_version=ITERATION,
        correct=CORRECT,
        capacity=4,
        positive_bias=0.5,
        current_policy_version=2,
    )
    assert fifo.tolist() == [False, False, False, False, True, True]
    assert bias.tolist() == [True, False, True, False, False, False]
    # Plain FIFO has no bias part.
    _, none = retention_parts(
        iteration=ITERATION,
        tiebreak=TIEBREAK,
        policy_version=ITERATION,
        correct=CORRECT,
        capacity=4,
        current_policy_version=2,
    )
    assert not none.any()


def test_worked_example_max_staleness():
    assert mask(positive_bias=0.5, max_staleness=1) == [False, False, True, False, True, True]


def test_fifo_ties_broken_by_ascending_tiebreak():
    # Capacity 3 cuts iteration 1 in half: its "c" row beats "d".
    assert mask(capacity=3) == [False, False, True, False, True, True]


def test_result_does_not_depend_on_row_order():
    perm = np.array([5, 2, 0, 4, 1, 3])
    shuffled = retained_mask(
        iteration=ITERATION[perm],
        tiebreak=TIEBREAK[perm],
        policy_version=ITERATION[perm],
        correct=CORRECT[perm],
        capacity=3,
        positive_bias=0.5,
        current_policy_version=2,
    )
    expected = np.array(mask(capacity=3, positive_bias=0.5))
    assert shuffled.tolist() == expected[perm].tolist()


def test_capacity_above_rows_keeps_everything():
    assert mask(capacity=100) == [True] * 6


def test_full_bias_keeps_only_correct_rows():
    assert mask(positive_bias=1.0) == [True, False, True, False, False, False]


def test_bias_share_not_backfilled_with_incorrect_rows():
    # One old correct row exists for two reserved slots: 3 rows kept, not 4.
    result = mask(correct=np.array([False, False, True, False, False, False]), positive_bias=0.5)
    assert result == [False, False, True, False, True, True]


def test_fifo_share_rounds_half_up():
    # (1 - 0.5) * 5 = 2.5 -> 3 FIFO rows (4, 5, 2), then 2 correct others: only 0 is left.
    assert mask(capacity=5, positive_bias=0.5) == [True, False, True, False, True, True]


def test_staleness_applies_before_capacity():
    # Everything older than current - 0 is dropped even with room to spare.
    assert mask(capacity=100, max_staleness=0) == [False, False, False, False, True, True]


def test_integer_tiebreak_and_empty_input():
    assert freshness_order(
        iteration=np.array([1, 2, 2]), tiebreak=np.array([0, 9, 3])
    ).tolist() == [
        2,
        1,
        0,
    ]
    empty = retained_mask(
        iteration=np.array([], dtype=np.int64),
        tiebreak=np.array([], dtype=object),
        policy_version=np.array([], dtype=np.int64),
        correct=np.array([], dtype=bool),
        capacity=1,
        current_policy_version=0,
    )
    assert empty.shape == (0,)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"capacity": 0}, "capacity"),
        ({"positive_bias": 1.5}, "positive_bias"),
        ({"positive_bias": -0.1}, "positive_bias"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"correct": np.array([True])}, "correct"),
    ],
)
def test_invalid_arguments_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        mask(**overrides)
