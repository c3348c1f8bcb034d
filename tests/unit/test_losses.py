"""Policy losses, log-probs and entropy against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from replayrl.core.losses import (
    LossOutput,
    asymre_loss,
    grpo_loss,
    policy_loss,
    token_entropy,
    token_logprobs,
)

pytestmark = pytest.mark.unit

LOG_HALF = math.log(0.5)


def _logps_with_ratios(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: behaviour log-prob log(0.5) everywhere, new log-probs giving `ratios`."""
    logp_behavior = torch.full((1, len(ratios)), LOG_HALF)  # (1, T)
    logp_new = (logp_behavior + torch.log(torch.tensor([ratios]))).requires_grad_()  # (1, T)
    return logp_new, logp_behavior


def test_grpo_clips_above_with_positive_advantage_only():
    # A = +1, eps = 0.2, ratios [1.5, 1.0, 0.5]:
    #   1.5 -> min(1.5, 1.2) = 1.2 (clip binds: upper side, A > 0)
    #   1.0 -> 1.0
    #   0.5 -> min(0.5, 0.8) = 0.5 (below 1 - eps but NOT clipped for A > 0)
    # loss = -(1.2 + 1.0 + 0.5) / 3 = -0.9; clip fraction 1/3; mean ratio 1.0
    # d loss / d logp_new = -(ratio * A) / 3 where unclipped, 0 where clipped:
    #   [0, -1/3, -0.5/3]
    logp_new, logp_behavior = _logps_with_ratios([1.5, 1.0, 0.5])
    out = grpo_loss(
        logp_new=logp_new,
        logp_behavior=logp_behavior,
        advantages=torch.tensor([1.0]),
        completion_mask=torch.ones(1, 3, dtype=torch.bool),
        clip_eps=0.2,
    )
    assert out.loss.item() == pytest.approx(-0.9, abs=1e-6)
    assert out.clip_fraction == pytest.approx(1 / 3)
    assert out.mean_ratio == pytest.approx(1.0, abs=1e-6)
    assert out.num_tokens == 3
    out.loss.backward()
    torch.testing.assert_close(logp_new.grad, torch.tensor([[0.0, -1 / 3, -0.5 / 3]]))


def test_grpo_clips_below_with_negative_advantage_only():
    # A = -1, eps = 0.2, ratios [1.5, 1.0, 0.5]:
    #   1.5 -> min(-1.5, -1.2) = -1.5 (above 1 + eps but NOT clipped for A < 0)
    #   1.0 -> -1.0
    #   0.5 -> min(-0.5, -0.8) = -0.8 (clip binds: lower side, A < 0)
    # loss = -(-1.5 - 1.0 - 0.8) / 3 = 1.1; clip fraction 1/3
    # d loss / d logp_new = -(ratio * A) / 3 = ratio / 3 where unclipped: [0.5, 1/3, 0]
    logp_new, logp_behavior = _logps_with_ratios([1.5, 1.0, 0.5])
    out = grpo_loss(
        logp_new=logp_new,
        logp_behavior=logp_behavior,
        advantages=torch.tensor([-1.0]),
        completion_mask=torch.ones(1, 3),
    )
    assert out.loss.item() == pytest.approx(1.1, abs=1e-6)
    assert out.clip_fraction == pytest.approx(1 / 3)
    out.loss.backward()
    torch.testing.assert_close(logp_new.grad, torch.tensor([[0.5, 1 / 3, 0.0]]))


def test_grpo_token_mean_over_batch_and_padding_is_inert():
    # mask [[1, 1, 0], [1, 0, 0]], A = [1, -0.5], all ratios 1 on real tokens:
    # token mean = (1 + 1 - 0.5) / 3 = 0.5 -> loss -0.5
    # (a mean of per-row means would give (1 - 0.5) / 2 = 0.25)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -0.5])
    logp_behavior = torch.full((2, 3), LOG_HALF)

    def run(pad_new: float, pad_behavior: float) -> tuple[LossOutput, torch.Tensor]:
        logp_new = torch.full((2, 3), LOG_HALF).masked_fill(~mask, pad_new).requires_grad_()
        behavior = logp_behavior.masked_fill(~mask, pad_behavior)
        out = grpo_loss(
            logp_new=logp_new, logp_behavior=behavior, advantages=advantages, completion_mask=mask
        )
        out.loss.backward()
        return out, logp_new.grad

    base, base_grad = run(LOG_HALF, LOG_HALF)
    assert base.loss.item() == pytest.approx(-0.5, abs=1e-6)
    assert base.num_tokens == 3
    # Garbage in the padding (a ratio of e^1000, -inf log-probs) must change nothing.
    for pad_new, pad_behavior in [(0.0, -1000.0), (-math.inf, 0.0), (5.0, -math.inf)]:
        out, grad = run(pad_new, pad_behavior)
        assert out.loss.item() == base.loss.item()
        assert out.mean_ratio == base.mean_ratio
        assert out.clip_fraction == base.clip_fraction
        torch.testing.assert_close(grad, base_grad)
    assert base_grad[~mask].abs().sum().item() == 0.0


@pytest.mark.parametrize("name", ["grpo", "asymre"])
def test_empty_mask_gives_zero_loss_with_usable_backward(name):
    logp_new = torch.randn(2, 4).requires_grad_()
    out = policy_loss(
        loss=name,
        logp_new=logp_new,
        logp_behavior=torch.randn(2, 4),
        advantages=torch.tensor([1.0, -1.0]),
        completion_mask=torch.zeros(2, 4, dtype=torch.bool),
    )
    assert out.loss.item() == 0.0
    assert out.num_tokens == 0 and out.clip_fraction == 0.0 and out.mean_ratio == 1.0
    assert out.loss.grad_fn is not None
    out.loss.backward()
    assert logp_new.grad is not None
    assert torch.equal(logp_new.grad, torch.zeros(2, 4))


def test_asymre_hand_values_ignore_behavior_logprobs():
    # mask [[1, 1], [1, 0]], A = [0.85, -0.15], logp_new [[-1, -2], [-0.5, pad]]:
    # sum A * logp = 0.85 * -1 + 0.85 * -2 + -0.15 * -0.5 = -2.475; / 3 tokens = -0.825
    # loss = 0.825; d loss / d logp_new = -A / 3 = [[-0.28333, -0.28333], [0.05, 0]]
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    advantages = torch.tensor([0.85, -0.15])
    for logp_behavior in [torch.zeros(2, 2), torch.full((2, 2), -7.0)]:
        logp_new = torch.tensor([[-1.0, -2.0], [-0.5, -math.inf]], requires_grad=True)
        out = asymre_loss(
            logp_new=logp_new,
            logp_behavior=logp_behavior,
            advantages=advantages,
            completion_mask=mask,
        )
        assert out.loss.item() == pytest.approx(0.825, abs=1e-6)
        assert out.clip_fraction == 0.0
        out.loss.backward()
        torch.testing.assert_close(
            logp_new.grad, torch.tensor([[-0.85 / 3, -0.85 / 3], [0.05, 0.0]])
        )


def test_asymre_is_cap_truncates_a_detached_weight():
    # A = 1, logp_new [-1, -2], ratios [3.0, 0.5], is_cap 2 -> w = [min(3, 2), 0.5] = [2, 0.5]
    # loss = -(2 * -1 + 0.5 * -2) / 2 = 1.5
    # w is detached, so d loss / d logp_new = -w * A / 2 = [-1, -0.25]
    # (a differentiated w would give -(w + w * logp) / 2 = +0.25 for the second token)
    logp_new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    logp_behavior = logp_new.detach() - torch.log(torch.tensor([[3.0, 0.5]]))
    out = asymre_loss(
        logp_new=logp_new,
        logp_behavior=logp_behavior,
        advantages=torch.tensor([1.0]),
        completion_mask=torch.ones(1, 2),
        is_cap=2.0,
    )
    assert out.loss.item() == pytest.approx(1.5, abs=1e-6)
    assert out.mean_ratio == pytest.approx(1.75, abs=1e-6)  # (3 + 0.5) / 2, uncapped
    out.loss.backward()
    torch.testing.assert_close(logp_new.grad, torch.tensor([[-1.0, -0.25]]))


def test_policy_loss_dispatches_and_rejects_bad_options():
    kwargs = dict(
        logp_new=torch.tensor([[-1.0, -0.5]]),
        logp_behavior=torch.tensor([[-1.2, -0.4]]),
        advantages=torch.tensor([0.7]),
        completion_mask=torch.ones(1, 2),
    )
    # ratios e^0.2 = 1.2214 (clipped at 1.1) and e^-0.1 = 0.9048; A = 0.7:
    # loss = -(1.1 * 0.7 + 0.9048 * 0.7) / 2 = -0.70169
    dispatched = policy_loss(loss="grpo", clip_eps=0.1, **kwargs)
    assert dispatched.loss.item() == pytest.approx(-(1.1 + math.exp(-0.1)) * 0.7 / 2, abs=1e-6)
    assert dispatched.clip_fraction == 0.5
    assert policy_loss(loss="asymre", is_cap=1.5, **kwargs).loss.item() == pytest.approx(
        asymre_loss(is_cap=1.5, **kwargs).loss.item()
    )
    with pytest.raises(ValueError, match="grpo, asymre"):
        policy_loss(loss="reinforce", **kwargs)
    with pytest.raises(ValueError, match="is_cap applies to loss='asymre' only"):
        policy_loss(loss="grpo", is_cap=2.0, **kwargs)
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(**{**kwargs, "advantages": torch.tensor([0.7, 0.1])})


def test_token_logprobs_matches_hand_log_softmax():
    # softmax([0, ln 2, ln 3]) = [1, 2, 3] / 6, so log p(id 2) = ln 0.5 and log p(id 0) = ln(1/6).
    # At temperature 2 the logits [0, 2 ln 2, 2 ln 3] give the same distribution.
    row = torch.tensor([0.0, math.log(2), math.log(3)])
    logits = torch.stack([row, row]).unsqueeze(0)  # (1, 2, 3)
    got = token_logprobs(logits=logits, target_ids=torch.tensor([[2, 0]]))
    torch.testing.assert_close(got, torch.tensor([[math.log(0.5), math.log(1 / 6)]]))
    got_t2 = token_logprobs(
        logits=(2 * logits).bfloat16(), target_ids=torch.tensor([[2, 0]]), temperature=2.0
    )
    assert got_t2.dtype == torch.float32
    torch.testing.assert_close(got_t2, got, atol=1e-2, rtol=0)  # bf16 input rounding only


def test_token_logprobs_backward_agrees_with_log_softmax():
    logits = torch.randn(2, 3, 11, requires_grad=True)
    target_ids = torch.randint(0, 11, (2, 3))
    ours = token_logprobs(logits=logits, target_ids=target_ids, temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(ours, ref)
    (grad_ours,) = torch.autograd.grad(ours.sum(), logits)
    (grad_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(grad_ours, grad_ref)


def test_token_entropy_uniform_is_log_v_and_banned_tokens_are_zero():
    # Uniform over V = 7 at any temperature -> ln 7; [0, 0, -inf, -inf] -> uniform over 2 -> ln 2
    uniform = torch.zeros(2, 3, 7)
    torch.testing.assert_close(token_entropy(logits=uniform), torch.full((2, 3), math.log(7)))
    torch.testing.assert_close(
        token_entropy(logits=uniform + 4.0, temperature=0.5), torch.full((2, 3), math.log(7))
    )
    banned = torch.tensor([[[0.0, 0.0, -math.inf, -math.inf]]], requires_grad=True)
    entropy = token_entropy(logits=banned)
    torch.testing.assert_close(entropy, torch.tensor([[math.log(2)]]))
    entropy.sum().backward()
    assert torch.isfinite(banned.grad).all()


def test_token_entropy_of_one_hot_is_zero():
    logits = torch.tensor([[[50.0, 0.0, 0.0]]])  # p(0) = 1 - 2e-22: entropy ~ 1e-20
    assert token_entropy(logits=logits).item() == pytest.approx(0.0, abs=1e-6)


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(logits=torch.zeros(1, 1, 3), target_ids=torch.zeros(1, 1), temperature=0.0)
