"""Gradient steps on batches of stored rollouts.

Turns rows of the buffer (prompt ids, completion ids, behaviour log-probs, fixed
advantages) into padded tensors, runs the policy forward, and applies the loss from
`losses`. Knows nothing about where the rows or checkpoints live.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from replayrl.losses import policy_loss, token_logprobs


@dataclass(frozen=True)
class StepSettings:
    """What one gradient step needs besides the model, the optimizer and the rows."""

    loss_name: str
    clip_eps: float
    is_cap: float | None
    temperature: float  # the sampling temperature the behaviour log-probs were taken at
    grad_clip: float  # 0 = off
    lr: float
    weight_decay: float
    betas: tuple[float, float]


@dataclass(frozen=True)
class StepStats:
    loss: float
    clip_fraction: float
    mean_ratio: float
    grad_norm: float
    num_tokens: int
    mean_advantage: float
    mean_reward: float


def collate(rows: pa.Table, *, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded (prompt + completion) sequences with masks aligned to next-token targets.

    Worked example: prompt [5, 6], completion [7, 8(eos)], pad 0, longest row 5 tokens:
        input_ids       [5, 6, 7, 8, 0]
        targets         [6, 7, 8, 0]        (input_ids shifted left)
        completion_mask [0, 1, 1, 0]        (targets that are completion tokens)
        logp_behavior   [0, l7, l8, 0]
    """
    prompts = rows.column("prompt_token_ids").to_pylist()
    completions = rows.column("completion_token_ids").to_pylist()
    behavior = rows.column("behavior_logprobs").to_pylist()
    n = len(prompts)
    length = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)  # (B, L)
    attention = torch.zeros((n, length), dtype=torch.long)  # (B, L)
    completion_mask = torch.zeros((n, length - 1), dtype=torch.float32)  # (B, L-1)
    logp_behavior = torch.zeros((n, length - 1), dtype=torch.float32)  # (B, L-1)
    for i, (p, c, lb) in enumerate(zip(prompts, completions, behavior, strict=True)):
        seq = p + c
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        # Target position j predicts input_ids[j + 1]; completion token k sits at len(p) + k.
        start = len(p) - 1
        completion_mask[i, start : start + len(c)] = 1.0
        logp_behavior[i, start : start + len(c)] = torch.tensor(lb, dtype=torch.float32)
    advantages = torch.tensor(
        rows.column("advantage").to_numpy(zero_copy_only=False), dtype=torch.float32
    )  # (B,)
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "completion_mask": completion_mask,
        "logp_behavior": logp_behavior,
        "advantages": advantages,
    }


def batch_loss(*, model: torch.nn.Module, rows: pa.Table, pad_id: int, settings: StepSettings):
    """The collated batch (on the model's device) and the policy loss of `rows` (a forward
    pass in training mode); shared by the single-process and the distributed step."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in collate(rows, pad_id=pad_id).items()}
    model.train()
    # use_cache=False: a training pass needs no KV cache, and building one costs time.
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits  # (B, L, V)
    logp_new = token_logprobs(
        logits=logits[:, :-1],
        target_ids=batch["input_ids"][:, 1:],
        temperature=settings.temperature,
    )  # (B, L-1)
    out = policy_loss(
        loss=settings.loss_name,
        logp_new=logp_new,
        logp_behavior=batch["logp_behavior"],
        advantages=batch["advantages"],
        completion_mask=batch["completion_mask"],
        clip_eps=settings.clip_eps,
        is_cap=settings.is_cap,
    )
    return batch, out


def gradient_step(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: pa.Table,
    pad_id: int,
    settings: StepSettings,
) -> StepStats:
    batch, out = batch_loss(model=model, rows=rows, pad_id=pad_id, settings=settings)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    if settings.grad_clip > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, settings.grad_clip))
    else:
        grad_norm = (
            float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
            if params
            else 0.0
        )
    optimizer.step()
    rewards = rows.column("reward").to_numpy(zero_copy_only=False)
    return StepStats(
        loss=float(out.loss.detach()),
        clip_fraction=float(out.clip_fraction),
        mean_ratio=float(out.mean_ratio),
        grad_norm=grad_norm,
        num_tokens=int(out.num_tokens),
        mean_advantage=float(batch["advantages"].mean()),
        mean_reward=float(np.mean(rewards)) if len(rewards) else 0.0,
    )


def make_optimizer(
    model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float]
):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)
