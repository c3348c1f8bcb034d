"""The trainer's memory-bounded step equals the plain full-batch step.

The reference is the textbook computation: full (B, L, V) float32 logits of the whole batch
in one forward pass, `losses.token_logprobs`, `losses.policy_loss`, one backward. The step
under test cuts the batch into micro-batches and computes log-probs, loss and gradient in
chunks of completion tokens; loss and every gradient must agree within 1e-5.
"""

from __future__ import annotations

import copy

import numpy as np
import pyarrow as pa
import pytest
import torch

from replayrl.core.losses import policy_loss, token_logprobs
from replayrl.errors import ReplayRLError
from replayrl.policy.batching import collate, micro_batches, row_lengths
from replayrl.policy.loss_kernels import TokenPolicyLoss, chunked_logprobs, completion_logprobs
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import PAD_TOKEN_ID, VOCAB_SIZE
from replayrl.policy.training import (
    StepSettings,
    accumulate_gradients,
    gradient_step,
    make_optimizer,
    prepare_model,
    resolve_dtype,
)

pytestmark = pytest.mark.unit


def settings(loss: str, **kw) -> StepSettings:
    return StepSettings(
        loss_name=loss,
        clip_eps=0.2,
        is_cap=None,
        temperature=0.8,
        grad_clip=1.0,
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        **kw,
    )


def rows_of_unequal_length(n: int = 7, seed: int = 0) -> pa.Table:
    """Rows with prompts of 2..9 and completions of 1..23 tokens; behaviour log-probs near
    the random tiny model's (about -log 264 = -5.6) but spread enough that GRPO's clip binds
    on some tokens."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, rng.integers(2, 10)).tolist() for _ in range(n)]
    completions = [rng.integers(0, 258, rng.integers(1, 24)).tolist() for _ in range(n)]
    return pa.table(
        {
            "prompt_token_ids": prompts,
            "completion_token_ids": completions,
            "behavior_logprobs": [
                (-5.6 + rng.normal(0, 0.3, len(c))).tolist() for c in completions
            ],
            "advantage": rng.normal(0, 1, n).astype(np.float32),
            "reward": rng.integers(0, 2, n).astype(np.float32),
        }
    )


def plain_loss(model, rows, s: StepSettings):
    """The textbook step: full logits of the whole batch, one loss, one backward."""
    batch = collate(rows, pad_id=PAD_TOKEN_ID)
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits  # (B, L, V)
    logp = token_logprobs(
        logits=logits[:, :-1], target_ids=batch["input_ids"][:, 1:], temperature=s.temperature
    )
    return policy_loss(
        loss=s.loss_name,
        logp_new=logp,
        logp_behavior=batch["logp_behavior"],
        advantages=batch["advantages"],
        completion_mask=batch["completion_mask"],
        clip_eps=s.clip_eps,
        is_cap=s.is_cap,
    )


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(vocab_size=VOCAB_SIZE, seed=3)


@pytest.mark.parametrize("loss", ["grpo", "asymre"])
@pytest.mark.parametrize(
    "cut",
    [
        dict(micro_batch_size=2, logprob_chunk_tokens=5),
        dict(micro_batch_tokens=40, logprob_chunk_tokens=1),
        dict(micro_batch_size=1, logprob_chunk_tokens=4096),
    ],
)
def test_micro_batched_chunked_step_equals_the_full_batch(model, loss, cut):
    rows = rows_of_unequal_length()
    s = settings(loss, **cut)
    reference = copy.deepcopy(model)
    out = plain_loss(reference, rows, s)
    out.loss.backward()

    ours = copy.deepcopy(model)
    total, sums = accumulate_gradients(
        model=TokenPolicyLoss(ours, s), rows=rows, pad_id=PAD_TOKEN_ID, settings=s
    )
    assert total == pytest.approx(float(out.loss.detach()), abs=1e-5)
    assert int(sums[2]) == out.num_tokens
    assert sums[1] / sums[2] == pytest.approx(out.mean_ratio, rel=1e-5)
    assert sums[0] / sums[2] == pytest.approx(out.clip_fraction, abs=1e-6)
    if loss == "grpo":
        assert 0 < out.clip_fraction < 1  # the comparison covers clipped and free tokens
    largest = 0.0
    for (name, p), q in zip(reference.named_parameters(), ours.parameters(), strict=True):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=0, msg=name)
        largest = max(largest, float(p.grad.abs().max()))
    assert largest > 1e-3  # the gradients are not all ~0 (the test can fail)


def test_the_cut_really_happens():
    """The settings above do cut: 7 rows of unequal length into several micro-batches."""
    lengths = row_lengths(rows_of_unequal_length())
    assert len(micro_batches(lengths, max_rows=2)) == 4
    assert len(micro_batches(lengths, max_tokens=40)) > 2
    cut = micro_batches(np.array([3, 9, 4, 8]), max_tokens=16)
    assert [g.tolist() for g in cut] == [[1], [3, 2], [0]]
    groups = micro_batches(lengths, max_rows=3, max_tokens=60)
    assert sorted(np.concatenate(groups).tolist()) == list(range(7))
    for g in groups:
        assert len(g) <= 3
        assert len(g) == 1 or len(g) * lengths[g].max() <= 60


def test_chunked_logprobs_equal_the_plain_ones(model):
    torch.manual_seed(0)
    hidden = torch.randn(37, model.config.hidden_size)
    targets = torch.randint(0, VOCAB_SIZE, (37,))
    head = model.get_output_embeddings()
    logits = (hidden @ head.weight.T).detach()  # (N, V)
    want = token_logprobs(logits=logits[None], target_ids=targets[None], temperature=0.7)[0]
    for chunk in (1, 8, 37, 1000):
        got = chunked_logprobs(
            hidden=hidden, weight=head.weight, targets=targets, temperature=0.7, chunk_tokens=chunk
        )
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_a_step_with_activation_checkpointing_equals_one_without(model):
    rows = rows_of_unequal_length(seed=1)
    s = settings("grpo", micro_batch_size=3, logprob_chunk_tokens=16)
    results = []
    for checkpointing in (False, True):
        m = copy.deepcopy(model)
        prepare_model(m, activation_checkpointing=checkpointing)
        optimizer = make_optimizer(m, lr=s.lr, weight_decay=0.0, betas=s.betas)
        stats = gradient_step(
            model=m, optimizer=optimizer, rows=rows, pad_id=PAD_TOKEN_ID, settings=s
        )
        results.append((stats, m.state_dict()))
    (a, wa), (b, wb) = results
    assert a.loss == pytest.approx(b.loss, abs=1e-6)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-6, rtol=0, msg=name)


def test_dtype_resolution():
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("float32", "cuda") == "float32"
    with pytest.raises(ReplayRLError, match="needs a CUDA GPU"):
        resolve_dtype("bfloat16", "cpu")
    with pytest.raises(ReplayRLError, match="train.dtype must be one of"):
        resolve_dtype("fp16", "cuda")


def test_completion_logprobs_are_the_training_steps(model):
    """The no-graph log-probs (what the GPU smoke check compares with vLLM's) are the ones
    the plain forward gives, row by row, in the rows' order."""
    rows = rows_of_unequal_length(seed=2)
    s = settings("grpo", micro_batch_size=3, logprob_chunk_tokens=7)
    got = completion_logprobs(model, rows, pad_id=PAD_TOKEN_ID, settings=s)
    batch = collate(rows, pad_id=PAD_TOKEN_ID)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = token_logprobs(
        logits=logits[:, :-1], target_ids=batch["input_ids"][:, 1:], temperature=s.temperature
    )
    completions = rows.column("completion_token_ids").to_pylist()
    for i, c in enumerate(completions):
        expected = want[i][batch["completion_mask"][i].bool()].numpy()
        assert len(got[i]) == len(c)
        np.testing.assert_allclose(got[i], expected, atol=1e-5)


def test_the_bf16_path_runs_and_agrees_with_float32_to_bf16_precision(model):
    """The GPU's mixed-precision path (bf16 autocast, bf16 output-layer matmuls, float32
    log-softmax and master weights), run on the CPU, which supports bf16 too: the loss
    agrees with float32 to bf16 precision and the gradients point the same way."""
    rows = rows_of_unequal_length(seed=4)
    results = {}
    for dtype in ("float32", "bfloat16"):
        m = copy.deepcopy(model)
        s = settings("grpo", micro_batch_size=3, logprob_chunk_tokens=16, dtype=dtype)
        loss, _ = accumulate_gradients(
            model=TokenPolicyLoss(m, s), rows=rows, pad_id=PAD_TOKEN_ID, settings=s
        )
        grads = torch.cat([p.grad.flatten() for p in m.parameters()])
        assert all(p.dtype == torch.float32 for p in m.parameters())  # master weights
        assert torch.isfinite(grads).all()
        results[dtype] = (loss, grads)
    (l32, g32), (l16, g16) = results["float32"], results["bfloat16"]
    assert l16 == pytest.approx(l32, abs=2e-2)
    cosine = torch.nn.functional.cosine_similarity(g32, g16, dim=0)
    assert cosine > 0.99
