"""Each vLLM engine's share of its GPU and each asynchronous role's GPUs, for every layout:
synchronous colocated (the engine sleeps while the trainer trains), synchronous DDP (the
trainer in processes of its own), asynchronous roles on GPUs of their own, and asynchronous
roles sharing a GPU with each other and with the trainer. Pure functions; no GPU needed."""

from __future__ import annotations

import pytest

from replayrl.engine.asynchronous.devices import Placement, apply, assign_devices
from replayrl.errors import ReplayRLError
from replayrl.policy.engine_share import (
    SHARING_ENV,
    TRAINER_BYTES_PER_PARAM,
    gpu_sharing_from_env,
    memory_share,
)

GIB = 2**30
QWEN_05B = 494_032_768  # parameters of Qwen2.5-0.5B


def share_of(placement: Placement, *, params: int, gpu_gib: int) -> float:
    """What an asynchronous role's engine asks for, as its resources compute it."""
    return memory_share(
        trainer_params=params if placement.trainer_on_gpu else 0,
        gpu_bytes=gpu_gib * GIB,
        engines=placement.engines_on_gpu,
        trainer_concurrent=True,
    )


def test_synchronous_colocated_engine_leaves_the_trainers_state_and_ddp_takes_all():
    # colocated: the trainer's 16 bytes per parameter stay; the engine sleeps while it trains
    assert memory_share(trainer_params=QWEN_05B, gpu_bytes=80 * GIB) == 0.80
    # DDP: the trainer runs in processes that end with the iteration; the engine is alone
    assert memory_share(trainer_params=0, gpu_bytes=80 * GIB) == 0.90


def test_asynchronous_roles_on_gpus_of_their_own():
    layout = assign_devices(8, workers=5, trainers=2)
    assert layout[("trainer", 0)].gpus == (0, 1)
    assert [layout[("worker", w)].gpus for w in range(5)] == [(2,), (3,), (4,), (5,), (6,)]
    assert layout[("evaluator", 0)].gpus == (7,)
    for w in range(5):
        p = layout[("worker", w)]
        assert p.engines_on_gpu == 1 and not p.trainer_on_gpu
        assert share_of(p, params=QWEN_05B, gpu_gib=80) == 0.90
    # every GPU used once
    used = [g for p in layout.values() for g in p.gpus]
    assert sorted(used) == list(range(8))


def test_asynchronous_roles_sharing_the_gpus_the_trainer_left():
    # 2 workers + the evaluator on GPUs 1 and 2: two engines on GPU 1, one on GPU 2
    layout = assign_devices(3, workers=2, trainers=1)
    assert layout[("trainer", 0)].gpus == (0,)
    assert layout[("worker", 0)].gpus == (1,) and layout[("worker", 1)].gpus == (2,)
    assert layout[("evaluator", 0)].gpus == (1,)
    assert layout[("worker", 0)].engines_on_gpu == 2 == layout[("evaluator", 0)].engines_on_gpu
    assert layout[("worker", 1)].engines_on_gpu == 1
    assert share_of(layout[("worker", 0)], params=QWEN_05B, gpu_gib=80) == 0.45
    assert share_of(layout[("worker", 1)], params=QWEN_05B, gpu_gib=80) == 0.90


def test_asynchronous_roles_sharing_one_gpu_with_the_training_trainer():
    layout = assign_devices(1, workers=2, trainers=1)
    assert {p.gpus for p in layout.values()} == {(0,)}
    worker = layout[("worker", 0)]
    assert worker.engines_on_gpu == 3 and worker.trainer_on_gpu
    # (0.9 - 7.9 GB / 80 GiB) / 2 for the trainer's activations / 3 engines = 0.134 -> 0.13
    share = share_of(worker, params=QWEN_05B, gpu_gib=80)
    assert share == 0.13
    trainer_fraction = TRAINER_BYTES_PER_PARAM * QWEN_05B / (80 * GIB)
    # the three engines and the trainer's state leave at least as much for its activations
    assert 3 * share + trainer_fraction <= 0.9 - 3 * share + 1e-9
    # a 7B trainer on the same GPU leaves no room: a one-line error naming what shares it
    with pytest.raises(ReplayRLError) as e:
        share_of(worker, params=7_615_616_512, gpu_gib=80)
    assert "3 vLLM engines" in str(e.value) and "\n" not in str(e.value)


def test_trainer_ranks_beyond_the_gpus_and_no_gpus():
    with pytest.raises(ReplayRLError, match="asynchronous.trainers=3 needs 3 GPUs"):
        assign_devices(2, workers=1, trainers=3)
    cpu = assign_devices(0, workers=2, trainers=1)
    assert all(p.gpus == () for p in cpu.values())
    environ: dict[str, str] = {}
    apply(cpu[("worker", 0)], environ)
    assert environ == {}  # nothing set without GPUs


def test_placement_reaches_the_role_through_its_environment():
    layout = assign_devices(4, workers=2, trainers=2)
    # the supervisor itself sees physical GPUs 4..7: indices map through them
    environ = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    apply(layout[("trainer", 0)], environ)
    assert environ["CUDA_VISIBLE_DEVICES"] == "4,5"
    environ = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    apply(layout[("evaluator", 0)], environ)
    assert environ["CUDA_VISIBLE_DEVICES"] == "6"  # evaluator after 2 workers on GPUs 2, 3
    assert gpu_sharing_from_env(environ) == (2, False)
    environ = {}
    apply(assign_devices(1, workers=1, trainers=1)[("worker", 0)], environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "0", SHARING_ENV: "2,1"}
    assert gpu_sharing_from_env(environ) == (2, True)
    assert gpu_sharing_from_env({}) is None
    with pytest.raises(ReplayRLError, match=SHARING_ENV):
        gpu_sharing_from_env({SHARING_ENV: "lots"})
