"""The demo learns: `make run`'s config, on this CPU, raises held-out pass@1 above the warm
start by at least 0.15 (replay arm); the on-policy arm of the same config learns too.

These run the real preset (minutes, not milliseconds); they share the warm-start cache with
`make run` through $REPLAYRL_CACHE, so the warm start is paid once per machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from replayrl.config import load_config
from replayrl.loop import run_inline

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


def test_replay_arm_of_the_demo_learns(tmp_path):
    cfg = load_config(PRESET, overrides=[f"storage.run_root={tmp_path}"])
    summary = run_inline(cfg)
    final = summary.rows[-1].pass1
    print(
        f"replay: pass@1 {summary.initial_pass1:.3f} -> {final:.3f} in {summary.wall_seconds:.0f} s"
    )
    assert summary.rows[-1].iteration == cfg.iterations
    assert final - summary.initial_pass1 >= 0.15


def test_on_policy_arm_of_the_demo_learns(tmp_path):
    cfg = load_config(PRESET, overrides=[f"storage.run_root={tmp_path}"], arm="on-policy")
    summary = run_inline(cfg)
    final = summary.rows[-1].pass1
    print(
        f"on-policy: pass@1 {summary.initial_pass1:.3f} -> {final:.3f} in {summary.wall_seconds:.0f} s"
    )
    assert final - summary.initial_pass1 >= 0.10
