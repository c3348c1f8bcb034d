"""The transformers backend on a real tiny model: determinism, structure, and log-probs that
agree with a training forward pass (so GRPO's first ratio is exactly 1)."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from replayrl.core.losses import token_logprobs
from replayrl.policy.batching import collate
from replayrl.policy.generation import TransformersBackend
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer

pytestmark = pytest.mark.integration
PROMPTS = ["12 + 34 =", "5 + 67 =", "99 + 1 ="]


@pytest.fixture(scope="module")
def backend():
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=3)
    return TransformersBackend(model, build_byte_tokenizer(), batch_size=4)


def sample(backend, seed, **kw):
    args = dict(num_samples=4, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=seed)
    args.update(kw)
    return backend.generate(PROMPTS, **args)


def test_same_seed_same_tokens_other_seed_other_tokens(backend):
    a, b, c = sample(backend, 1), sample(backend, 1), sample(backend, 2)
    assert [x.completion_token_ids for x in a] == [x.completion_token_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.completion_token_ids for x in a] != [x.completion_token_ids for x in c]


def test_structure(backend):
    out = sample(backend, 1)
    assert len(out) == len(PROMPTS) * 4
    assert [(c.prompt_index, c.sample_index) for c in out[:5]] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 0),
    ]
    eos = backend.tokenizer.eos_token_id
    for c in out:
        assert len(c.logprobs) == len(c.completion_token_ids) <= 6
        assert all(lp <= 0 for lp in c.logprobs)
        assert (c.finish_reason == "stop") == (c.completion_token_ids[-1] == eos)
        assert eos not in c.completion_token_ids[:-1]


def test_greedy_is_deterministic_across_seeds(backend):
    a = backend.generate(
        PROMPTS, num_samples=1, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=1, greedy=True
    )
    b = backend.generate(
        PROMPTS, num_samples=1, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=9, greedy=True
    )
    assert [x.completion_token_ids for x in a] == [x.completion_token_ids for x in b]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_a_training_forward_pass(backend, temperature):
    out = sample(backend, 5, temperature=temperature)
    rows = pa.table(
        {
            "prompt_token_ids": [c.prompt_token_ids for c in out],
            "completion_token_ids": [c.completion_token_ids for c in out],
            "behavior_logprobs": [c.logprobs for c in out],
            "advantage": [0.0] * len(out),
        }
    )
    batch = collate(rows, pad_id=backend.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = backend.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    logp_new = token_logprobs(
        logits=logits[:, :-1], target_ids=batch["input_ids"][:, 1:], temperature=temperature
    )
    mask = batch["completion_mask"].bool()
    diff = (logp_new - batch["logp_behavior"]).abs()[mask]
    assert diff.max().item() < 1e-4
