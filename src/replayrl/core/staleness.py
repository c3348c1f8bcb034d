"""Staleness in the paper's unit, the gradient step: sample ages and steps since last use.

The paper ("Efficient RL Training for LLMs with Experience Replay", Arnal et al., 2026,
§3.1 and §4) counts every staleness quantity per gradient step: the age of a sample is
the gradient step that uses it minus the gradient step that created it; the staleness
horizon is x = N / R with R the fresh rollouts per gradient step; steps-since-last-use
(App. 10.3, a measure of local diversity) is, for a sampled row, the current gradient step
minus the last gradient step that used it. A lineage generates R_iter rows per iteration and
then takes S gradient steps, so R = R_iter / S and x = S·N / R_iter.

Conventions (fixed by the loop, `replayrl.engine.steps`):

- Policy version v is the policy after v iterations, i.e. after v·S gradient steps (v0 is the
  initial model). S (`train.steps_per_iteration`) is part of the config hash, so it is the
  same for every iteration of a lineage.
- Iteration t (from 1) samples its rows with policy v = t - 1 and trains v into v + 1; its
  k-th step (k = 0 .. S-1, the usage log's `train_step`) is global gradient step
  v·S + k = (t - 1)·S + k.
- A row sampled by policy v was created at gradient step v·S: the parameters that produced it
  are those the step v·S starts from.
- Age of a row at its use = (v_use - v_row)·S + k. A row used in the first step of the
  iteration that generated it has age 0.

Worked example, S = 3. Iteration 3 generates a row with policy v2 (created at step 6).
Iteration 4 trains v3 into v4 with steps 9, 10, 11; if the row is drawn in its third step
(k = 2, step 11), its age is (3 - 2)·3 + 2 = 5 = S + 2. If it had also been drawn in the first
step of iteration 3 (step 6), its steps since last use at step 11 are 11 - 6 = 5.

With a plain FIFO of N = x_iter·R_iter rows (x_iter whole iterations), the iteration with
policy v holds rows of v - x_iter + 1 .. v, so ages run from 0 to x_iter·S - 1 = x - 1
gradient steps. Rows kept by the positive bias δ (correct rows beyond the FIFO part) can be
much older: their measured age is what to look at, not x.

Numbers in, numbers out: numpy arrays of the usage log's columns. This module knows nothing
about Delta tables, models or trackers.
"""

from __future__ import annotations

import math

import numpy as np


def gradient_step(
    *,
    policy_version: np.ndarray | int,
    train_step: np.ndarray | int = 0,
    steps_per_iteration: int,
) -> np.ndarray:
    """(n,) int64 global gradient steps v·S + k of the k-th step (`train_step`) of the
    iteration that trains policy v. With k = 0 it is the step a row of policy v was created
    at. S = 3: v = 2, k = 1 -> 7."""
    if steps_per_iteration < 1:
        raise ValueError(f"steps_per_iteration must be >= 1, got {steps_per_iteration}")
    v = np.asarray(policy_version, dtype=np.int64)
    k = np.asarray(train_step, dtype=np.int64)
    if np.any(k < 0) or np.any(k >= steps_per_iteration):
        raise ValueError(f"train_step must be in [0, {steps_per_iteration}), got {k}")
    return v * steps_per_iteration + k


def sample_ages(
    *,
    row_policy_version: np.ndarray,
    policy_version_at_use: np.ndarray | int,
    train_step: np.ndarray,
    steps_per_iteration: int,
) -> np.ndarray:
    """(n,) int64 ages in gradient steps of n uses: the step of each use minus the step its
    row was created at, (v_use - v_row)·S + k. S = 3, a row of v2 used in step k = 2 of the
    iteration that trains v3: age 5 (see the module docstring)."""
    used_at = gradient_step(
        policy_version=policy_version_at_use,
        train_step=train_step,
        steps_per_iteration=steps_per_iteration,
    )
    created_at = gradient_step(
        policy_version=row_policy_version, steps_per_iteration=steps_per_iteration
    )
    return used_at - created_at


def steps_since_last_use(
    *,
    rollout_id: np.ndarray,
    step: np.ndarray,
    history_id: np.ndarray,
    history_step: np.ndarray,
) -> np.ndarray:
    """(n,) int64 steps since each of n uses' row was last used, -1 where it never was.

    Args:
        rollout_id: (n,) ids of the rows drawn, one entry per use (a row drawn twice in one
            step, with replacement, appears twice).
        step: (n,) global gradient step of each use.
        history_id, history_step: (h,) earlier uses (e.g. the usage log of earlier
            iterations); may overlap the current uses' steps: only history uses at a strictly
            earlier step count as a "last use".

    The last use of a row's first draw at step g is the latest step < g among its history
    uses and the current uses; a second or later draw of the same row at the same step (with
    replacement) was last used by the draw before it, in this very step: 0. Example: row "a"
    used at steps 2 and 6 earlier, drawn again at steps 9 and 11 -> [3, 2]; row "b" never
    used before, drawn at step 9 -> -1. The paper's App. 10.3 example, a row drawn once in
    batch 3 and three times in batch 5: [new, 2, 0, 0] = [-1, 2, 0, 0].
    """
    rollout_id = np.asarray(rollout_id)
    step = np.asarray(step, dtype=np.int64)
    history_id = np.asarray(history_id)
    history_step = np.asarray(history_step, dtype=np.int64)
    if rollout_id.shape != step.shape or history_id.shape != history_step.shape:
        raise ValueError("ids and steps must have the same shape, one entry per use")
    n = step.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    all_steps = np.concatenate([history_step, step])  # (h + n,)
    if np.any(all_steps < 0):
        raise ValueError("gradient steps are >= 0")
    _, code = np.unique(
        np.concatenate([history_id.astype(object), rollout_id.astype(object)]),
        return_inverse=True,
    )  # (h + n,) row codes
    code = code.reshape(-1).astype(np.int64)
    span = int(all_steps.max()) + 1
    keys = np.unique(code * span + all_steps)  # distinct (row, step), sorted by row then step
    rows, steps = keys // span, keys % span
    same_row = np.concatenate([[False], rows[1:] == rows[:-1]])
    previous = np.where(same_row, np.concatenate([[0], steps[:-1]]), -1)  # (distinct,)
    mine = np.searchsorted(keys, code[history_step.shape[0] :] * span + step)  # (n,)
    last = previous[mine]
    gaps = np.where(last >= 0, step - last, -1)  # (n,) each draw's first use at its step
    # Repeats of a (row, step) among the current uses: only the first in input order looks
    # back to an earlier step; the others follow a draw of the same step.
    _, first = np.unique(code[history_step.shape[0] :] * span + step, return_index=True)
    repeat = np.ones(n, dtype=bool)
    repeat[first] = False
    gaps[repeat] = 0
    return gaps


def summarize_ages(ages: np.ndarray) -> dict[str, float]:
    """{"mean", "max"} of ages in gradient steps; NaN when there are none (not logged)."""
    ages = np.asarray(ages, dtype=np.float64).reshape(-1)
    if ages.size == 0:
        return {"mean": math.nan, "max": math.nan}
    return {"mean": float(ages.mean()), "max": float(ages.max())}


def summarize_since_last_use(gaps: np.ndarray) -> dict[str, float]:
    """{"mean", "p50", "frac_first_use"} of `steps_since_last_use` output: mean and median
    over the uses of rows used before, and the share of uses whose row was never used
    before. Mean and median are NaN (not logged) when no row was used before."""
    gaps = np.asarray(gaps, dtype=np.int64).reshape(-1)
    if gaps.size == 0:
        return {"mean": math.nan, "p50": math.nan, "frac_first_use": math.nan}
    seen = gaps[gaps >= 0]
    return {
        "mean": float(seen.mean()) if seen.size else math.nan,
        "p50": float(np.median(seen)) if seen.size else math.nan,
        "frac_first_use": float(np.mean(gaps < 0)),
    }
