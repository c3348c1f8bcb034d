"""The asynchronous engine's T data-parallel trainers: 2 gloo processes kept alive across
steps end each step with the same parameters and statistics as one trainer on the whole
batch, and a follower rank that dies stops rank 0 with a clear error (so the engine restarts
the trainer role) instead of hanging it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from rollout_rows import sampled_rows

from replayrl.config import load_config
from replayrl.engine.resources import Trainer
from replayrl.engine.steps import step_settings
from replayrl.engine.trainer_group import TrainerGroup
from replayrl.errors import ReplayRLError
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer
from replayrl.policy.training import make_optimizer
from replayrl.storage import paths_of

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
# As in test_distributed: float sums in another order move Adam's first updates by up to a
# few percent of one lr-sized step (lr = 1e-3 here).
PARAM_ATOL = 5e-5


@pytest.fixture
def lineage(tmp_path):
    """A lineage whose v0 is a tiny model with optimizer state, and 3 batches of 7 rows."""
    cfg = load_config(
        PRESET,
        overrides=[
            f"storage.run_root={tmp_path / 'runs'}",
            "asynchronous.enabled=true",
            "asynchronous.trainers=2",
            "train.batch_size=7",  # odd: the two shards (and their token counts) differ
            "train.lr=1e-3",
            "train.micro_batch_size=2",  # two micro-batches per shard
        ],
    )
    paths = paths_of(cfg)
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=11)
    tokenizer = build_byte_tokenizer()
    s = step_settings(cfg)
    optimizer = make_optimizer(model, lr=s.lr, weight_decay=s.weight_decay, betas=s.betas)
    Trainer(model, tokenizer, optimizer, settings=s, version=0).save(paths.checkpoint(0))
    table = sampled_rows(model, tokenizer, num_samples=3)
    return cfg, paths, [table.slice(7 * i, 7) for i in range(3)]


def load(cfg, paths):
    return Trainer.load(cfg, paths, version=0, settings=step_settings(cfg))


def test_two_trainers_step_as_one_and_a_dead_follower_stops_rank_0(lineage):
    cfg, paths, batches = lineage
    reference = load(cfg, paths)
    initial = {k: v.clone() for k, v in reference.model.state_dict().items()}
    group = TrainerGroup.start(cfg, load(cfg, paths), checkpoint_version=0, world=2)
    try:
        for step, rows in enumerate(batches, 1):
            want = reference.train([rows], seed=step)[0]
            got = group.train([rows], seed=step)[0]
            assert group.version == reference.version == step
            assert got.num_tokens == want.num_tokens
            assert got.loss == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
            assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
            assert got.mean_ratio == pytest.approx(want.mean_ratio, rel=1e-5)
        moved = 0.0
        for name, value in group.model.state_dict().items():
            ref = reference.model.state_dict()[name]
            assert torch.allclose(value, ref, atol=PARAM_ATOL * 3, rtol=0), name
            moved = max(moved, float((value - initial[name]).abs().max()))
        assert moved > 20 * PARAM_ATOL  # the steps moved far more than the tolerance

        # SIGKILL the follower: rank 0's next step raises at once instead of hanging.
        follower = group._procs[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(timeout=30)
        started = time.time()
        with pytest.raises(ReplayRLError, match="trainer rank 1 of 2 died"):
            group.train([batches[0]], seed=4)
        assert time.time() - started < 10
        assert group.version == 3
    finally:
        group.close()
    assert not torch.distributed.is_initialized()
