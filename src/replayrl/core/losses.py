"""Policy-gradient losses as pure functions over padded (B, T) tensors.

Inputs are per-token log-probs of the *stored* completion tokens: `logp_new` under the
policy being trained (carries the graph), `logp_behavior` as recorded when the rollout
was generated, one advantage per row (fixed at generation, see `replayrl.core.advantages`),
and `completion_mask` (1 for real completion tokens, 0 for prompt and padding).

Reduction is a token mean over the whole batch: sum over masked tokens divided by the
number of masked tokens, so long completions weigh more than short ones (our
choice: the paper does not say whether it averages per sequence or per batch, App. 10.2). Padded positions never reach the arithmetic: values there are replaced before
`exp`, so a padded log-prob of -inf or garbage changes neither the loss nor the grads.

This module knows nothing about models, tokenizers, optimisers or the buffer: it turns
tensors into a scalar loss plus a few diagnostics, which stay tensors on the loss's device
(`LossOutput`), so no loss waits for the device to finish.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayrl.core.advantages import LOSS_NAMES


@dataclass(frozen=True)
class LossOutput:
    """A scalar loss to backpropagate and diagnostics for logging.

    The diagnostics are kept as tensors on the loss's device, so computing a loss never
    waits for the device; the float properties read them (each read is a host sync), and a
    caller that adds up many losses (`policy.loss_kernels`, chunk by chunk) adds the tensors.

    loss:           scalar tensor; minimise it.
    clipped_tokens: scalar float32, masked tokens where PPO clipping bound (the clipped
                    branch was selected, so the token contributed no gradient); 0 for asymre.
    ratio_sum:      scalar float32, sum of pi_new / pi_behavior over the masked tokens.
    token_count:    scalar int64, masked tokens the means run over.
    clip_fraction:  clipped_tokens / token_count as a float; 0.0 when the mask is empty.
    mean_ratio:     ratio_sum / token_count as a float; 1.0 means the stored rollouts are
                    still on-policy, and 1.0 when the mask is empty.
    num_tokens:     token_count as an int.
    """

    loss: torch.Tensor
    clipped_tokens: torch.Tensor
    ratio_sum: torch.Tensor
    token_count: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_count.item())

    @property
    def clip_fraction(self) -> float:
        return _mean_float(self.clipped_tokens, self.num_tokens, empty=0.0)

    @property
    def mean_ratio(self) -> float:
        return _mean_float(self.ratio_sum, self.num_tokens, empty=1.0)


def _check_shapes(
    *,
    logp_new: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
) -> None:
    if logp_new.ndim != 2:
        raise ValueError(f"logp_new must be (B, T), got shape {tuple(logp_new.shape)}")
    if logp_behavior.shape != logp_new.shape or completion_mask.shape != logp_new.shape:
        raise ValueError(
            "logp_new, logp_behavior and completion_mask must share one (B, T) shape, got "
            f"{tuple(logp_new.shape)}, {tuple(logp_behavior.shape)}, "
            f"{tuple(completion_mask.shape)}"
        )
    if advantages.shape != logp_new.shape[:1]:
        raise ValueError(
            f"advantages must be (B,) = ({logp_new.shape[0]},), got {tuple(advantages.shape)}"
        )


def _prepare(
    *,
    logp_new: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared front end: float32 math, padding neutralised before any exp.

    Returns (mask (B, T) bool, logp_new (B, T) with 0 at padding, log_ratio (B, T) with
    0 at padding, advantages (B, 1), number of masked tokens (a scalar int64 tensor)).
    """
    _check_shapes(
        logp_new=logp_new,
        logp_behavior=logp_behavior,
        advantages=advantages,
        completion_mask=completion_mask,
    )
    mask = completion_mask.to(device=logp_new.device, dtype=torch.bool)  # (B, T)
    # torch.where (not a multiply by the mask): 0 * inf is NaN, and padded log-probs can
    # be -inf. The gradient through the unselected branch is an exact 0.
    logp_new_f32 = torch.where(mask, logp_new.float(), 0.0)  # (B, T)
    logp_behavior_f32 = torch.where(mask, logp_behavior.to(logp_new.device).float(), 0.0)
    log_ratio = logp_new_f32 - logp_behavior_f32  # (B, T), 0 at padding -> ratio 1
    advantages_f32 = advantages.to(logp_new.device).float().detach().unsqueeze(1)  # (B, 1)
    num_tokens = mask.sum()  # scalar int64, on the device: no host sync
    return mask, logp_new_f32, log_ratio, advantages_f32, num_tokens


def _token_mean(
    *, values: torch.Tensor, mask: torch.Tensor, num_tokens: torch.Tensor
) -> torch.Tensor:
    """Sum of `values` (B, T) over masked tokens / num_tokens; an empty mask gives a 0
    that is still attached to the graph, so `loss.backward()` works (zero grads)."""
    total = torch.where(mask, values, 0.0).sum()  # scalar
    return total / num_tokens.clamp(min=1)


def _masked_sum(*, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` (B, T) over masked tokens, detached. Returns a scalar."""
    return torch.where(mask, values.detach(), 0.0).sum()


def _mean_float(total: torch.Tensor, count: int, *, empty: float) -> float:
    """total / count as a float (`empty` for no tokens): one host sync."""
    if count == 0:
        return empty
    return float(total.item() / count)


def grpo_loss(
    *,
    logp_new: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> LossOutput:
    """PPO-clip surrogate with fixed group-normalised advantages, token mean, no KL term.

    ratio = exp(logp_new - logp_behavior)                      # (B, T)
    objective = min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)
    loss = -token_mean(objective)

    With A > 0 the clip binds above 1 + eps; with A < 0 it binds below 1 - eps. Where it
    binds, the selected branch is a constant, so that token's gradient is exactly 0: a
    stale rollout cannot push the policy further than eps from its behaviour policy.
    `clip_eps` is the paper's 0.2 (App. 10.2).
    """
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    mask, _, log_ratio, adv, num_tokens = _prepare(
        logp_new=logp_new,
        logp_behavior=logp_behavior,
        advantages=advantages,
        completion_mask=completion_mask,
    )
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = ratio * adv  # (B, T)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv  # (B, T)
    objective = torch.minimum(unclipped, clipped)  # (B, T)
    loss = -_token_mean(values=objective, mask=mask, num_tokens=num_tokens)

    with torch.no_grad():
        # Strict inequalities: at ratio == 1 +- eps both branches agree, nothing is lost.
        binds = ((adv > 0) & (ratio > 1.0 + clip_eps)) | ((adv < 0) & (ratio < 1.0 - clip_eps))
        clipped = _masked_sum(values=binds.float(), mask=mask)
        ratio_sum = _masked_sum(values=ratio, mask=mask)
    return LossOutput(
        loss=loss, clipped_tokens=clipped, ratio_sum=ratio_sum, token_count=num_tokens
    )


def asymre_loss(
    *,
    logp_new: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    is_cap: float | None = None,
) -> LossOutput:
    """Asymmetric REINFORCE: loss = -token_mean(w * A * logp_new).

    The paper uses no importance ratio (App. 10.2; w = 1, `is_cap=None`, the default): the
    advantage's negative baseline shift (delta_v, see `asymre_advantages`) is what keeps
    it stable off-policy. Beyond the paper, `is_cap` > 0 turns on a truncated importance
    weight w = min(pi_new / pi_behavior, is_cap), detached so it scales the gradient
    without being differentiated itself. `logp_behavior` is always used for `mean_ratio`.
    """
    if is_cap is not None and is_cap <= 0:
        raise ValueError(f"is_cap must be > 0 or None (no importance weight), got {is_cap}")
    mask, logp_new_f32, log_ratio, adv, num_tokens = _prepare(
        logp_new=logp_new,
        logp_behavior=logp_behavior,
        advantages=advantages,
        completion_mask=completion_mask,
    )
    ratio = torch.exp(log_ratio.detach())  # (B, T)
    objective = adv * logp_new_f32  # (B, T)
    if is_cap is not None:
        objective = torch.clamp(ratio, max=is_cap) * objective  # (B, T)
    loss = -_token_mean(values=objective, mask=mask, num_tokens=num_tokens)
    return LossOutput(
        loss=loss,
        clipped_tokens=torch.zeros((), device=loss.device),
        ratio_sum=_masked_sum(values=ratio, mask=mask),
        token_count=num_tokens,
    )


def policy_loss(
    *,
    loss: str,
    logp_new: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    clip_eps: float = 0.2,
    is_cap: float | None = None,
) -> LossOutput:
    """Dispatch on the loss name: "grpo" -> grpo_loss, "asymre" -> asymre_loss.

    `clip_eps` is read by "grpo" only. `is_cap` belongs to "asymre" only: GRPO already
    bounds the ratio by clipping, so passing `is_cap` with "grpo" raises ValueError
    rather than being silently ignored.
    """
    tensors = dict(
        logp_new=logp_new,
        logp_behavior=logp_behavior,
        advantages=advantages,
        completion_mask=completion_mask,
    )
    if loss == "grpo":
        if is_cap is not None:
            raise ValueError(
                "is_cap applies to loss='asymre' only; GRPO clips its ratio with clip_eps. "
                "Set is_cap to None."
            )
        return grpo_loss(**tensors, clip_eps=clip_eps)
    if loss == "asymre":
        return asymre_loss(**tensors, is_cap=is_cap)
    raise ValueError(f"unknown loss {loss!r}; valid losses are {', '.join(LOSS_NAMES)}")


def _scaled_logits(*, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0, got {temperature}; greedy decoding has no log-probs "
            "to train on, score it at temperature 1.0"
        )
    if logits.ndim != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    # float32 math: bf16 log-softmax over a 150k vocabulary loses the small log-probs
    # that the ratio exp(logp_new - logp_behavior) is sensitive to.
    return logits.float() / temperature  # (B, T, V)


def token_logprobs(
    *, logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature) at `target_ids`, in float32. Returns (B, T).

    No shifting happens here: `logits[:, t]` must already be the distribution that
    produced `target_ids[:, t]`. Padded positions need a valid id (e.g. the pad token);
    mask them afterwards. Use the sampling temperature so the result is comparable with
    the behaviour log-probs recorded at generation.
    """
    scaled = _scaled_logits(logits=logits, temperature=temperature)  # (B, T, V)
    if target_ids.shape != scaled.shape[:2]:
        raise ValueError(
            f"target_ids must be (B, T) = {tuple(scaled.shape[:2])}, got {tuple(target_ids.shape)}"
        )
    index = target_ids.to(device=scaled.device, dtype=torch.long).unsqueeze(-1)  # (B, T, 1)
    # gather - logsumexp avoids materialising (and saving for backward) a full
    # (B, T, V) log-softmax output.
    target_logits = torch.gather(scaled, dim=-1, index=index).squeeze(-1)  # (B, T)
    return target_logits - torch.logsumexp(scaled, dim=-1)  # (B, T)


def token_entropy(*, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy in nats of softmax(logits / temperature) at each position. Returns (B, T).

    Logits of -inf (banned tokens) are fine: they contribute 0, not NaN.
    """
    scaled = _scaled_logits(logits=logits, temperature=temperature)  # (B, T, V)
    logp = torch.log_softmax(scaled, dim=-1)  # (B, T, V)
    # p * log p with p = 0 is 0 * -inf = NaN; clamping log p to the most negative finite
    # float makes it 0 * finite = 0 and keeps the backward finite too.
    logp_finite = logp.clamp(min=torch.finfo(logp.dtype).min)  # (B, T, V)
    return -(logp.exp() * logp_finite).sum(dim=-1)  # (B, T)
