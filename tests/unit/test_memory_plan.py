"""`replayrl plan`'s numbers: exact parameter counts from the meta device, the 7B presets
refused under DDP on 80 GB cards with the numbers and fitting under FSDP on 8 of them, the
asynchronous (5, 3) split fitting, no refusal without a GPU, and the environment a GPU process
starts with."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from replayrl.config import load_config
from replayrl.errors import ReplayRLError
from replayrl.policy import gpu, memory_plan
from replayrl.policy.memory_plan import GiB, check_fits, model_shape, plan, refusal

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
SYNC_7B = REPO / "configs" / "qwen2.5-7b-math.yaml"
ASYNC_7B = REPO / "configs" / "qwen2.5-7b-math-async.yaml"


def fsdp_offered() -> bool:
    try:
        load_config(SYNC_7B)
    except ReplayRLError as e:
        if "fsdp" in str(e):
            return False
        raise
    return True


def load_7b(path: Path, **train):
    """A 7B preset as written. Until train.distributed=fsdp is offered by the config loader,
    the rest of the preset is validated with distributed=none and FSDP is put back for the
    plan (which reads the config, not the trainer)."""
    if fsdp_offered():
        cfg = load_config(path)
    else:
        cfg = load_config(path, overrides=["train.distributed=none", "train.num_processes=1"])
        fsdp = {"distributed": "fsdp"}
        if not cfg.asynchronous.enabled:
            fsdp["num_processes"] = 8
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **fsdp))
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train)) if train else cfg


def test_the_tiny_models_parameters_are_counted_exactly():
    from replayrl.policy.tiny_model import build_tiny_model

    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml")
    m = cfg.model
    model = build_tiny_model(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size,
        seed=0,
    )
    shape = model_shape(cfg)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.head_dim == m.hidden_size // m.num_heads


def test_the_presets_models_have_their_published_sizes():
    sizes = {
        "configs/qwen2.5-0.5b-gsm8k.yaml": 494_032_768,
        "configs/qwen3-0.6b-math.yaml": 596_049_920,
    }
    for path, params in sizes.items():
        assert model_shape(load_config(REPO / path)).num_params == params, path
    seven = model_shape(load_7b(SYNC_7B))
    assert seven.num_params == 7_615_616_512
    # vLLM's KV cache per token: 2 x 28 layers x 4 KV heads x 128 x 2 B.
    assert seven.kv_bytes_per_token == 57_344


def test_7b_under_ddp_on_80gb_cards_is_refused_with_the_numbers():
    cfg = load_7b(SYNC_7B, distributed="ddp")
    p = plan(cfg, gpus=8, gpu_bytes=80 * GiB)
    assert not p.fits
    rank = next(g for g in p.per_gpu if g.role.startswith("rank 0"))
    items = {i.name: i.bytes for i in rank.phases["training"]}
    # 7.62 B parameters x (4 + 4 + 8) B = 122 GB before activations, plus DDP's buckets.
    assert items["trainer weights"] + items["gradients"] + items["optimizer state"] == (
        16 * 7_615_616_512
    )
    assert items["DDP gradient buckets"] == 4 * 7_615_616_512
    text = refusal(p)
    assert "GiB" in text and "72.0 GiB usable" in text and "optimizer state 56.7 GiB" in text
    with pytest.raises(ReplayRLError, match="does not fit"):
        check_fits(cfg, gpu_bytes=80 * GiB)


def test_7b_under_fsdp_on_8x80gb_fits_in_both_forms():
    sync = plan(load_7b(SYNC_7B), gpus=8, gpu_bytes=80 * GiB)
    assert sync.fits, sync.problems
    rank = sync.per_gpu[0]
    items = {i.name: i.bytes for i in rank.phases["training"]}
    assert items["optimizer state"] == 8 * 7_615_616_512 // 8  # sharded 8 ways
    # While vLLM generates on GPU 0, rank 0's shards stay there (the group lives for the
    # task), and rank 0 alone reads the float32 checkpoint onto the host.
    generation = {i.name: i.bytes for i in rank.phases["generation"]}
    assert generation["rank 0 (resident)"] == 16 * 7_615_616_512 // 8
    assert sum(generation.values()) <= int(0.9 * 80 * GiB)
    assert "alive for the task" in sync.layout
    host = next(w for w in sync.warnings if w.startswith("host memory"))
    assert "rank 0 alone reads the float32 checkpoint (28.4 GiB) once per task" in host
    assert "a full checkpoint every 10 iteration(s)" in host
    split = plan(load_7b(ASYNC_7B), gpus=8, gpu_bytes=80 * GiB)
    assert split.fits, split.problems
    roles = {g.role: g for g in split.per_gpu}
    assert roles["vLLM worker"].count == 5 and roles["trainer"].count == 3
    # A whole replica per trainer GPU would not fit.
    replica = dataclasses.replace(
        load_7b(ASYNC_7B), train=dataclasses.replace(load_7b(ASYNC_7B).train, distributed="none")
    )
    assert not plan(replica, gpus=8, gpu_bytes=80 * GiB).fits
    # Fewer GPUs than W + T: refused, saying how many.
    short = plan(load_7b(ASYNC_7B), gpus=4, gpu_bytes=80 * GiB)
    assert "the layout needs 8 GPUs, 4 given" in short.problems


def test_checkpointing_keeps_far_fewer_activations():
    shape = model_shape(load_config(REPO / "configs" / "qwen3-0.6b-math.yaml"))
    full, kept = (
        memory_plan.activation_bytes(
            shape, tokens=16_384, completion_tokens=14_000, bf16=True, checkpointing=c
        )
        for c in (False, True)
    )
    assert kept < full / 5


def test_no_gpu_no_refusal():
    cfg = load_7b(SYNC_7B, distributed="ddp")
    check_fits(cfg, gpu_bytes=None)  # on CPU nothing is refused


def test_plan_command_prints_a_table_and_json(capsys):
    from replayrl.cli.main import main

    assert main(["plan", "--config", str(REPO / "configs" / "qwen2.5-0.5b-gsm8k.yaml")]) == 0
    assert "FITS" in capsys.readouterr().out
    code = main(
        [
            "plan",
            "--config",
            str(REPO / "configs/qwen2.5-0.5b-gsm8k.yaml"),
            "--json",
            "--gpu-memory",
            "16GiB",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["fits"] is False and out["problems"]
    assert main(["plan", "--config", str(SYNC_7B), "--gpu-memory", "lots"]) == 2


def test_a_gpu_process_gets_compile_caches_and_expandable_segments_without_sleep_mode(tmp_path):
    env = {"TRITON_CACHE_DIR": "/mine"}
    added = gpu.cuda_env(env, cache_dir=tmp_path, vllm_sleep_mode=False)
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
    assert env["TRITON_CACHE_DIR"] == "/mine" and "TRITON_CACHE_DIR" not in added
    assert env[gpu.ALLOC_CONF_ENV] == "expandable_segments:True"
    # vLLM's sleep-mode allocator refuses expandable segments: not set beside it.
    env = {}
    gpu.cuda_env(env, cache_dir=tmp_path, vllm_sleep_mode=True)
    assert gpu.ALLOC_CONF_ENV not in env and "TORCHINDUCTOR_CACHE_DIR" in env


def test_an_engine_that_gets_new_weights_every_iteration_sleeps_at_level_2():
    cfg = load_config(REPO / "configs" / "qwen2.5-0.5b-gsm8k.yaml")
    assert memory_plan.vllm_sleep_level(cfg) == 2
    p = plan(cfg, gpu_bytes=80 * GiB)
    assert any("sleep level for this layout: 2" in w for w in p.warnings)


@pytest.mark.parametrize(
    "overrides, level",
    [
        ([], 2),  # the inline engine (and a task pod): the weights change every iteration
        (["kubernetes.layout=step"], 1),  # generate pods' engines never sleep
        (["asynchronous.enabled=true"], 1),  # nor do asynchronous workers'
        (["rollout.vllm_sleep_level=1"], 1),  # the key wins over the layout
        (["kubernetes.layout=step", "rollout.vllm_sleep_level=2"], 2),
    ],
)
def test_the_sleep_level_is_the_keys_else_the_layouts(overrides, level):
    cfg = load_config(REPO / "configs" / "qwen2.5-0.5b-gsm8k.yaml", overrides=overrides)
    assert memory_plan.vllm_sleep_level(cfg) == level


def test_a_sleep_level_outside_1_2_is_refused_at_load():
    with pytest.raises(ReplayRLError, match="vllm_sleep_level"):
        load_config(REPO / "configs" / "tiny-cpu.yaml", overrides=["rollout.vllm_sleep_level=3"])
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml")
    other = load_config(
        REPO / "configs" / "tiny-cpu.yaml", overrides=["rollout.vllm_sleep_level=1"]
    )
    assert cfg.config_hash() == other.config_hash()  # how the engine sleeps computes nothing
