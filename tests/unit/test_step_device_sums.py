"""A gradient step keeps its sums on the device (issue 36 item 11): no loss chunk reads a
value back to the host, and the step's stats are, to the bit, what the per-chunk float
diagnostics gave when every chunk read them.

"No host read" is checked on the meta device, whose tensors have shapes but no values, so any
`.item()`, `float(tensor)` or `.tolist()` raises there.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_train import rows_of_unequal_length, settings

from replayrl.core.losses import policy_loss
from replayrl.policy.batching import collate, completion_token_count, micro_batches, row_lengths
from replayrl.policy.loss_kernels import ChunkedPolicyLoss, chunked_logprobs, output_layer
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import PAD_TOKEN_ID, VOCAB_SIZE
from replayrl.policy.training import gradient_step, make_optimizer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("loss", ["grpo", "asymre"])
def test_a_loss_reads_nothing_back_from_its_device(loss):
    n = 11
    meta = dict(device="meta")
    out = policy_loss(
        loss=loss,
        logp_new=torch.empty(2, n, **meta, requires_grad=True),
        logp_behavior=torch.empty(2, n, **meta),
        advantages=torch.empty(2, **meta),
        completion_mask=torch.empty(2, n, dtype=torch.bool, **meta),
    )
    out.loss.backward()  # the graph is there, and backward reads nothing either
    for tensor in (out.loss, out.clipped_tokens, out.ratio_sum, out.token_count):
        assert tensor.device.type == "meta" and tensor.shape == ()


@pytest.mark.parametrize("loss", ["grpo", "asymre"])
def test_every_chunk_of_the_chunked_loss_stays_on_the_device(loss):
    """Forward (7 chunks of 3 tokens, each taking its gradient) and backward of the output
    layer's loss, with every input on the meta device."""
    n, h, v = 20, 8, 33
    meta = dict(device="meta")
    hidden = torch.empty(n, h, **meta, requires_grad=True)
    weight = torch.empty(v, h, **meta, requires_grad=True)
    out = ChunkedPolicyLoss.apply(
        hidden,
        weight,
        None,
        torch.empty(n, dtype=torch.long, **meta),
        torch.empty(n, **meta),
        torch.empty(n, **meta),
        settings(loss, logprob_chunk_tokens=3),
        float(n),
        1.0,
    )
    step_loss, logp_new, sums = out
    assert sums.device.type == "meta" and sums.dtype == torch.float64 and sums.shape == (3,)
    assert logp_new.shape == (n,)
    step_loss.backward()
    assert hidden.grad.shape == (n, h) and weight.grad.shape == (v, h)


def stats_from_chunk_floats(model, rows, s) -> tuple[float, float, float, int]:
    """(loss, clip fraction, mean ratio, tokens) of one step as the trainer computed them
    while every chunk read its diagnostics to the host: per chunk `policy_loss`'s floats,
    its loss scaled by tokens / the batch's tokens and added up in float32; per micro-batch
    [clip fraction x tokens, mean ratio x tokens, tokens] added up in float64 and its loss
    read as a float."""
    denominator = float(completion_token_count(rows))
    head = output_layer(model)
    total, sums = 0.0, np.zeros(3)
    model.train()
    groups = micro_batches(
        row_lengths(rows), max_rows=s.micro_batch_size, max_tokens=s.micro_batch_tokens
    )
    for idx in groups:
        batch = collate(rows.take(idx), pad_id=PAD_TOKEN_ID)
        hidden = model.base_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).last_hidden_state
        mask = batch["completion_mask"].bool()
        logp = chunked_logprobs(
            hidden=hidden[:, :-1][mask].detach(),
            weight=head.weight.detach(),
            targets=batch["input_ids"][:, 1:][mask],
            temperature=s.temperature,
            chunk_tokens=s.logprob_chunk_tokens,
        )
        behavior, advantages = (
            batch["logp_behavior"][mask],
            batch["advantages"][mask.nonzero()[:, 0]],
        )
        loss = torch.zeros(())
        part = torch.zeros(3, dtype=torch.float64)
        for a in range(0, len(logp), s.logprob_chunk_tokens):
            b = min(a + s.logprob_chunk_tokens, len(logp))
            out = policy_loss(
                loss=s.loss_name,
                logp_new=logp[a:b].unsqueeze(1),
                logp_behavior=behavior[a:b].unsqueeze(1),
                advantages=advantages[a:b],
                completion_mask=torch.ones(b - a, 1, dtype=torch.bool),
                clip_eps=s.clip_eps,
                is_cap=s.is_cap,
            )
            loss += out.loss.detach() * ((b - a) * 1.0 / denominator)
            part += torch.tensor(
                [out.clip_fraction * (b - a), out.mean_ratio * (b - a), b - a], dtype=torch.float64
            )
        total += float(loss)
        sums += part.numpy()
    return total, sums[0] / sums[2], sums[1] / sums[2], int(sums[2])


@pytest.mark.parametrize("loss", ["grpo", "asymre"])
def test_a_steps_stats_are_the_per_chunk_floats_to_the_bit(loss):
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=3)
    rows = rows_of_unequal_length(n=9, seed=5)
    s = settings(loss, micro_batch_tokens=48, logprob_chunk_tokens=7)
    assert len(micro_batches(row_lengths(rows), max_tokens=48)) > 2  # several micro-batches
    want = stats_from_chunk_floats(copy.deepcopy(model), rows, s)
    optimizer = make_optimizer(model, lr=s.lr, weight_decay=0.0, betas=s.betas)
    got = gradient_step(
        model=model, optimizer=optimizer, rows=rows, pad_id=PAD_TOKEN_ID, settings=s
    )
    assert (got.loss, got.clip_fraction, got.mean_ratio, got.num_tokens) == want
    if loss == "grpo":
        assert 0 < got.clip_fraction < 1  # clipped and free tokens both counted
    assert got.mean_ratio != 1.0  # the ratios are not trivially 1
