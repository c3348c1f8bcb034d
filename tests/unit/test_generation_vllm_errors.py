"""The vLLM backend's pure parts (including its default share of GPU memory) and its errors
where vLLM is not installed (the main environment never has it: the `gpu` extra pins a CUDA
build)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from replayrl.config import load_config
from replayrl.engine.resources import TaskResources, checkpoint_num_params
from replayrl.errors import ReplayRLError
from replayrl.policy.engine_share import (
    ALONE_MEMORY_SHARE,
    MIN_MEMORY_SHARE,
    TRAINER_BYTES_PER_PARAM,
    memory_share,
)
from replayrl.policy.generation import make_backend
from replayrl.policy.generation_vllm import _finish_reason, _sampled_logprobs, request_seed
from replayrl.policy.models import save_policy
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer
from replayrl.policy.vllm_engine import collect_until_settled
from replayrl.storage import lineage_paths

pytestmark = pytest.mark.unit
# tests/vllm is on sys.path's tests/ folder and imports as a namespace package named vllm:
# that is not vLLM (a namespace package has no origin).
_SPEC = importlib.util.find_spec("vllm")
NO_VLLM = _SPEC is None or _SPEC.origin is None


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
    stops = (256,)
    assert _finish_reason([5, 6, 256], stop_ids=stops, max_new_tokens=6, vllm="stop") == "stop"
    assert _finish_reason([5, 6, 7], stop_ids=stops, max_new_tokens=3, vllm="length") == "length"
    # Cut short by max_model_len: not a "length" the trainer would recognise; say how to fix.
    with pytest.raises(ReplayRLError, match="max_model_len"):
        _finish_reason([5, 6], stop_ids=stops, max_new_tokens=6, vllm="length")
    with pytest.raises(RuntimeError, match="abort"):
        _finish_reason([5], stop_ids=stops, max_new_tokens=6, vllm="abort")


def test_a_second_eos_id_of_the_generation_config_is_a_stop():
    # Qwen2.5-Instruct and Qwen3: <|im_end|> 151645 and <|endoftext|> 151643; vLLM stops on
    # both, and a completion ending on the second one raised "without a final EOS".
    stops = (151645, 151643)
    assert _finish_reason([5, 151643], stop_ids=stops, max_new_tokens=6, vllm="stop") == "stop"


def test_sampled_logprobs_pick_the_sampled_token():
    lp = lambda x: SimpleNamespace(logprob=x)  # noqa: E731 - vLLM's Logprob has .logprob
    positions = [{5: lp(-0.5)}, {6: lp(-1.25), 9: lp(-0.1)}]
    assert _sampled_logprobs(positions, [5, 6]) == [-0.5, -1.25]
    with pytest.raises(RuntimeError, match="logprobs=0"):
        _sampled_logprobs(None, [5, 6])


@dataclass
class FlatLogprobs:
    """The fields of vLLM's `vllm.logprobs.FlatLogprobs` (`flat_logprobs=True`) that the
    backend reads: position j's entries at start_indices[j]:end_indices[j], sampled first."""

    start_indices: list[int]
    end_indices: list[int]
    token_ids: list[int]
    logprobs: list[float]

    def __len__(self) -> int:
        return len(self.start_indices)


def test_flat_logprobs_are_read_without_a_dict_per_token():
    # logprobs=0: one entry per position; a position may carry more (the top-k) after it.
    flat = FlatLogprobs([0, 1, 3], [1, 3, 4], [5, 6, 9, 7], [-0.5, -1.25, -0.1, -2.0])
    assert _sampled_logprobs(flat, [5, 6, 7]) == [-0.5, -1.25, -2.0]
    with pytest.raises(RuntimeError, match="start each position with its token"):
        _sampled_logprobs(flat, [5, 9, 7])
    with pytest.raises(RuntimeError, match="3 log-prob entries for 2 tokens"):
        _sampled_logprobs(flat, [5, 6])


GIB = 2**30


def test_an_engine_alone_on_its_gpu_takes_nine_tenths():
    assert memory_share(trainer_params=0, gpu_bytes=80 * GIB) == ALONE_MEMORY_SHARE == 0.9


def test_without_cuda_the_share_is_of_host_memory_and_half():
    assert memory_share(trainer_params=494_000_000, gpu_bytes=None) == 0.5


@pytest.mark.parametrize(
    "params,gpu_gib,share",
    [
        # Qwen2.5-0.5B: 494M parameters x 16 bytes = 7.9 GB of trainer state
        (494_032_768, 80, 0.80),
        (494_032_768, 141, 0.84),
        (494_032_768, 24, 0.59),
        # the tiny demo model: nothing to speak of
        (600_000, 80, 0.89),
    ],
)
def test_a_trainer_sharing_the_gpu_leaves_the_engine_the_rest_of_nine_tenths(
    params, gpu_gib, share
):
    got = memory_share(trainer_params=params, gpu_bytes=gpu_gib * GIB)
    assert got == share
    # never more than what is left after the trainer's 16 bytes per parameter
    assert got <= 0.9 - TRAINER_BYTES_PER_PARAM * params / (gpu_gib * GIB) + 1e-12


def test_a_trainer_too_large_for_the_gpu_is_a_clear_error():
    # Qwen2.5-7B (7.6B parameters, ~113 GiB of trainer state) on an 80 GiB GPU
    with pytest.raises(ReplayRLError) as e:
        memory_share(trainer_params=7_615_616_512, gpu_bytes=80 * GIB)
    message = str(e.value)
    assert "113.5 GiB" in message and "7,616M parameters" in message
    assert "rollout.vllm_gpu_memory_utilization" in message and "\n" not in message
    # just enough room: the minimum share itself is allowed
    params = int((0.9 - MIN_MEMORY_SHARE) * 80 * GIB / TRAINER_BYTES_PER_PARAM) - 1
    assert memory_share(trainer_params=params, gpu_bytes=80 * GIB) == MIN_MEMORY_SHARE


def test_a_long_lived_engine_refuses_tensor_parallel_and_a_one_step_engine_takes_it(tmp_path):
    cfg = load_config(
        overrides=[
            "rollout.backend=vllm",
            "rollout.tensor_parallel_size=2",
            "kubernetes.layout=step",
            "kubernetes.generate_gpus=2",
            "kubernetes.evaluate_gpus=2",
        ]
    )
    paths = lineage_paths(str(tmp_path), "tp")
    with pytest.raises(ReplayRLError, match="tensor_parallel_size: 1, or run on Kubeflow"):
        TaskResources(cfg, paths)
    assert TaskResources(cfg, paths, for_one_step=True).cfg.rollout.tensor_parallel_size == 2


def test_checkpoint_parameters_are_counted_from_the_safetensors_headers(tmp_path):
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=0)
    save_policy(model, build_byte_tokenizer(), tmp_path)
    # tied embeddings are saved (and trained) once
    assert checkpoint_num_params(tmp_path) == sum(p.numel() for p in model.parameters())


def test_a_closed_engine_is_collected_until_its_memory_stops_falling():
    # vLLM 0.33 frees the compiled model in a finaliser: one gc.collect() is not enough.
    seen = iter([300, 200, 100, 0])
    assert collect_until_settled(lambda: next(seen)) == 0
    stuck = iter([300, 200, 200, 200])
    assert collect_until_settled(lambda: next(stuck)) == 200  # held: reported, not looped on
