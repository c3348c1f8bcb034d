"""A gradient step whose loss or gradient norm is NaN or infinite is refused before the
optimizer steps: one clear error naming the iteration and the step, and the weights and the
optimizer state exactly as they were."""

from __future__ import annotations

import copy

import numpy as np
import pyarrow as pa
import pytest
import torch

from replayrl.engine.resources import Trainer
from replayrl.errors import ReplayRLError
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer
from replayrl.policy.training import NonFiniteStepError, StepSettings, make_optimizer

pytestmark = pytest.mark.unit
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


def rows(*, advantage: float = 1.0, behavior_logprob: float = -5.6, n: int = 4) -> pa.Table:
    rng = np.random.default_rng(0)
    completions = [rng.integers(0, 256, 5).tolist() for _ in range(n)]
    return pa.table(
        {
            "prompt_token_ids": [rng.integers(0, 256, 3).tolist() for _ in range(n)],
            "completion_token_ids": completions,
            "behavior_logprobs": [[behavior_logprob] * len(c) for c in completions],
            "advantage": np.array([advantage, -advantage] * (n // 2), np.float32),
            "reward": np.array([1.0, 0.0] * (n // 2), np.float32),
        }
    )


def trainer(version: int) -> Trainer:
    model = build_tiny_model(vocab_size=VOCAB_SIZE, hidden_size=32, num_layers=1, seed=3)
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999))
    return Trainer(model, build_byte_tokenizer(), optimizer, settings=SETTINGS, version=version)


def snapshot(t: Trainer) -> tuple[dict, dict]:
    return copy.deepcopy(t.model.state_dict()), copy.deepcopy(t.optimizer.state_dict())


def assert_same(a: dict, b: dict) -> None:
    for key, value in a.items():
        if isinstance(value, dict):
            assert_same(value, b[key])
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


@pytest.mark.parametrize(
    "bad,what",
    [
        (dict(advantage=float("nan")), "loss is nan"),
        (dict(behavior_logprob=float("nan")), "loss is nan"),
        (dict(behavior_logprob=-float("inf")), "loss is inf"),  # a ratio of inf
    ],
)
def test_a_non_finite_step_is_refused_naming_iteration_and_step(bad, what):
    t = trainer(version=4)
    t.train([rows()], seed=0)  # v5: the optimizer has state worth keeping
    weights, optimizer = snapshot(t)
    with pytest.raises(NonFiniteStepError) as err:
        t.train([rows(**bad)], seed=1)
    message = str(err.value)
    assert isinstance(err.value, ReplayRLError) and "\n" not in message
    assert message.startswith("iteration 6, gradient step 1: the ") and what in message
    assert (err.value.iteration, err.value.step) == (6, 1)
    assert t.version == 5  # nothing applied: still v5, reusable
    after_weights, after_optimizer = snapshot(t)
    assert_same(weights, after_weights)
    assert_same(optimizer, after_optimizer)
    assert all(p.grad is None for p in t.model.parameters())


def test_a_refused_step_after_applied_ones_leaves_no_policy_version():
    """Step 1 of the iteration moved the weights, step 2 is refused: the trainer's weights
    are no version any more, so nothing reuses them as v3."""
    t = trainer(version=2)
    with pytest.raises(NonFiniteStepError, match=r"^iteration 3, gradient step 2: the loss"):
        t.train([rows(), rows(advantage=float("nan"))], seed=0)
    assert t.version == -1


def test_the_caller_names_the_iteration():
    t = trainer(version=40)  # e.g. the asynchronous engine, whose versions are steps
    with pytest.raises(NonFiniteStepError, match=r"^iteration 11, gradient step 1"):
        t.train([rows(advantage=float("nan"))], seed=0, iteration=11)


def test_an_infinite_gradient_norm_with_a_finite_loss_is_refused():
    t = trainer(version=0)
    weights, _ = snapshot(t)
    first = next(t.model.parameters())
    first.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    with pytest.raises(
        NonFiniteStepError, match=r"^iteration 1, gradient step 1: the gradient norm is inf"
    ):
        t.train([rows()], seed=0)
    assert_same(weights, snapshot(t)[0])
