"""The asynchronous split experiment's report: pure arithmetic on evaluations read back."""

import math

import pytest

from replayrl.errors import ReplayRLError
from replayrl.experiments.split import (
    SplitLineage,
    split_configs,
    split_markdown,
    split_report,
    time_to,
)

PRESET = "configs/tiny-cpu.yaml"


def test_time_to_is_the_first_evaluation_at_or_above_the_target():
    evals = [(0.2, 0.0), (0.3, 50.0), (0.25, 80.0), (0.4, 120.0)]
    assert time_to(evals, 0.3) == 50.0
    assert time_to(evals, 0.35) == 120.0
    assert math.isinf(time_to(evals, 0.5))


def lineage(arm, seed, finals, seconds, gamma=None, gamma_busy=None):
    return SplitLineage(arm, seed, list(zip(finals, seconds, strict=True)), gamma, gamma_busy)


def test_report_targets_the_on_policy_median_and_counts_misses_as_infinite():
    lineages = [
        # sync on-policy finals 0.30, 0.40, 0.50 -> with async on-policy 0.30, 0.34, 0.36
        lineage("sync on-policy", 0, [0.2, 0.30], [0, 100]),
        lineage("sync on-policy", 1, [0.2, 0.40], [0, 110]),
        lineage("sync on-policy", 2, [0.2, 0.50], [0, 120]),
        lineage("async on-policy", 0, [0.2, 0.30], [0, 60], gamma=1.0),
        lineage("async on-policy", 1, [0.2, 0.34], [0, 70], gamma=1.1),
        lineage("async on-policy", 2, [0.2, 0.36], [0, 80], gamma=1.2),
        lineage("async replay", 0, [0.2, 0.40, 0.45], [0, 30, 60], 0.9, gamma_busy=1.3),
        lineage("async replay", 1, [0.2, 0.36, 0.30], [0, 40, 70], 1.0, gamma_busy=1.2),
        lineage("async replay", 2, [0.2, 0.25, 0.30], [0, 40, 90], 1.1, gamma_busy=1.25),
    ]
    report = split_report(lineages)
    assert report["target_pass1"] == pytest.approx(0.35)  # median of the six on-policy finals
    sync = report["arms"]["sync on-policy"]
    assert sync["reached"] == 2  # 0.30 never reaches 0.35
    assert sync["seconds_to_target"]["median"] == pytest.approx(120.0)  # [inf, 110, 120]
    replay = report["arms"]["async replay"]
    assert [p["seconds_to_target"] for p in replay["per_seed"]] == [30, 40, None]
    assert replay["seconds_to_target"]["median"] == pytest.approx(40.0)
    assert replay["seconds_to_target"]["q75"] is None  # the upper quartile sits at infinity
    assert replay["gamma"]["median"] == pytest.approx(1.0)
    assert replay["gamma_busy"]["median"] == pytest.approx(1.25)
    assert replay["final_wall_seconds"]["median"] == pytest.approx(70.0)  # 60, 70, 90
    assert [p["gamma_busy"] for p in replay["per_seed"]] == [1.3, 1.2, 1.25]
    assert report["ratio_async_replay_over_sync_on_policy"] == pytest.approx(40 / 120)
    assert report["arms"]["sync on-policy"]["gamma"] is None
    md = split_markdown(report)
    assert "0.33x" in md and "| async replay | 3 |" in md and "∞" in md
    assert "| 1.00 [0.95, 1.05] | 1.25 [1.23, 1.27] | 70 [65, 80] |" in md


def test_a_given_target_and_an_arm_that_never_reaches_it():
    lineages = [
        lineage("sync on-policy", 0, [0.2, 0.5], [0, 100]),
        lineage("async replay", 0, [0.2, 0.3], [0, 50], gamma=1.0),
    ]
    report = split_report(lineages, target=0.45)
    assert report["ratio_async_replay_over_sync_on_policy"] == math.inf
    assert report["arms"]["async on-policy"]["seeds"] == []


def test_configs_run_three_arms_per_seed_in_their_own_experiment(tmp_path):
    configs = split_configs(config_path=PRESET, seeds=2, out_dir=tmp_path)
    assert [(label, c.seed, c.arm, c.asynchronous.enabled) for label, c in configs] == [
        ("sync on-policy", 0, "on-policy", False),
        ("async on-policy", 0, "on-policy", True),
        ("async replay", 0, "replay", True),
        ("sync on-policy", 1, "on-policy", False),
        ("async on-policy", 1, "on-policy", True),
        ("async replay", 1, "replay", True),
    ]
    assert {c.tracking.experiment for _, c in configs} == {"tiny-cpu-split"}
    assert len({c.lineage for _, c in configs}) == 6
    with pytest.raises(ReplayRLError, match="drop them"):
        split_configs(config_path=PRESET, seeds=1, out_dir=tmp_path, overrides=["seed=3"])


@pytest.mark.slow
def test_work_before_the_first_task_stays_off_its_start_up_clock():
    # A fresh interpreter: its first task's start-up counts from the process start, unless the
    # process said its shared work (the split experiment's warm starts) is no task's.
    import subprocess
    import sys

    script = (
        "import time\n"
        "from replayrl.engine import inline as loop\n"
        "time.sleep(1.5)  # shared work, e.g. every seed's warm start\n"
        "if {mark}: loop.startup_counts_from_now()\n"
        "before = time.time()\n"
        "print(loop.task_start_time() - before)\n"
    )
    ahead = {}
    for mark in (False, True):
        out = subprocess.run(
            [sys.executable, "-c", script.format(mark=mark)],
            capture_output=True,
            text=True,
            check=True,
        )
        ahead[mark] = float(out.stdout.strip().splitlines()[-1])
    assert ahead[False] < -1.5  # the process start: the sleep (and imports) counted
    assert 0.0 <= ahead[True] < 0.5  # the call itself: nothing before it counted
