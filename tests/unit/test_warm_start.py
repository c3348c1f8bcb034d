"""The tiny model's warm start: the validation problems it stops on are held out of the
training pool and never include an evaluation prompt, and its cache key moves with every
input that changes it. One test runs a short warm start: its weights do not depend on the
caller's torch thread count."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from replayrl.config import load_config
from replayrl.errors import ReplayRLError
from replayrl.policy.models import _warm_start_key, warm_start_split, warm_start_tiny
from replayrl.policy.problems import Problem, TaskSplits, load_task

pytestmark = pytest.mark.unit
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
GSM8K = Path(__file__).resolve().parents[1] / "data" / "gsm8k_tiny.jsonl"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(name="chain_sum", num_train=200, num_eval=64, seed=0),
        dict(name="chain_sum", num_train=4000, num_eval=256, seed=3),
        dict(name="gsm8k", num_train=20, num_eval=8, seed=1, path=str(GSM8K)),
    ],
    ids=["chain_sum-200", "chain_sum-4000", "gsm8k"],
)
def test_validation_prompts_are_held_out_of_training_and_never_evaluated(kwargs):
    splits = load_task(**kwargs)
    train, validation = warm_start_split(splits)
    n = len(splits.train)
    assert len(validation) == min(128, max(1, n // 8)) and len(train) + len(validation) == n
    prompts = lambda problems: {p.prompt for p in problems}  # noqa: E731
    assert not prompts(validation) & prompts(splits.eval)
    assert not prompts(validation) & prompts(train)
    # deterministic for the seed
    assert warm_start_split(load_task(**kwargs)) == (train, validation)


def test_too_few_training_problems_leave_no_validation():
    one = TaskSplits(train=problems("t", 1), eval=problems("e", 1), reward_kind="integer")
    assert warm_start_split(one) == (one.train, ())
    with pytest.raises(ReplayRLError, match="no validation prompt to stop on; give it at least 2"):
        warm_start_tiny(load_config(PRESET), one, Path("unused"))


def problems(tag: str, n: int, *, target: str = " 1") -> tuple[Problem, ...]:
    return tuple(Problem(f"{tag}{i}", f"{i} + {tag} =", "1", target) for i in range(n))


SPLITS = TaskSplits(train=problems("t", 64), eval=problems("e", 16), reward_kind="integer")


def key(*overrides: str, splits: TaskSplits = SPLITS) -> str:
    return _warm_start_key(load_config(PRESET, overrides=list(overrides)), splits)


@pytest.mark.parametrize(
    "override",
    [
        "model.hidden_size=64",
        "model.num_layers=3",
        "model.num_heads=8",
        "model.num_kv_heads=1",
        "model.intermediate_size=128",
        "model.vocab_size=272",
        "model.warm_start_max_steps=10",
        "model.warm_start_lr=0.001",
        "model.warm_start_batch_size=32",
        "model.warm_start_eval_every=10",
        "model.warm_start_target_pass1=0.3",
        "seed=1",
        "rollout.max_new_tokens=8",
        "rollout.batch_size=64",
        "rollout.max_new_tokens=300",  # also moves the position budget past 256
    ],
)
def test_the_cache_key_moves_with_each_setting_the_warm_start_reads(override):
    assert key(override) != key()


@pytest.mark.parametrize(
    "splits",
    [
        # another task, option, file, size or seed: other training problems
        dataclasses.replace(SPLITS, train=problems("u", 64)),
        dataclasses.replace(SPLITS, train=SPLITS.train[:63]),
        dataclasses.replace(SPLITS, train=SPLITS.train[::-1]),  # order: another validation
        dataclasses.replace(SPLITS, train=problems("t", 64, target=" 2")),
        dataclasses.replace(SPLITS, reward_kind="math"),
        # a longer evaluation prompt moves the position budget
        dataclasses.replace(SPLITS, eval=(*SPLITS.eval, Problem("x", "9" * 300, "1", " 1"))),
    ],
    ids=["problems", "size", "order", "targets", "reward", "positions"],
)
def test_the_cache_key_moves_with_the_problems(splits):
    assert key(splits=splits) != key()


def test_the_cache_key_ignores_what_the_warm_start_does_not_read():
    assert key() == key()
    for override in ["eval.num_prompts=8", "iterations=7", "train.lr=0.5"]:
        assert key(override) == key(), override
    # both arms of an experiment start from the same v0
    assert _warm_start_key(load_config(PRESET, arm="on-policy"), SPLITS) == key()
    # evaluation prompts of the same length: v0 is the same model
    same_length = dataclasses.replace(SPLITS, eval=problems("f", 16))
    assert key(splits=same_length) == key()


def test_the_warm_start_is_the_same_whatever_the_callers_thread_count(tmp_path):
    # A different torch thread count sums in a different order: without the warm start's own
    # pinned count, the demo's model warm-started from a 1- and a 2-thread process differs.
    import torch
    from safetensors.torch import load_file

    from replayrl.engine.inputs import task_splits

    cfg = load_config(
        PRESET,
        overrides=[
            f"storage.run_root={tmp_path}",  # not the clone's `runs`, where `make run` writes
            "task.num_train=200",
            "model.warm_start_max_steps=30",
            "model.warm_start_eval_every=30",
        ],
    )
    splits, weights, before = task_splits(cfg), [], torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            out = tmp_path / f"threads{threads}"
            report = warm_start_tiny(cfg, splits, out)
            assert report["steps"] == 30
            assert torch.get_num_threads() == threads, "the caller's thread count not restored"
            weights.append(load_file(out / "model.safetensors"))
    finally:
        torch.set_num_threads(before)
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), name
