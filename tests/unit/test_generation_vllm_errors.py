"""The vLLM backend's pure parts and its errors where vLLM is not installed (the main
environment never has it: the `gpu` extra pins a CUDA build)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from replayrl.errors import ReplayRLError
from replayrl.generation import make_backend
from replayrl.generation_vllm import _finish_reason, _sampled_logprobs, request_seed

pytestmark = pytest.mark.unit
NO_VLLM = importlib.util.find_spec("vllm") is None


@pytest.mark.skipif(not NO_VLLM, reason="this environment has vLLM; tests/vllm covers it")
def test_missing_vllm_names_the_gpu_extra(tmp_path):
    with pytest.raises(ReplayRLError, match=r"replayrl\[gpu\].*rollout.backend=transformers"):
        make_backend("vllm", None, None, batch_size=8, checkpoint_dir=tmp_path)


def test_unknown_backend_is_rejected():
    with pytest.raises(ReplayRLError, match="'transformers' or 'vllm'"):
        make_backend("sglang", None, None, batch_size=8)


def test_request_seeds_are_stable_and_distinct():
    seeds = {
        request_seed(seed=7, prompt_index=i, sample_index=s) for i in range(20) for s in range(8)
    }
    assert len(seeds) == 160
    assert all(0 <= s < 2**31 for s in seeds)
    assert request_seed(seed=7, prompt_index=3, sample_index=1) == request_seed(
        seed=7, prompt_index=3, sample_index=1
    )
    assert request_seed(seed=7, prompt_index=3, sample_index=1) != request_seed(
        seed=8, prompt_index=3, sample_index=1
    )


def test_finish_reasons_follow_the_transformers_rule():
    assert _finish_reason([5, 6, 256], eos_id=256, max_new_tokens=6, vllm="stop") == "stop"
    assert _finish_reason([5, 6, 7], eos_id=256, max_new_tokens=3, vllm="length") == "length"
    # Cut short by max_model_len: not a "length" the trainer would recognise; say how to fix.
    with pytest.raises(ReplayRLError, match="max_model_len"):
        _finish_reason([5, 6], eos_id=256, max_new_tokens=6, vllm="length")
    with pytest.raises(RuntimeError, match="abort"):
        _finish_reason([5], eos_id=256, max_new_tokens=6, vllm="abort")


def test_sampled_logprobs_pick_the_sampled_token():
    lp = lambda x: SimpleNamespace(logprob=x)  # noqa: E731 - vLLM's Logprob has .logprob
    positions = [{5: lp(-0.5)}, {6: lp(-1.25), 9: lp(-0.1)}]
    assert _sampled_logprobs(positions, [5, 6]) == [-0.5, -1.25]
    with pytest.raises(RuntimeError, match="logprobs=0"):
        _sampled_logprobs(None, [5, 6])
