"""Which rows the replay buffer keeps: FIFO capacity, positive bias, max staleness.

A pure function of a few columns (numpy arrays, one entry per stored row) to a keep mask
(`retained_mask`), or to its two parts, FIFO and positive bias (`retention_parts`). It knows
nothing about Delta tables, files or rollout contents; `replayrl.buffer.maintenance` reads the
columns, calls `retention_parts`, deletes the rows neither part keeps and reports the bias part.

The rule follows "Efficient RL Training for LLMs with Experience Replay" (Arnal et al.,
2026): a FIFO of capacity N, optionally reserving a share delta of it for the freshest
*correct* rows that the FIFO part already dropped (positive bias; the paper tried delta in
{0, 0.2, 0.5} and both delta > 0 improved over the plain buffer, §5.5, App. 10.4).
"""

from __future__ import annotations

import math

import numpy as np


def freshness_order(*, iteration: np.ndarray, tiebreak: np.ndarray) -> np.ndarray:
    """Row indices, freshest first: newest iteration first, ties by ascending `tiebreak`.

    `tiebreak` may hold numbers or strings (e.g. rollout ids); the order is deterministic
    and does not depend on the input row order when (iteration, tiebreak) pairs are unique.
    """
    iteration = np.asarray(iteration, dtype=np.int64)  # (rows,)
    # np.lexsort cannot compare Python strings in object arrays; rank them first.
    _, tiebreak_rank = np.unique(np.asarray(tiebreak), return_inverse=True)  # (rows,)
    # lexsort sorts by the last key first: iteration descending, then tiebreak ascending.
    return np.lexsort((tiebreak_rank.reshape(-1), -iteration))


def retained_mask(
    *,
    iteration: np.ndarray,
    tiebreak: np.ndarray,
    policy_version: np.ndarray,
    correct: np.ndarray,
    capacity: int,
    positive_bias: float = 0.0,
    max_staleness: int | None = None,
    current_policy_version: int,
) -> np.ndarray:
    """(rows,) bool mask, True for the rows the buffer keeps: the FIFO part or the
    positive-bias part of `retention_parts` (same arguments, same rule, worked example)."""
    fifo, bias = retention_parts(
        iteration=iteration,
        tiebreak=tiebreak,
        policy_version=policy_version,
        correct=correct,
        capacity=capacity,
        positive_bias=positive_bias,
        max_staleness=max_staleness,
        current_policy_version=current_policy_version,
    )
    return fifo | bias


def retention_parts(
    *,
    iteration: np.ndarray,
    tiebreak: np.ndarray,
    policy_version: np.ndarray,
    correct: np.ndarray,
    capacity: int,
    positive_bias: float = 0.0,
    max_staleness: int | None = None,
    current_policy_version: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Two disjoint boolean masks over rows: the FIFO part the buffer keeps, and the rows it
    keeps only for the positive bias (correct rows older than the FIFO part, which outlive
    the staleness horizon).

    Args:
        iteration: (rows,) int, the iteration that generated each row.
        tiebreak: (rows,) str or int, orders rows of one iteration (e.g. rollout ids).
        policy_version: (rows,) int, the policy version that sampled each row.
        correct: (rows,) bool, whether each row's completion was rewarded as correct.
        capacity: N, the most rows kept (>= 1).
        positive_bias: delta in [0, 1], the share of N reserved for correct rows beyond the
            FIFO part; 0 is plain FIFO (the paper tried 0, 0.2 and 0.5, §5.5).
        max_staleness: drop rows with current_policy_version - policy_version greater than
            this (in policy versions, i.e. iterations), before anything else; None keeps
            every age.
        current_policy_version: version of the policy that will train on the buffer.

    Steps, on the rows that survive the staleness cut, in freshness order (newest iteration
    first, ties by ascending tiebreak): keep the freshest round((1 - delta) * N) rows
    (rounded half up), then the freshest correct rows not already kept until N rows are
    kept. When fewer old correct rows exist, fewer than N rows are kept: the reserved share
    is never back-filled with incorrect rows, as in the paper (App. 10.4).

    Worked example, 6 rows of 3 iterations, capacity N = 4:

        index           0    1    2    3    4    5
        iteration       0    0    1    1    2    2
        tiebreak       "a"  "b"  "c"  "d"  "e"  "f"
        correct         T    F    T    F    F    F

        delta = 0   -> freshest 4:                       [F, F, T, T, T, T]
        delta = 0.5 -> freshest 2 (4, 5) plus the two
                       freshest correct others (2, 0):   [T, F, T, F, T, T]
                       of which the bias part is         [T, F, T, F, F, F]
        delta = 0.5, policy_version = iteration, current_policy_version = 2,
        max_staleness = 1 -> iteration 0 is too old:     [F, F, T, F, T, T]

    Returns:
        (fifo, bias): (rows,) bool arrays; kept = fifo | bias.
    """
    _check_settings(capacity=capacity, positive_bias=positive_bias, max_staleness=max_staleness)
    iteration = np.asarray(iteration, dtype=np.int64)  # (rows,)
    tiebreak = np.asarray(tiebreak)  # (rows,)
    policy_version = np.asarray(policy_version, dtype=np.int64)  # (rows,)
    correct = np.asarray(correct, dtype=bool)  # (rows,)
    n_rows = iteration.shape[0]
    _check_shapes(n_rows, tiebreak=tiebreak, policy_version=policy_version, correct=correct)

    keep = np.zeros(n_rows, dtype=bool)  # (rows,) the FIFO part
    bias = np.zeros(n_rows, dtype=bool)  # (rows,) kept only for the positive bias
    if n_rows == 0:
        return keep, bias
    eligible = np.ones(n_rows, dtype=bool)  # (rows,)
    if max_staleness is not None:
        eligible = (current_policy_version - policy_version) <= max_staleness

    order = freshness_order(iteration=iteration, tiebreak=tiebreak)  # (rows,) freshest first
    order = order[eligible[order]]  # (eligible rows,)
    # Half-up rounding (Python's round() rounds 2.5 to 2), so the FIFO share is predictable.
    n_fifo = int(math.floor((1.0 - positive_bias) * capacity + 0.5))
    keep[order[:n_fifo]] = True
    n_bias = capacity - n_fifo
    if n_bias > 0:
        rest = order[n_fifo:]  # (eligible rows not in the FIFO part,) freshest first
        bias[rest[correct[rest]][:n_bias]] = True
    return keep, bias


def _check_settings(*, capacity: int, positive_bias: float, max_staleness: int | None) -> None:
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 rows, got {capacity}")
    if not 0.0 <= positive_bias <= 1.0:
        raise ValueError(f"positive_bias must be in [0, 1], got {positive_bias}")
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 policy versions or None, got {max_staleness}")


def _check_shapes(n_rows: int, **arrays: np.ndarray) -> None:
    """Raise unless every one of `arrays` has shape (n_rows,), like iteration."""
    for name, array in arrays.items():
        if array.shape != (n_rows,):
            raise ValueError(f"{name} has shape {array.shape}, expected ({n_rows},) like iteration")
