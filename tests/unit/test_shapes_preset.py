"""configs/shapes-cpu.yaml: the demo model's depth and width at Qwen2.5's vocabulary size.

Its v0 has 151,936 embedding rows and the padded byte tokenizer, and generation with them
works and never drops a sampled id past the tokenizer's tokens. The full iteration is
`bench/bench_shapes.py`'s job (minutes), not a test's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from replayrl.config import load_config
from replayrl.engine.inputs import task_splits
from replayrl.policy.generation import TransformersBackend
from replayrl.policy.models import WARM_START_FILE, _warm_start_key, initial_policy_dir, load_policy
from replayrl.policy.tokenizer import EOS_TOKEN_ID, UNUSED_TOKEN, UNUSED_TOKEN_ID

pytestmark = pytest.mark.unit
CONFIGS = Path(__file__).parents[2] / "configs"
QWEN_VOCAB = 151_936


def test_preset_shapes(tmp_path):
    # A run root of its own: task_splits checks a lineage's recorded task data, and the
    # presets' `runs` is the clone's own folder, where `make run` leaves a lineage.
    root = f"storage.run_root={tmp_path}"
    cfg = load_config(CONFIGS / "shapes-cpu.yaml", overrides=[root])
    assert cfg.model.vocab_size == QWEN_VOCAB and cfg.model.warm_start_max_steps == 0
    assert (cfg.model.hidden_size, cfg.model.num_layers) == (128, 4)
    assert cfg.rollout.max_new_tokens == 512 and cfg.train.batch_size == 64
    assert cfg.rollouts_per_iteration == 64 and cfg.train.steps_per_iteration <= 2
    assert cfg.eval.num_prompts * cfg.eval.num_samples <= 4
    # The vocabulary changes the warm-start cache key; the demo preset's key does not move.
    demo = load_config(CONFIGS / "tiny-cpu.yaml", overrides=[root])
    assert _warm_start_key(demo, task_splits(demo)) == "123019ddcdea6937"
    splits = task_splits(cfg)
    assert _warm_start_key(cfg, splits) != _warm_start_key(
        load_config(CONFIGS / "shapes-cpu.yaml", overrides=[root, "model.vocab_size=264"]),
        splits,
    )


def test_v0_has_the_real_vocabulary_and_generates(tmp_path):
    cfg = load_config(
        CONFIGS / "shapes-cpu.yaml",
        overrides=[f"model.cache_dir={tmp_path / 'cache'}", f"storage.run_root={tmp_path}"],
    )
    v0 = initial_policy_dir(cfg, task_splits(cfg))
    assert json.loads((v0 / WARM_START_FILE).read_text())["steps"] == 0
    config = AutoConfig.from_pretrained(v0)
    # Room for the longest prompt plus 512 new tokens, so nothing warns about positions.
    assert (config.vocab_size, config.hidden_size, config.max_position_embeddings) == (
        QWEN_VOCAB,
        128,
        768,
    )
    model, tokenizer = load_policy(v0)
    assert model.get_input_embeddings().weight.shape == (QWEN_VOCAB, 128)
    assert tokenizer.encode("48 + 57 =") == list(b"48 + 57 =")
    backend = TransformersBackend(model, tokenizer, batch_size=4)
    out = backend.generate(
        ["48 + 57 =", "12 + 30 ="],
        num_samples=2,
        max_new_tokens=4,
        temperature=1.0,
        top_p=1.0,
        seed=0,
        with_entropy=True,
    )
    assert len(out) == 4
    unused = 0
    for c in out:
        assert len(c.completion_token_ids) == len(c.logprobs) == 4  # EOS is 1 id in 151,936
        assert all(-20 < lp <= 0 for lp in c.logprobs)
        assert 0 < c.entropy <= 11.94  # at most ln(151,936): a near-uniform random model
        # A random model samples mostly ids past the 259 tokens: each reads as the placeholder.
        padded = [t for t in c.completion_token_ids if t >= UNUSED_TOKEN_ID]
        assert c.text.count(UNUSED_TOKEN) == len(padded)
        assert EOS_TOKEN_ID not in c.completion_token_ids
        unused += len(padded)
    assert unused > 0
