"""The synchronous engine's distributed trainer lives for the task: `train.distributed: fsdp`
over 2 gloo ranks starts its group once, honours `train.checkpoint_every` (it used to write a
full checkpoint, weights and AdamW state, every iteration, from ranks respawned every
iteration), and between checkpoints gives the generation engine the ranks' gathered weights
in memory: the rollouts of the iterations after an unwritten version are those a one-process
trainer's lineage generates, with the same behaviour log-probs."""

from __future__ import annotations

import logging

import numpy as np
import pyarrow.compute as pc
import pytest
from fault_helpers import crash_config

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.engine.inline import run_inline
from replayrl.engine.steps import TRAIN_COLUMNS, step_settings
from replayrl.policy.loss_kernels import completion_logprobs
from replayrl.policy.models import load_policy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The tiny lineage's first two iterations draw no reward (zero advantages, no update): its
# policy first moves in iteration 3, so v3, never written (checkpoint_every=2), is the
# version whose rollouts (iteration 4) tell gathered weights from stale ones.
LINEAGE = ("iterations=5", "train.checkpoint_every=2", "train.keep_checkpoints=0")
SHARDED = ("train.distributed=fsdp", "train.num_processes=2")
# Behaviour log-probs are float32 sums; the 2-rank trainer's weights differ from one
# process's in float summation order (~1e-7 after a few steps, test_fsdp.py), so the
# engine's log-probs agree to ~1e-5. A stale copy (v0's weights at iteration 2) differs by
# far more: the assertion below checks that it can fail.
LOGPROB_ATOL = 1e-4


def _rows(cfg):
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    table = ReplayBuffer(paths.buffer).read(
        columns=["iteration", "rollout_id", "completion", "behavior_logprobs"]
    )
    return sorted(table.to_pylist(), key=lambda r: (r["iteration"], r["rollout_id"])), paths


def test_the_fsdp_group_lives_for_the_task_and_feeds_the_engine_in_memory(tmp_path, caplog):
    one = crash_config(tmp_path, str(tmp_path / "one"), *LINEAGE)
    run_inline(one)
    sharded = crash_config(tmp_path, str(tmp_path / "fsdp"), *LINEAGE, *SHARDED)
    with caplog.at_level(logging.INFO, logger="replayrl"):
        run_inline(sharded)
    starts = [r for r in caplog.records if "sharded (FSDP) trainers" in r.getMessage()]
    assert len(starts) == 1, "the trainer group is started once for the task's 5 iterations"

    want, _ = _rows(one)
    got, paths = _rows(sharded)
    # v2 and v4 are due (checkpoint_every=2) and v5 ends the task; v1 and v3 lived only in
    # the ranks.
    assert storage.complete_versions(paths) == [0, 2, 4, 5]
    assert [r["rollout_id"] for r in got] == [r["rollout_id"] for r in want]
    assert [r["completion"] for r in got] == [r["completion"] for r in want]
    worst = max(
        abs(a - b)
        for g, w in zip(got, want, strict=True)
        for a, b in zip(g["behavior_logprobs"], w["behavior_logprobs"], strict=True)
    )
    assert worst < LOGPROB_ATOL, worst
    # ... and the comparison can fail: v2's log-probs of iteration 4's rows (the last
    # written version: what a stale engine would have held) are further from them than that.
    model, tokenizer = load_policy(storage.checkpoint_local_dir(paths.checkpoint(2), tmp_path))
    table = ReplayBuffer(paths.buffer).read(columns=TRAIN_COLUMNS)
    table = table.filter(pc.field("iteration") == 4)
    stale = completion_logprobs(
        model, table, pad_id=tokenizer.pad_token_id, settings=step_settings(sharded)
    )
    far = max(
        float(np.abs(mine - np.asarray(theirs, dtype=np.float32)).max())
        for mine, theirs in zip(stale, table.column("behavior_logprobs").to_pylist(), strict=True)
    )
    assert far > 10 * LOGPROB_ATOL, far

    # The lineage goes on from its last full checkpoint in a new task.
    more = crash_config(tmp_path, str(tmp_path / "fsdp"), *LINEAGE, "iterations=6", *SHARDED)
    run_inline(more)
    assert storage.read_state(paths).next_iteration == 7
