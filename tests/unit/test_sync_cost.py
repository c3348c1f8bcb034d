"""`replayrl plan`'s `weight sync:` line (issue 38 item 4): one publication's estimated seconds
on each path against the time between publications, for presets with workers only, and a
warning when the chosen path takes over 20 % of it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from replayrl.cli.plan import render
from replayrl.config import load_config
from replayrl.policy import sync_cost
from replayrl.policy.memory_plan import plan

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
ASYNC = ["qwen2.5-7b-math-async.yaml", "qwen3-0.6b-math-async.yaml"]
SYNC = ["qwen2.5-7b-math.yaml", "qwen3-0.6b-math.yaml", "tiny-cpu.yaml"]


def printed(name: str, *overrides: str) -> list[str]:
    cfg = load_config(REPO / "configs" / name, overrides=list(overrides))
    return render(plan(cfg)).splitlines()


@pytest.mark.parametrize("name", ASYNC)
def test_presets_with_workers_print_the_line_with_the_fast_path_under_a_fifth(name):
    lines = [line for line in printed(name) if line.startswith("weight sync:")]
    assert len(lines) == 1, lines
    assert "broadcast ~" in lines[0] and "between publications), files ~" in lines[0]
    assert not any(line.startswith("warning: weight sync") for line in printed(name))
    ws = plan(load_config(REPO / "configs" / name)).weight_sync
    assert ws.path == "broadcast" and ws.share("broadcast") <= sync_cost.WARN_SHARE


@pytest.mark.parametrize("name", SYNC)
def test_synchronous_presets_print_no_weight_sync_line(name):
    assert not any("weight sync" in line for line in printed(name))


def test_a_path_over_a_fifth_of_the_interval_is_warned_about():
    cfg = load_config(REPO / "configs" / ASYNC[0])
    p = plan(cfg)
    ws = p.weight_sync
    assert ws.share("files") > sync_cost.WARN_SHARE  # 15 GB through the store, W workers
    p = dataclasses.replace(p, weight_sync=dataclasses.replace(ws, path="files"))
    warned = [line for line in render(p).splitlines() if line.startswith("warning: weight sync")]
    assert len(warned) == 1 and "files path" in warned[0] and "publish_every" in warned[0]


def test_the_estimate_scales_with_the_copy_and_the_interval():
    cfg = load_config(REPO / "configs" / ASYNC[0])
    ws = sync_cost.estimate(cfg, 7_615_616_512, prompt_tokens=512)
    assert ws.copy_bytes == 2 * 7_615_616_512  # bf16: half the float32 copy
    fewer = dataclasses.replace(cfg.asynchronous, publish_every=1)
    once = sync_cost.estimate(
        dataclasses.replace(cfg, asynchronous=fewer), 7_615_616_512, prompt_tokens=512
    )
    assert once.interval_s == pytest.approx(ws.interval_s / 4)
    assert once.share("broadcast") == pytest.approx(4 * ws.share("broadcast"))
    assert ws.files_trainer_s < ws.files_s  # only the host snapshot stalls the trainer


def test_the_models_stream_counts_are_the_storage_layers():
    """The policy layer sits beside storage and does not import it: its copies of the
    stream counts must follow storage's."""
    from replayrl.storage import transfer

    assert sync_cost.UPLOAD_STREAMS == transfer.UPLOAD_STREAMS
    assert sync_cost.DOWNLOAD_STREAMS == transfer.DOWNLOAD_STREAMS
