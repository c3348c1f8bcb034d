"""The policy loss and log-probs of completion tokens from the model's last hidden states,
a chunk of tokens at a time: what a gradient step runs its model through.

`TokenPolicyLoss` is a causal LM with the policy loss as its forward (the decoder up to its
last hidden state, then `ChunkedPolicyLoss`), so one call of a wrapped module (DDP, FSDP)
covers the transformer and the output layer. `ChunkedPolicyLoss` computes the output
projection, the float32 log-softmax, the loss of `core.losses` and its gradient for
`logprob_chunk_tokens` completion tokens at a time: prompt and padding positions never get
logits, and a chunk's logits live only while its own gradient is taken (see
`replayrl.policy.training`'s docstring for what that costs). `chunked_logprobs` is the same
arithmetic without a graph, and `completion_logprobs` the log-probs of whole rows as a
training step computes them. `output_layer` finds (and vets) the model's output projection.

This module knows the loss of one micro-batch, not the step: micro-batches, gradient
accumulation, replicas, the optimizer and the step's settings and stats are
`replayrl.policy.training`. It knows nothing about where rows or checkpoints live.
pyarrow is only named in annotations, so the trainer imports without it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np
import torch

from replayrl.core.losses import policy_loss
from replayrl.errors import ReplayRLError
from replayrl.policy.batching import collate, micro_batches, row_lengths

if TYPE_CHECKING:
    import pyarrow as pa

    from replayrl.policy.training import StepSettings


def output_layer(model: torch.nn.Module) -> torch.nn.Linear:
    """The causal LM's output projection (hidden -> vocabulary logits). Models whose logits
    are more than that projection (soft-capped or rescaled logits) are refused: the chunked
    log-probs would not be theirs."""
    config = model.config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ReplayRLError(
                f"{type(model).__name__} transforms its logits ({name}={getattr(config, name)}); "
                "replayrl computes log-probs from the output projection only and does not "
                "support this model."
            )
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ReplayRLError(
            f"{type(model).__name__} has no linear output projection; it is not supported."
        )
    return head


# ---------------------------------------------------------------- chunked log-probs


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """float32 logits / temperature of (c, H) hidden states in the weight's dtype. (c, V)"""
    logits = hidden.to(weight.dtype) @ weight.T  # (c, V)
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    # float32 log-softmax: in bf16 it loses the small log-probs the ratio depends on.
    return logits.float() / temperature


def _logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) at `targets`. logits (c, V) float32, targets (c,). Returns (c,)"""
    picked = torch.gather(logits, 1, targets.unsqueeze(1)).squeeze(1)  # (c,)
    return picked - torch.logsumexp(logits, dim=1)


def chunked_logprobs(
    *,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """log softmax((hidden @ weight.T + bias) / temperature) at `targets`, `chunk_tokens`
    positions at a time, without a graph. hidden (N, H), weight (V, H), targets (N,).
    Returns (N,) float32; equals `losses.token_logprobs` on the full logits."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # (N,)
    with torch.no_grad():
        for s in range(0, hidden.shape[0], max(chunk_tokens, 1)):
            e = min(s + chunk_tokens, hidden.shape[0])
            logits = _chunk_logits(hidden[s:e], weight, bias, temperature)  # (c, V)
            out[s:e] = _logprobs_of(logits, targets[s:e])
    return out


class ChunkedPolicyLoss(torch.autograd.Function):
    """The policy loss of N completion tokens from their last hidden states, chunk by chunk.

    forward(hidden (N, H), weight (V, H), bias (V,) or None, targets (N,), logp_behavior (N,),
    advantages (N,) per token, settings, denominator, scale) returns
    (loss scalar, logp_new (N,), sums (3,) = [clipped tokens, sum of ratios, tokens]).

    loss = scale * sum over the N tokens of the per-token objective / denominator, so
    micro-batches of one step (denominator = the step's token count) add up to the
    full-batch token mean. Every loss here is a sum of per-token terms, so each chunk's
    gradient is complete once its own logits are known: forward takes it right away (the
    chunk's logits are then freed) and backward only scales it. Forward and backward thus
    cost the same three matmuls as an ordinary output layer, and never hold more than one
    chunk of logits.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, logp_behavior, advantages, settings, denominator, scale
    ):
        compute = torch.bfloat16 if settings.dtype == "bfloat16" else torch.float32
        chunk = max(int(settings.logprob_chunk_tokens), 1)
        n = hidden.shape[0]
        grad_hidden = torch.zeros_like(hidden)  # (N, H)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)  # (V, H)
        grad_bias = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        logp_new = torch.empty(n, dtype=torch.float32, device=hidden.device)  # (N,)
        # On the device, like everything here: no chunk waits for the device to finish.
        sums = torch.zeros(3, dtype=torch.float64, device=hidden.device)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        w = weight.detach().to(compute).requires_grad_()  # one cast for all chunks
        b = None if bias is None else bias.detach().float().requires_grad_()
        # The output layer runs outside autocast (where the device has one at all).
        device_type = hidden.device.type
        no_autocast = (
            torch.autocast(device_type, enabled=False)
            if torch.amp.is_autocast_available(device_type)
            else contextlib.nullcontext()
        )
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e].detach().requires_grad_()  # (c, H)
            with torch.enable_grad(), no_autocast:
                logits = _chunk_logits(h, w, b, settings.temperature)  # (c, V)
                logp = _logprobs_of(logits, targets[s:e])  # (c,)
                # Each token as a row of one: the loss's token mean over c tokens, times
                # c / denominator, is this chunk's share of the step's token mean.
                out = policy_loss(
                    loss=settings.loss_name,
                    logp_new=logp.unsqueeze(1),
                    logp_behavior=logp_behavior[s:e].unsqueeze(1),
                    advantages=advantages[s:e],
                    completion_mask=torch.ones(e - s, 1, dtype=torch.bool, device=h.device),
                    clip_eps=settings.clip_eps,
                    is_cap=settings.is_cap,
                )
                part = out.loss * ((e - s) * scale / denominator)
                leaves = [h, w] if b is None else [h, w, b]
                grads = torch.autograd.grad(part, leaves)
            grad_hidden[s:e] = grads[0]
            grad_weight += grads[1].float()
            if b is not None:
                grad_bias += grads[2]
            logp_new[s:e] = logp.detach()
            loss += part.detach()
            # The chunk's clip fraction and mean ratio (float64 means of its float32 sums)
            # times its tokens: the same arithmetic as reading `out.clip_fraction` and
            # `out.mean_ratio`, so a step's stats are those floats' to the bit.
            means = torch.stack([out.clipped_tokens, out.ratio_sum]).double() / (e - s)  # (2,)
            sums[:2] += means * (e - s)
            sums[2] += e - s
            del logits, logp, out, part, grads, means
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(logp_new, sums)
        return loss, logp_new, sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_sums):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        gw = (grad_weight * grad_loss).to(ctx.weight_dtype)
        gb = None if grad_bias is None else grad_bias * grad_loss
        return (
            grad_hidden * grad_loss.to(grad_hidden.dtype),
            gw,
            gb,
            None,
            None,
            None,
            None,
            None,
            None,
        )


class TokenPolicyLoss(torch.nn.Module):
    """A causal LM with the policy loss as its forward, so one call of a wrapped module
    (DistributedDataParallel) covers the transformer and the chunked output layer.

    forward(batch of one micro-batch from `collate`, denominator, scale) returns
    (loss, sums (3,) float64 = [clipped tokens, sum of ratios, tokens]).
    """

    def __init__(self, policy: torch.nn.Module, settings: StepSettings):
        super().__init__()
        self.policy = policy
        self.settings = settings

    def forward(self, batch: dict[str, torch.Tensor], denominator: float, scale: float = 1.0):
        s = self.settings
        with _autocast(s, batch["input_ids"].device):
            # The decoder without its output layer: (B, L, H), never (B, L, V).
            hidden = self.policy.base_model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                use_cache=False,
            ).last_hidden_state
        mask = batch["completion_mask"].bool()  # (B, L-1)
        rows = mask.nonzero()[:, 0]  # (N,) row of each completion token
        head = output_layer(self.policy)
        loss, _, sums = ChunkedPolicyLoss.apply(
            hidden[:, :-1][mask],  # (N, H): position j predicts token j + 1
            head.weight,
            head.bias,
            batch["input_ids"][:, 1:][mask],  # (N,)
            batch["logp_behavior"][mask],  # (N,)
            batch["advantages"][rows],  # (N,)
            s,
            float(denominator),
            float(scale),
        )
        return loss, sums


def _autocast(settings: StepSettings, device: torch.device):
    if settings.dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def completion_logprobs(
    model: torch.nn.Module, rows: pa.Table, *, pad_id: int, settings: StepSettings
) -> list[np.ndarray]:
    """The policy's log-probs of each row's completion tokens, computed as a training step
    computes them (same micro-batches, precision, chunks and temperature), without a graph.
    Returns one float32 array per row, aligned with `behavior_logprobs`: comparing the two
    shows how far generation's numbers are from the trainer's."""
    device = next(model.parameters()).device
    head = output_layer(model)
    out: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * rows.num_rows
    groups = micro_batches(
        row_lengths(rows),
        max_rows=settings.micro_batch_size,
        max_tokens=settings.micro_batch_tokens,
    )
    model.eval()
    for idx in groups:
        batch = collate(rows.take(idx), pad_id=pad_id, device=device)
        with _autocast(settings, device):
            hidden = model.base_model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                use_cache=False,
            ).last_hidden_state  # (b, L, H)
        mask = batch["completion_mask"].bool()  # (b, L-1)
        compute = torch.bfloat16 if settings.dtype == "bfloat16" else torch.float32
        logp = chunked_logprobs(
            hidden=hidden[:, :-1][mask],
            weight=head.weight.to(compute),
            bias=head.bias,
            targets=batch["input_ids"][:, 1:][mask],
            temperature=settings.temperature,
            chunk_tokens=settings.logprob_chunk_tokens,
        ).cpu()
        counts = mask.sum(dim=1).tolist()
        for row, piece in zip(idx.tolist(), torch.split(logp, counts), strict=True):
            out[row] = piece.numpy()
    return out
