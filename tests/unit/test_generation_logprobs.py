"""The transformers backend's log-probs, recorded step by step during generation: equal to
the log-softmax of the scores transformers itself reports (the distribution the sampler
drew from), and without holding rows x tokens x vocabulary of them."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from replayrl.policy.generation import TransformersBackend
from replayrl.policy.tiny_model import build_tiny_model, supervised_loss
from replayrl.policy.tokenizer import EOS_TOKEN_ID, build_byte_tokenizer

pytestmark = pytest.mark.unit
PROMPTS = ["48 + 57 =", "12 + 30 =", "90 - 15 =", "70 - 81 ="]


@pytest.fixture(scope="module")
def backend():
    """A tiny model taught to answer and stop, so rows end at different lengths."""
    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(vocab_size=264, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        loss = supervised_loss(
            model=model,
            tokenizer=tokenizer,
            prompts=PROMPTS,
            targets=[" 105", " 42", " 75", " -11"],
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return TransformersBackend(model, tokenizer, batch_size=16)


def reference(backend, *, temperature, top_p, greedy, seed):
    """What transformers reports with output_scores=True: (ids, log-probs, entropies)."""
    tok = backend.tokenizer
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    config = GenerationConfig(
        max_new_tokens=10,
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_p=top_p if not greedy and top_p < 1.0 else None,
        top_k=None if greedy else 0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        return_dict_in_generate=True,
        output_scores=True,
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        result = backend.model.eval().generate(**batch, generation_config=config)
    new = result.sequences[:, batch["input_ids"].shape[1] :]  # (N, T)
    logp_all = torch.log_softmax(torch.stack(result.scores, dim=1).float(), dim=-1)  # (N, T, V)
    logp = logp_all.gather(-1, new[..., None]).squeeze(-1)  # (N, T)
    entropy = torch.special.entr(logp_all.exp()).sum(-1)  # (N, T)
    return new, logp, entropy


@pytest.mark.parametrize(
    "temperature,top_p,greedy", [(1.0, 1.0, False), (0.7, 0.9, False), (1.0, 1.0, True)]
)
def test_logprobs_equal_those_of_the_reported_scores(backend, temperature, top_p, greedy):
    # One generate call of all four prompts, as the reference makes: the same random stream.
    out = backend.generate(
        PROMPTS,
        num_samples=1,
        max_new_tokens=10,
        temperature=temperature,
        top_p=top_p,
        seed=0,
        greedy=greedy,
        with_entropy=True,
    )
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(0)))
    ids, logp, entropy = reference(
        backend, temperature=temperature, top_p=top_p, greedy=greedy, seed=seed
    )
    stopped = 0
    for row, c in enumerate(out):
        n = len(c.completion_token_ids)
        assert c.completion_token_ids == ids[row, :n].tolist()
        assert torch.equal(torch.tensor(c.logprobs), logp[row, :n])
        assert c.entropy == pytest.approx(float(entropy[row, :n].mean()), abs=1e-6)
        stopped += c.completion_token_ids[-1] == EOS_TOKEN_ID
    assert stopped >= 2  # rows of unequal length, some cut at EOS
    if top_p < 1.0:  # top-p masked tokens out: entropy is that of the truncated distribution
        assert all(c.entropy < float(entropy.max()) + 1e-6 for c in out)


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def test_memory_grows_with_one_step_of_scores_not_all_of_them():
    """4 rows x 64 tokens over 151,936 ids: all steps' float32 scores would be 156 MB, with
    their stacked copy and log-softmax ~450 MB (measured before this was fixed); one step's
    are 2.4 MB."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets this process's peak RSS (VmHWM) to its current RSS
    except OSError:
        pytest.skip("cannot reset the peak RSS here (/proc/self/clear_refs)")
    model = build_tiny_model(vocab_size=151_936, seed=0, max_position_embeddings=256)
    backend = TransformersBackend(model, build_byte_tokenizer(vocab_size=151_936), batch_size=4)
    backend.generate(
        PROMPTS[:1], num_samples=1, max_new_tokens=2, temperature=1.0, top_p=1.0, seed=0
    )
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_mib("VmRSS:")
    out = backend.generate(
        PROMPTS[:1], num_samples=4, max_new_tokens=64, temperature=1.0, top_p=1.0, seed=0
    )
    assert [len(c.logprobs) for c in out] == [64] * 4
    assert _rss_mib("VmHWM:") - before < 100
