"""The staleness and cost metrics on the paper's own examples ("Efficient RL Training for LLMs
with Experience Replay", Arnal et al., 2026): steps since last use (App. 10.3) in both engines,
and μ / γ from busy device-seconds with T > 1 trainers (§3.2)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replayrl.buffer.schema import usage_rows
from replayrl.core.staleness import steps_since_last_use
from replayrl.engine.asynchronous.trainer import _Uses
from replayrl.engine.metric_schema import async_cost_metrics

pytestmark = pytest.mark.unit
EMPTY = dict(history_id=np.array([], dtype=object), history_step=np.array([], dtype=np.int64))


def test_sync_uses_in_batches_3_and_5_are_2_steps_apart():
    gaps = steps_since_last_use(
        rollout_id=np.array(["r", "r"], dtype=object), step=np.array([3, 5]), **EMPTY
    )
    assert gaps.tolist() == [-1, 2]


def test_sync_with_replacement_one_use_in_b3_and_three_in_b5_is_new_2_0_0():
    # The paper's example: drawn once in batch 3, three times in batch 5.
    gaps = steps_since_last_use(
        rollout_id=np.array(["r"] * 4, dtype=object), step=np.array([3, 5, 5, 5]), **EMPTY
    )
    assert gaps.tolist() == [-1, 2, 0, 0]
    # The same with batch 3 in the usage log of an earlier iteration, and other rows between.
    gaps = steps_since_last_use(
        rollout_id=np.array(["r", "s", "r", "r"], dtype=object),
        step=np.array([5, 5, 5, 5]),
        history_id=np.array(["r"], dtype=object),
        history_step=np.array([3]),
    )
    assert gaps.tolist() == [2, -1, 0, 0]


def _logged(ids, *, step_before):
    """The usage rows the asynchronous trainer logs for one gradient step that starts from
    version `step_before` (its `iteration` is the version it ends at)."""
    return usage_rows(
        lineage="l",
        iteration=step_before + 1,
        train_step=0,
        rollout_id=ids,
        policy_version_at_use=step_before,
        rollout_policy_version=np.zeros(len(ids), dtype=np.int64),
    )


def test_async_uses_in_batches_3_and_5_are_2_steps_apart():
    uses = _Uses(_logged([], step_before=0), up_to=0)
    assert uses.draw(["r"], step=3) == [-1]
    assert uses.draw(["s"], step=4) == [-1]
    assert uses.draw(["r", "r", "r"], step=5) == [2, 0, 0]  # with replacement: as the sync
    # A restarted trainer reads the same from the usage log: batch 3 ended at version 4.
    restarted = _Uses(_logged(["r"], step_before=3), up_to=4)
    assert restarted.draw(["r"], step=5) == [2]
    # Uses logged past the published version `up_to` are not counted.
    assert _Uses(_logged(["r"], step_before=3), up_to=3).draw(["r"], step=5) == [-1]


def test_mu_busy_and_gamma_count_device_seconds_with_two_trainers():
    # W = 6, T = 2 (the paper's Qwen3-0.6B split). 600 rows in 300 worker-seconds (summed
    # over the 6 workers): 0.5 s per row. 1200 row uses in 60 s of rank 0's wall clock, i.e.
    # 120 device-seconds: 0.1 s per use. μ = 5, γ = (1 + 3) / (1 + 5).
    m = async_cost_metrics(
        workers=6,
        trainers=2,
        rows_generated=600,
        row_uses=1200,
        workers_busy_seconds=300.0,
        trainer_busy_seconds=60.0,
    )
    assert m["mu_busy"] == pytest.approx(5.0)
    assert m["gamma"] == pytest.approx(4 / 6)
    # By counts: (1200 / 2) / (600 / 6) = 6, i.e. (W/T) × the replay ratio 2.
    assert m["mu"] == pytest.approx(6.0) and m["gamma_counts"] == pytest.approx(4 / 7)
    # With T = 1 the same clocks mean twice the training cost per use: μ halves.
    one = async_cost_metrics(
        workers=6,
        trainers=1,
        rows_generated=600,
        row_uses=1200,
        workers_busy_seconds=300.0,
        trainer_busy_seconds=120.0,
    )
    assert one["mu_busy"] == pytest.approx(5.0)
    nothing = async_cost_metrics(
        workers=1,
        trainers=1,
        rows_generated=0,
        row_uses=0,
        workers_busy_seconds=0.0,
        trainer_busy_seconds=0.0,
    )
    assert all(math.isnan(v) for v in nothing.values())
