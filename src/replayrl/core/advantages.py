"""Per-group advantages, fixed once when a rollout is generated.

A *group* is the G completions sampled for one prompt. Both estimators compare each
completion's reward with its group's mean, so they need only `rewards` and `group_ids`;
the buffer stores the result in the `advantage` column and training reads it back as is
(the paper fixes advantages at generation time, App. 10.2; they are not recomputed at use).

This module knows nothing about tokens, tensors, models or storage: numpy in, numpy out.
"""

from __future__ import annotations

import numpy as np

# The losses this package implements; `losses.policy_loss` dispatches on the same names.
# Kept here (numpy only) so config validation can import it without importing torch.
LOSS_NAMES: tuple[str, ...] = ("grpo", "asymre")


def _group_index(*, rewards: np.ndarray, group_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate inputs; return (rewards as float64 (N,), group index per row (N,))."""
    rewards_f64 = np.asarray(rewards, dtype=np.float64)  # (N,)
    group_ids = np.asarray(group_ids)  # (N,)
    if rewards_f64.ndim != 1 or group_ids.ndim != 1:
        raise ValueError(
            f"rewards and group_ids must be 1-D, got shapes {rewards_f64.shape} and "
            f"{group_ids.shape}"
        )
    if rewards_f64.shape != group_ids.shape:
        raise ValueError(
            f"rewards has {rewards_f64.shape[0]} entries but group_ids has "
            f"{group_ids.shape[0]}; pass one group id per reward"
        )
    num_nan = int(np.isnan(rewards_f64).sum())
    if num_nan:
        raise ValueError(
            f"{num_nan} of {rewards_f64.shape[0]} rewards are NaN; filter rows with a NaN "
            "reward before computing advantages"
        )
    # np.unique sorts, so ints and strings both work; inverse maps each row to its group.
    _, group_index = np.unique(group_ids, return_inverse=True)  # (N,)
    return rewards_f64, group_index.reshape(-1)


def _group_mean(*, rewards_f64: np.ndarray, group_index: np.ndarray) -> np.ndarray:
    """Mean reward of each row's group, broadcast back to rows. (N,)"""
    counts = np.bincount(group_index)  # (num_groups,)
    sums = np.bincount(group_index, weights=rewards_f64)  # (num_groups,)
    return (sums / counts)[group_index]  # (N,)


def grpo_advantages(*, rewards: np.ndarray, group_ids: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantage: (r - mean_group) / (std_group + eps), population std (ddof=0).

    A group of one, or a group whose rewards are all equal, carries no signal about which
    completion was better and gets advantage exactly 0 (not a rounding residue divided
    by `eps`).

    Example: rewards [1, 0, 0, 0] in one group -> mean 0.25, std sqrt(0.1875) = 0.4330,
    advantages [1.7321, -0.5774, -0.5774, -0.5774].

    Returns float32 (N,), in input order. Raises ValueError on NaN rewards or mismatched
    shapes.
    """
    rewards_f64, group_index = _group_index(rewards=rewards, group_ids=group_ids)
    if rewards_f64.size == 0:
        return np.zeros(0, dtype=np.float32)
    centred = rewards_f64 - _group_mean(rewards_f64=rewards_f64, group_index=group_index)  # (N,)
    counts = np.bincount(group_index)  # (num_groups,)
    # Two-pass variance (centre first) is exact for 0/1 rewards and stable in general.
    variance = np.bincount(group_index, weights=centred**2) / counts  # (num_groups,)
    std = np.sqrt(variance)[group_index]  # (N,)

    group_max = np.full(counts.shape, -np.inf)
    group_min = np.full(counts.shape, np.inf)
    np.maximum.at(group_max, group_index, rewards_f64)
    np.minimum.at(group_min, group_index, rewards_f64)
    constant = (group_max == group_min)[group_index]  # (N,) covers groups of one too

    advantages = np.where(constant, 0.0, centred / (std + eps))  # (N,)
    return advantages.astype(np.float32)


def asymre_advantages(
    *, rewards: np.ndarray, group_ids: np.ndarray, delta_v: float = -0.1
) -> np.ndarray:
    """Asymmetric REINFORCE advantage: r - (mean_group + delta_v), no std normalisation.

    `delta_v` shifts the baseline; the AsymRE paper uses -0.1, which makes every
    advantage 0.1 larger than plain mean-centring (an all-equal group gets +0.1 each,
    so the policy is nudged towards what it already does, a conservative bias that
    keeps training stable under replay).

    Example: rewards [1, 0, 0, 0], delta_v -0.1 -> baseline 0.25 - 0.1 = 0.15,
    advantages [0.85, -0.15, -0.15, -0.15].

    Returns float32 (N,), in input order. Raises ValueError on NaN rewards or mismatched
    shapes.
    """
    rewards_f64, group_index = _group_index(rewards=rewards, group_ids=group_ids)
    if rewards_f64.size == 0:
        return np.zeros(0, dtype=np.float32)
    baseline = _group_mean(rewards_f64=rewards_f64, group_index=group_index) + delta_v  # (N,)
    return (rewards_f64 - baseline).astype(np.float32)


def compute_advantages(
    *, loss: str, rewards: np.ndarray, group_ids: np.ndarray, delta_v: float = -0.1
) -> np.ndarray:
    """Advantages for the named loss: "grpo" -> grpo_advantages, "asymre" -> asymre_advantages.

    `delta_v` is used by "asymre" only. Raises ValueError for an unknown loss name.
    """
    if loss == "grpo":
        return grpo_advantages(rewards=rewards, group_ids=group_ids)
    if loss == "asymre":
        return asymre_advantages(rewards=rewards, group_ids=group_ids, delta_v=delta_v)
    raise ValueError(f"unknown loss {loss!r}; valid losses are {', '.join(LOSS_NAMES)}")
