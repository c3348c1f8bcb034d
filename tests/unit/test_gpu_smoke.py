"""bench/gpu_smoke.sh checks its inputs: on a machine without a GPU it stops at once with exit
code 2 and one line saying why; and the model it builds is Qwen2.5-0.5B's architecture."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_exits_2_with_one_line():
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_smoke.sh"), sys.executable],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_smoke: "), done.stderr
    assert "GPU" in lines[0] or "nvidia-smi" in lines[0] or "vllm" in lines[0]


def test_the_smokes_build_qwen2_5_0_5b_from_the_published_configuration():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from replayrl.policy.memory_plan import published_config

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**published_config("qwen2.5-0.5b")))
    # Qwen2.5-0.5B's published parameter count (embeddings tied to the output layer).
    assert sum(p.numel() for p in model.parameters()) == 494_032_768


def _bench_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_smoke_runs_the_preset_in_the_plain_format_for_two_checkpointed_iterations(
    tmp_path, device
):
    """The preset renders prompts with the checkpoint's chat template, which the smoke's byte
    tokenizer has none of: the smoke resets the format (issue 36, item 2), and runs two
    iterations with a checkpoint after each (item 14); on the CPU with the transformers
    backend at tiny shapes."""
    from replayrl.config import load_config

    smoke = _bench_module("gpu_smoke")
    args = smoke.parse_args(["--device", device, *(["--tiny"] if device == "cpu" else [])])
    preset = load_config(smoke.PRESET)
    assert preset.task.prompt_format == "chat" and preset.task.system_prompt
    cfg = load_config(smoke.PRESET, overrides=smoke.smoke_overrides(args, tmp_path, tmp_path))
    assert cfg.task.prompt_format == "plain" and cfg.task.system_prompt is None
    assert cfg.iterations == 2 and cfg.train.checkpoint_every == 1
    assert cfg.task.name == "chain_sum" and cfg.task.path is None
    if device == "cuda":
        assert cfg.rollout.backend == "vllm" and cfg.rollouts_per_iteration == 1024
    else:
        assert cfg.rollout.backend == "transformers" and args.sft_steps == smoke.TINY_SFT_STEPS
        assert cfg.task.options == {"min_digits": 1, "max_digits": 1}
        assert cfg.rollouts_per_iteration == 32


def test_the_train_smoke_gives_every_rank_the_same_uneven_lengths():
    """Each rank's shard of the global batch holds the same row lengths in another order, so
    every rank cuts as many micro-batches (FSDP gathers per micro-batch on every rank)."""
    from replayrl.policy.batching import micro_batches

    smoke = _bench_module("gpu_train_smoke")
    args = smoke.parse_args(["--device", "cpu", "--tiny"])
    rows = smoke.make_rows(
        rows=8, world=2, prompt=args.prompt_tokens, completion=40, vocab=512, seed=0
    )
    shards = [smoke._shard(rows, rank=r, world=2) for r in range(2)]
    lengths = [shard.lengths().tolist() for shard in shards]
    assert sorted(lengths[0]) == sorted(lengths[1]) and lengths[0] != lengths[1]
    assert len(set(lengths[0])) > 1  # uneven
    counts = {len(micro_batches(shard.lengths(), max_tokens=128)) for shard in shards}
    assert len(counts) == 1
    assert rows.completion_tokens() == sum(s.completion_tokens() for s in shards)
