"""model.untie_word_embeddings: v0 gets an output embedding of its own (the paper trained
Qwen3-0.6B untied), and every later load (from_pretrained, the weights index vLLM reads)
keeps the two matrices apart. On the tiny model built in code."""

from __future__ import annotations

import json

import pytest
import torch

from replayrl.config import load_config
from replayrl.policy.models import (
    WEIGHTS_INDEX,
    initial_policy_dir,
    load_policy,
    save_policy,
    untie_word_embeddings,
    untied_copy,
)
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import build_byte_tokenizer

pytestmark = pytest.mark.unit
SHAPE = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)


def tied_checkpoint(directory):
    model = build_tiny_model(vocab_size=264, seed=0, **SHAPE)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    save_policy(model, build_byte_tokenizer(), directory)
    return directory


def test_untying_makes_a_separate_trainable_copy():
    model = build_tiny_model(vocab_size=264, seed=0, **SHAPE)
    assert untie_word_embeddings(model)
    out, inp = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert out is not inp and out.requires_grad and torch.equal(out, inp)
    assert model.config.tie_word_embeddings is False
    assert {id(p) for p in model.parameters()} >= {id(out), id(inp)}
    assert not untie_word_embeddings(model)  # already untied: nothing to do


def test_v0_is_untied_and_a_checkpoint_reads_back_unchanged(tmp_path):
    source = tied_checkpoint(tmp_path / "tied")
    cfg = load_config(
        overrides=[
            f"model.source={source}",
            "model.untie_word_embeddings=true",
            f"model.cache_dir={tmp_path / 'cache'}",
        ]
    )
    v0 = initial_policy_dir(cfg, splits=None)  # a checkpoint directory needs no task
    assert v0 != source and untied_copy(cfg, source) == v0  # cached
    assert json.loads((v0 / "config.json").read_text())["tie_word_embeddings"] is False
    # The weights index (what vLLM loads) names the output embedding.
    assert "lm_head.weight" in json.loads((v0 / WEIGHTS_INDEX).read_text())["weight_map"]
    model, tokenizer = load_policy(v0)
    out, inp = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert out is not inp and torch.equal(out, inp)
    # Train only the output embedding, save, load: the input embedding stays as it was.
    with torch.no_grad():
        out.add_(1.0)
    save_policy(model, tokenizer, tmp_path / "v1")
    again, _ = load_policy(tmp_path / "v1")
    assert again.config.tie_word_embeddings is False
    assert torch.equal(again.get_output_embeddings().weight, out)
    assert torch.equal(again.get_input_embeddings().weight, inp)
    # Off (the default), or a checkpoint already untied: the source itself.
    plain = load_config(overrides=[f"model.source={source}"])
    assert initial_policy_dir(plain, splits=None) == source
    assert untied_copy(cfg, v0) == v0
    # At its default the knob leaves the config hash as it was; on, it is another lineage.
    assert plain.config_hash() != cfg.config_hash()


def test_the_tiny_model_built_in_code_is_untied_after_its_warm_start(tmp_path):
    from replayrl.policy.problems import load_task

    cfg = load_config(
        overrides=[
            "model.untie_word_embeddings=true",
            "model.warm_start_max_steps=0",  # no warm-start steps: only the path is tested
            "model.hidden_size=16",
            "model.num_layers=1",
            "model.num_heads=2",
            "model.num_kv_heads=1",
            "model.intermediate_size=32",
            "task.num_train=64",
            "task.num_eval=8",
            f"model.cache_dir={tmp_path}",
        ]
    )
    splits = load_task(name=cfg.task.name, num_train=64, num_eval=8, seed=cfg.seed)
    v0 = initial_policy_dir(cfg, splits)
    assert v0.parent.name == "untied"  # the copy of the cached warm start, not the cache
    model, _ = load_policy(v0)
    assert model.config.tie_word_embeddings is False
    out, inp = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert out is not inp and torch.equal(out, inp)
    assert (v0 / "warm_start.json").exists()
