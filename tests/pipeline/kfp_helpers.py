"""Shared pieces of the pipeline tier: a tiny config and the preset it starts from. (The
stand-in for the KFP REST API is in `kfp_standin`, its API document in `kfp_openapi`.)

`small()` is the suite's tiny configuration (`tiny_config`: its warm start built once per
run; 4 prompts × 8 samples per iteration, a 16-prompt held-out set, 2 iterations), so a
kfp.local run spends its time in process start-up, not in training, while some rollouts
still earn rewards.
"""

from __future__ import annotations

from pathlib import Path

import tiny_config
from tiny_config import PRESET

__all__ = ["PRESET", "small", "small_overrides"]


def small_overrides(tmp_path: Path, *extra: str, root: str = "runs") -> list[str]:
    return tiny_config.overrides(tmp_path / root, *extra)


def small(tmp_path: Path, *extra: str, root: str = "runs", arm: str | None = None):
    return tiny_config.config(tmp_path / root, *extra, arm=arm)
