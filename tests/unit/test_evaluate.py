"""`evaluate_policy` on a real tiny model: which generation passes it makes at which
settings (the paper's evaluation: pass@1 at temperature 0.1 and top-p 0.95, pass@k with
top-p 0.95), and what it reports when the low-temperature pass@1 is off."""

from __future__ import annotations

import math

import pytest

from replayrl.config import RunConfig, config_from_dict
from replayrl.errors import ReplayRLError
from replayrl.policy.evaluation import evaluate_policy
from replayrl.policy.generation import TransformersBackend
from replayrl.policy.problems import Problem
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import build_byte_tokenizer

pytestmark = pytest.mark.unit


class Recording(TransformersBackend):
    """The real backend, recording the settings of each generation pass."""

    calls: list[dict]

    def generate(self, prompts, **kwargs):
        self.calls.append({"prompts": len(prompts), **kwargs})
        return super().generate(prompts, **kwargs)


@pytest.fixture(scope="module")
def backend():
    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        seed=0,
    )
    made = Recording(model, tokenizer, batch_size=64)
    made.calls = []
    return made


PROBLEMS = [Problem(f"p{i}", f"{i} + {i} =", str(2 * i), f" {2 * i}") for i in range(3)]


def run(backend, **settings):
    backend.calls.clear()
    return evaluate_policy(
        backend=backend,
        problems=PROBLEMS,
        reward_kind="integer",
        max_new_tokens=4,
        num_samples=4,
        k=2,
        temperature=1.0,
        seed=7,
        **settings,
    )


def test_the_papers_settings_add_a_low_temperature_pass1_and_a_nucleus_for_pass_at_k(backend):
    result = run(backend, top_p=0.95, pass1_temperature=0.1, pass1_top_p=0.95)
    greedy, low, sampled = backend.calls
    assert greedy["greedy"] is True
    assert (low["temperature"], low["top_p"], low["num_samples"]) == (0.1, 0.95, 4)
    assert (sampled["temperature"], sampled["top_p"]) == (1.0, 0.95)
    assert 0.0 <= result.pass1_sampled <= 1.0
    assert result.pass1_sampled * 12 == round(result.pass1_sampled * 12)  # of 3 × 4 samples


def test_without_it_there_is_no_extra_pass_and_nothing_to_log(backend):
    result = run(backend)
    assert len(backend.calls) == 2 and backend.calls[1]["top_p"] == 1.0
    assert math.isnan(result.pass1_sampled)


def test_the_knobs_are_checked_and_keep_old_hashes_at_their_defaults():
    assert config_from_dict({}).config_hash() == RunConfig().config_hash()
    paper = config_from_dict({"eval": {"pass1_temperature": 0.1, "top_p": 0.95}})
    assert paper.config_hash() != RunConfig().config_hash()
    for section, message in (
        ({"top_p": 0}, "eval.top_p must be in \\(0, 1\\]"),
        ({"pass1_top_p": 1.5}, "eval.pass1_top_p must be in \\(0, 1\\]"),
        ({"pass1_temperature": 0}, "eval.pass1_temperature must be > 0"),
    ):
        with pytest.raises(ReplayRLError, match=message):
            config_from_dict({"eval": section})
