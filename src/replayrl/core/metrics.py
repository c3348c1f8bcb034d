"""Evaluation statistics: pass@k and percentiles.

Numbers in, numbers out. This module knows nothing about models, tasks, rewards or
trackers; the evaluate step counts correct samples per problem and passes the counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def pass_at_k(*, num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k for one problem (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code"): the probability that at least one of k samples drawn without
    replacement from the n generated is correct, 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials.
    Example: n=5, c=2, k=2 -> 1 - (1 - 2/4)(1 - 2/5) = 1 - 0.5 * 0.6 = 0.7.

    Raises ValueError if k < 1, k > n, or c is outside [0, n].
    """
    n, c = num_samples, num_correct
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > n:
        raise ValueError(
            f"pass@{k} needs at least {k} samples per problem, got {n}; sample more or lower k"
        )
    if not 0 <= c <= n:
        raise ValueError(f"num_correct must be in [0, {n}], got {c}")
    if n - c < k:
        # Every draw of k samples includes a correct one.
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(*, num_correct: Sequence[int], num_samples: int, k: int) -> float:
    """Mean of pass_at_k over problems, each with `num_samples` samples and
    `num_correct[i]` correct ones. Raises ValueError for an empty problem list: an
    evaluation over nothing has no accuracy, and 0.0 would look like a real result."""
    if len(num_correct) == 0:
        raise ValueError("mean_pass_at_k got no problems; the evaluation set is empty")
    return float(
        np.mean([pass_at_k(num_samples=num_samples, num_correct=int(c), k=k) for c in num_correct])
    )


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The q-th percentile (q in [0, 100], linear interpolation) of `values`; NaN when
    `values` is empty ("no value": the record path logs no metric for it, in every engine)."""
    if not 0 <= q <= 100:
        raise ValueError(f"q is a percentile in [0, 100], got {q}")
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.size == 0:
        return math.nan
    return float(np.percentile(array, q))
