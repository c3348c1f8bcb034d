"""pass@k and percentile on small hand cases."""

from __future__ import annotations

import math

import pytest

from replayrl.core.metrics import mean_pass_at_k, pass_at_k, percentile

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # 1 - C(3,1)/C(5,1) = 1 - 3/5
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 0, 3, 0.0),  # no correct sample: never passes
        (5, 5, 3, 1.0),  # all correct: always passes
        (5, 3, 3, 1.0),  # n - c = 2 < k = 3: every draw of 3 holds a correct one
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_hand_cases(n, c, k, expected):
    assert pass_at_k(num_samples=n, num_correct=c, k=k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomial_formula():
    # The product form must equal 1 - C(n-c, k) / C(n, k) exactly where the binomials fit.
    for n, c, k in [(16, 3, 4), (16, 1, 16), (10, 9, 1), (200, 7, 10)]:
        expected = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(num_samples=n, num_correct=c, k=k) == pytest.approx(expected, rel=1e-12)


def test_pass_at_k_k_larger_than_n_raises():
    with pytest.raises(ValueError, match="at least 4 samples"):
        pass_at_k(num_samples=3, num_correct=1, k=4)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(num_samples=3, num_correct=4, k=1)
    with pytest.raises(ValueError, match="k must be >= 1"):
        pass_at_k(num_samples=3, num_correct=1, k=0)


def test_mean_pass_at_k():
    # n=5, k=1: c=2 -> 0.4, c=0 -> 0, c=5 -> 1; mean 1.4 / 3
    assert mean_pass_at_k(num_correct=[2, 0, 5], num_samples=5, k=1) == pytest.approx(1.4 / 3)


def test_mean_pass_at_k_empty_raises():
    with pytest.raises(ValueError, match="empty"):
        mean_pass_at_k(num_correct=[], num_samples=5, k=1)


def test_percentile():
    assert math.isnan(percentile([], 50))  # no value: not logged
    assert percentile([1, 2, 3, 4], 50) == 2.5  # linear interpolation between 2 and 3
    assert percentile(list(range(101)), 95) == 95.0
    assert percentile([7], 95) == 7.0
    with pytest.raises(ValueError, match="0, 100"):
        percentile([1.0], 150)
