"""A lineage with task.prompt_format: chat, end to end on the inline engine: a tiny model whose
tokenizer carries a ChatML template (built in code, no download) generates from prompts its
template rendered, and the buffer's rows hold exactly that text and those token ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from chatml import chat_tokenizer

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import load_config
from replayrl.engine.inline import run_inline
from replayrl.policy.models import save_policy
from replayrl.policy.tiny_model import build_tiny_model

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


def test_a_chat_lineage_stores_the_prompts_its_template_rendered(tmp_path):
    model = build_tiny_model(
        vocab_size=264,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        seed=0,
    )
    tokenizer = chat_tokenizer()
    save_policy(model, tokenizer, tmp_path / "chat-model")
    cfg = load_config(
        PRESET,
        overrides=[
            f"storage.run_root={tmp_path / 'runs'}",
            f"model.cache_dir={tmp_path / 'cache'}",
            f"model.source={tmp_path / 'chat-model'}",
            "task.prompt_format=chat",
            "task.system_prompt=Add.",
            "task.chat_template_args={enable_thinking: false}",
            "task.num_train=40",
            "task.num_eval=4",
            "iterations=1",
            "rollout.prompts_per_iteration=4",
            "rollout.samples_per_prompt=2",
            "buffer.capacity=8",
            "buffer.positive_bias=0.0",
            "train.batch_size=8",
            "train.steps_per_iteration=1",
            "eval.num_prompts=4",
            "eval.num_samples=2",
            "eval.pass_k=2",
        ],
    )
    run_inline(cfg)
    buffer = ReplayBuffer(storage.lineage_paths(cfg.storage.run_root, cfg.lineage).buffer)
    rows = buffer.read().select(["prompt", "prompt_token_ids"]).to_pylist()
    assert len(rows) == 8
    for row in rows:
        prompt = row["prompt"]
        assert prompt.startswith("<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n")
        assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert row["prompt_token_ids"] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # The run's params name the template the prompts came from.
    from mlflow.tracking import MlflowClient

    from replayrl.policy.tokenizer import chat_template_hash

    state = storage.read_state(storage.lineage_paths(cfg.storage.run_root, cfg.lineage))
    params = MlflowClient(state.tracking_uri).get_run(state.mlflow_run_id).data.params
    assert params["task.chat_template_hash"] == chat_template_hash(tokenizer)
