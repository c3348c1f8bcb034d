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


def test_the_train_smoke_gives_the_ranks_rows_of_different_lengths():
    """The global batch's rows have uneven lengths, within a rank and across the ranks (shard 0
    the shortest): at --tiny's and the full shapes alike, two ranks cut different numbers of
    micro-batches, so `gradient_step` must pad the rank with fewer (issue 36, items 5, 13)."""
    from replayrl.policy.batching import completion_token_count, micro_batches, row_lengths
    from replayrl.policy.distributed import shard_rows

    smoke = _bench_module("gpu_train_smoke")
    for argv, vocab, max_tokens in ((["--tiny"], 512, 128), ([], 151_936, 16_384)):
        args = smoke.parse_args(["--device", "cpu", *argv])
        rows = smoke.make_rows(
            rows=args.batch_size,
            world=2,
            prompt=args.prompt_tokens,
            completion=args.completion_tokens,
            vocab=vocab,
            seed=0,
        )
        shards = [shard_rows(rows, rank=r, world_size=2) for r in range(2)]
        lengths = [row_lengths(shard) for shard in shards]
        assert all(len(set(n.tolist())) > 1 for n in lengths)  # uneven within a rank
        assert lengths[0].max() < lengths[1].min()  # and across the ranks
        counts = [len(micro_batches(n, max_tokens=max_tokens)) for n in lengths]
        assert counts[0] < counts[1], counts
        assert completion_token_count(rows) == sum(completion_token_count(s) for s in shards)


def test_the_trainer_steps_a_table_of_python_lists_as_it_steps_arrow():
    """`gradient_step` on the smoke's `Rows` (what runs where pyarrow is absent) takes the step
    it takes on the same rows as a pyarrow Table: the same stats, the same weights after."""
    import dataclasses

    import pyarrow as pa

    from replayrl.policy.train_settings import step_settings
    from replayrl.policy.training import gradient_step, make_optimizer

    smoke = _bench_module("gpu_train_smoke")
    args = smoke.parse_args(["--device", "cpu", "--tiny"])
    settings = step_settings(smoke.smoke_config(args), device="cpu")
    # A big enough lr that the step moves the weights visibly.
    settings = dataclasses.replace(settings, lr=1e-2)
    rows = smoke.make_rows(rows=8, world=2, prompt=8, completion=40, vocab=512, seed=0)
    table = pa.table(rows.columns)

    def flat(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    initial = flat(smoke.build_model("cpu", tiny=True))
    stats, weights = [], []
    for batch in (rows, table):
        model = smoke.build_model("cpu", tiny=True)
        optimizer = make_optimizer(model, lr=settings.lr, weight_decay=0.0, betas=settings.betas)
        stats.append(
            gradient_step(model=model, optimizer=optimizer, rows=batch, pad_id=0, settings=settings)
        )
        weights.append(flat(model))
    assert stats[0] == stats[1]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], initial)


def test_the_train_smoke_steps_with_the_settings_the_engine_gives_the_preset():
    """Not a private copy: the smoke's settings are `engine.steps.step_settings` of the GPU
    preset with the smoke's shapes, as resolved on a GPU (bfloat16)."""
    import dataclasses

    from replayrl.engine.steps import step_settings as engine_settings
    from replayrl.policy.train_settings import step_settings

    smoke = _bench_module("gpu_train_smoke")
    for argv in (["--tiny"], []):
        args = smoke.parse_args(["--device", "cpu", *argv])
        cfg = smoke.smoke_config(args)
        ours = step_settings(cfg, device="cuda")
        assert ours == dataclasses.replace(engine_settings(cfg), dtype="bfloat16")
        assert ours.lr == 1e-6 and ours.clip_eps == 0.2 and ours.loss_name == "grpo"
        if argv:
            assert (ours.micro_batch_tokens, ours.logprob_chunk_tokens) == (128, 64)
        else:  # the preset's own
            assert (ours.micro_batch_tokens, ours.logprob_chunk_tokens) == (16_384, 1024)
