"""Multi-process training through accelerate: 2 CPU processes (gloo, spawn) end two steps
with the same parameters, optimizer state and step statistics as 1 process on the same global
batches. The reference is the single-process trainer `train.gradient_step` itself, on whole
batches; the processes cut their shards into micro-batches and log-prob chunks."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest
import torch
from rollout_rows import sampled_rows
from safetensors.torch import load_file

from replayrl.errors import ReplayRLError
from replayrl.policy.distributed import shard_rows, train_on_batches
from replayrl.policy.models import load_policy, save_policy
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer
from replayrl.policy.training import StepSettings, gradient_step, make_optimizer
from replayrl.policy.training_state import (
    load_training_state,
    named_optimizer_state,
    read_optimizer_state,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SETTINGS = StepSettings(
    loss_name="grpo",
    clip_eps=0.2,
    is_cap=None,
    temperature=1.0,
    grad_clip=1.0,
    lr=1e-3,
    weight_decay=0.0,
    betas=(0.9, 0.999),
)
# Float32 sums in another order (shards, micro-batches, then an all-reduce) differ by ~1e-10
# absolute in a gradient (checked through AdamW's first moment below). Adam's first updates
# are lr * g / (|g| + eps): where a coordinate's gradient is itself ~1e-9 (comparable to
# eps = 1e-8), that noise moves the update by up to a few percent of lr = 1e-3, measured at
# up to ~1.1e-5 after one step. So parameters agree within 5% of one lr-sized update.
PARAM_ATOL = 5e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny checkpoint with optimizer state, and 2 global batches of 7 real rollouts each
    (an odd size, so the two shards and their token counts differ)."""
    root = tmp_path_factory.mktemp("dist")
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=11)
    tokenizer = build_byte_tokenizer()
    optimizer = make_optimizer(model, lr=SETTINGS.lr, weight_decay=0.0, betas=SETTINGS.betas)
    save_policy(model, tokenizer, root / "v0", optimizer=optimizer)
    table = sampled_rows(model, tokenizer, num_samples=2)
    batches = [table.slice(0, 7), table.slice(7, 7)]
    return root, batches


def reference(root, batches):
    """The single-process trainer on the whole global batches."""
    model, tokenizer = load_policy(root / "v0")
    optimizer = make_optimizer(model, lr=SETTINGS.lr, weight_decay=0.0, betas=SETTINGS.betas)
    assert load_training_state(optimizer, model, root / "v0")
    torch.manual_seed(0)
    stats = [
        gradient_step(
            model=model,
            optimizer=optimizer,
            rows=rows,
            pad_id=tokenizer.pad_token_id,
            settings=SETTINGS,
        )
        for rows in batches
    ]
    return model.state_dict(), named_optimizer_state(optimizer, model), stats


def assert_same_result(out_dir, ref, stats):
    ref_params, ref_optim, ref_stats = ref
    params = load_file(out_dir / "model.safetensors")
    initial = load_file(out_dir.parent / "v0" / "model.safetensors")
    moved = 0.0
    for name, value in params.items():
        assert torch.allclose(value, ref_params[name], atol=PARAM_ATOL, rtol=0), name
        moved = max(moved, float((value - initial[name]).abs().max()))
    # The comparison can fail: the step moved parameters by far more than the tolerance.
    assert moved > 20 * PARAM_ATOL
    optim = read_optimizer_state(out_dir)  # keyed by parameter name
    assert optim["state"].keys() == ref_optim["state"].keys()
    first = next(iter(ref_optim["state"]))
    assert optim["state"][first]["step"] == ref_optim["state"][first]["step"] == 2
    for key in ref_optim["state"]:
        exp_avg = optim["state"][key]["exp_avg"]
        assert torch.allclose(exp_avg, ref_optim["state"][key]["exp_avg"], atol=1e-6, rtol=1e-4)
    for got, want in zip(stats, ref_stats, strict=True):
        assert got.num_tokens == want.num_tokens
        assert got.loss == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
        assert got.clip_fraction == pytest.approx(want.clip_fraction, abs=1e-6)
        assert got.mean_ratio == pytest.approx(want.mean_ratio, rel=1e-5)
        assert got.mean_reward == pytest.approx(want.mean_reward, rel=1e-6)
        assert got.mean_advantage == pytest.approx(want.mean_advantage, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("num_processes", [2, 1])
def test_ddp_matches_the_single_process_trainer(setup, num_processes):
    """2 gloo processes, and 1 process through the same path, equal `train.gradient_step`
    on the whole global batch."""
    root, batches = setup
    ref = reference(root, batches)
    out = root / f"ddp{num_processes}"
    stats = train_on_batches(
        checkpoint_dir=root / "v0",
        out_dir=out,
        batches=batches,
        # Two micro-batches per shard (gradients all-reduced once, after the second) and
        # log-probs 5 tokens at a time.
        settings=dataclasses.replace(SETTINGS, micro_batch_size=2, logprob_chunk_tokens=5),
        mode="ddp",
        num_processes=num_processes,
        cpu=True,
        seed=0,
    )
    assert_same_result(out, ref, stats)
    # The written checkpoint is a plain HF directory the rest of the loop can load.
    model, _ = load_policy(out)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_shards_cover_the_batch_once():
    rows = pa.table({"x": list(range(5))})
    shards = [shard_rows(rows, rank=r, world_size=2).column("x").to_pylist() for r in range(2)]
    assert shards == [[0, 1, 2], [3, 4]]
    with pytest.raises(ReplayRLError, match="batch_size"):
        shard_rows(rows, rank=0, world_size=6)


def test_bad_modes_are_rejected(setup):
    root, batches = setup
    for mode, n, match in [
        ("zero", 1, "one of"),
        ("none", 2, "needs train.distributed"),
    ]:
        with pytest.raises(ReplayRLError, match=match):
            train_on_batches(
                checkpoint_dir=root / "v0",
                out_dir=root / "bad",
                batches=batches,
                settings=SETTINGS,
                mode=mode,
                num_processes=n,
                cpu=True,
                seed=0,
            )
