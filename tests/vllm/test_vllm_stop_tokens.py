"""vLLM stops on every EOS id of the checkpoint's generation_config.json (it adds them to
the stop ids itself, even with generation_config="vllm"), and the backend then reports
"stop", as the transformers backend does (`generation.stop_token_ids`). Before, a
completion that ended on a second EOS id raised "stopped without a final EOS"."""

from __future__ import annotations

import json
import shutil

import pytest
from vllm_reference import MAX_NEW_TOKENS, PROMPTS, load_warm_model

from replayrl.policy.generation import TransformersBackend, make_backend
from replayrl.policy.tokenizer import EOS_TOKEN_ID

pytestmark = pytest.mark.integration
ARGS = dict(num_samples=1, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, seed=0)


def test_a_second_eos_id_of_the_generation_config_is_a_stop(warm_checkpoint, tmp_path):
    directory = tmp_path / "two-eos"
    shutil.copytree(warm_checkpoint, directory)
    model, tokenizer = load_warm_model(directory)
    first = TransformersBackend(model, tokenizer).generate(PROMPTS[:1], greedy=True, **ARGS)[0]
    second = first.completion_token_ids[0]
    assert second != EOS_TOKEN_ID
    config_file = directory / "generation_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    config_file.write_text(json.dumps({**config, "eos_token_id": [EOS_TOKEN_ID, second]}))

    model, tokenizer = load_warm_model(directory)
    want = TransformersBackend(model, tokenizer).generate(PROMPTS[:1], greedy=True, **ARGS)
    backend = make_backend(
        "vllm",
        None,
        None,
        batch_size=8,
        checkpoint_dir=directory,
        vllm_options=dict(dtype="float32", max_model_len=64, enforce_eager=True, seed=0),
    )
    try:
        got = backend.generate(PROMPTS[:1], greedy=True, **ARGS)
    finally:
        backend.close()
    assert got[0].completion_token_ids == want[0].completion_token_ids == [second]
    assert got[0].finish_reason == want[0].finish_reason == "stop"
