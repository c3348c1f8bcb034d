"""Every EOS id of a model's generation config ends a completion, in the transformers
backend as in vLLM (`generation.stop_token_ids`, one list for both). Chat checkpoints name
two (Qwen2.5-Instruct, Qwen3: 151645 and 151643); a completion that stopped on the second
was not recognised as finished."""

from __future__ import annotations

import pytest

from replayrl.policy.checkpoint_files import generation_eos_ids
from replayrl.policy.generation import TransformersBackend, stop_token_ids
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import EOS_TOKEN_ID, build_byte_tokenizer

pytestmark = pytest.mark.unit
PROMPTS = ["48 + 57 =", "12 + 30 ="]


def test_the_stop_list_is_the_tokenizer_eos_then_the_generation_config_ones():
    tok = build_byte_tokenizer()
    assert stop_token_ids(tok, None) == (EOS_TOKEN_ID,)
    assert stop_token_ids(tok, EOS_TOKEN_ID) == (EOS_TOKEN_ID,)
    assert stop_token_ids(tok, [EOS_TOKEN_ID, 3, 3]) == (EOS_TOKEN_ID, 3)
    assert stop_token_ids(tok, [7, EOS_TOKEN_ID]) == (EOS_TOKEN_ID, 7)


def _greedy(backend):
    return backend.generate(
        PROMPTS, num_samples=1, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=0, greedy=True
    )


def test_a_second_eos_id_of_the_generation_config_stops_the_transformers_backend(tmp_path):
    tok = build_byte_tokenizer()
    model = build_tiny_model(vocab_size=264, seed=5)
    # The untrained model's first greedy token on the first prompt becomes a second EOS id.
    first = _greedy(TransformersBackend(model, tok))[0]
    assert first.finish_reason == "length"
    second = first.completion_token_ids[0]
    assert second != EOS_TOKEN_ID
    model.generation_config.eos_token_id = [EOS_TOKEN_ID, second]
    # It survives a checkpoint (generation_config.json), where vLLM reads it.
    model.save_pretrained(tmp_path)
    assert generation_eos_ids(tmp_path) == [EOS_TOKEN_ID, second]

    stopped = _greedy(TransformersBackend(model, tok))[0]
    assert stopped.completion_token_ids == [second] and stopped.finish_reason == "stop"
    assert len(stopped.logprobs) == 1
