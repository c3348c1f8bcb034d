"""Shared pieces of the pipeline tier: a tiny config and the preset it starts from. (The
stand-in for the KFP REST API is in `kfp_standin`, its API document in `kfp_openapi`.)

`small()` is a tiny configuration (a 100-step warm start cached for the session, 4 prompts
× 8 samples per iteration, a 16-prompt held-out set), so a kfp.local run spends its time in
process start-up, not in training, while some rollouts still earn rewards.
"""

from __future__ import annotations

from pathlib import Path

from replayrl.config import load_config

PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


def small_overrides(tmp_path: Path, *extra: str, root: str = "runs") -> list[str]:
    return [
        f"storage.run_root={tmp_path / root}",
        f"model.cache_dir={tmp_path.parent / 'shared-cache'}",
        "iterations=2",
        "task.num_train=200",
        "task.num_eval=16",
        "eval.num_prompts=16",
        "eval.every=1",
        # 100 warm-start steps (cached for the session): enough that some rollouts earn a
        # reward, so the gradient steps change the policy.
        "model.warm_start_max_steps=100",
        "model.warm_start_eval_every=50",
        "rollout.prompts_per_iteration=4",
        "buffer.capacity=64",
        "train.batch_size=16",
        "train.steps_per_iteration=4",
        *extra,
    ]


def small(tmp_path: Path, *extra: str, root: str = "runs", arm: str | None = None):
    return load_config(PRESET, overrides=small_overrides(tmp_path, *extra, root=root), arm=arm)
