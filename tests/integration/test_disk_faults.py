"""A disk that fills while a checkpoint is written, through the real CLI.

The lineage's run root is copied onto a tmpfs sized to hold it plus ~100 kB: the next
iteration's rows, usage log and evaluation fit, its checkpoint (~250 kB of weights, AdamW
moments and RNG state for the tiny model) does not. The mount lives in a mount namespace of
its own (`unshare -rm`, no privileges needed where user namespaces are allowed), so the
whole trial (fill, fail, free space, rerun) runs in one shell script inside it and copies
the run root out after each step for the assertions.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fault_helpers import PRESET, crash_overrides

from replayrl import storage

pytestmark = pytest.mark.slow


def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    where.mkdir()
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"],
        capture_output=True,
    )
    return probe.returncode == 0


def _run_cmd(overrides: list[str]) -> str:
    sets = " ".join(f"--set {shlex.quote(o)}" for o in overrides)
    return f"{shlex.quote(sys.executable)} -m replayrl.cli.main run --config {PRESET} {sets}"


def test_a_disk_that_fills_during_a_checkpoint_is_one_line_and_a_rerun_recovers(tmp_path):
    if not _can_mount_tmpfs(tmp_path / "probe"):
        pytest.skip("needs `unshare -rm` and tmpfs mounts (user namespaces) to fill a disk")
    from replayrl.engine.inline import run_inline

    disk, before = tmp_path / "disk", tmp_path / "runs"
    cfg_overrides = crash_overrides(tmp_path, str(disk / "runs"), "iterations=2")
    from replayrl.config import load_config

    run_inline(load_config(PRESET, overrides=[*cfg_overrides, f"storage.run_root={before}"]))
    disk.mkdir()
    extend = [*cfg_overrides, "iterations=3"]
    script = f"""
set -u
used=$(du -sk {before} | cut -f1)
mount -t tmpfs -o size=$((used + 100))k tmpfs {disk}
cp -a {before} {disk}/runs
{_run_cmd(extend)} > {tmp_path}/full.out 2> {tmp_path}/full.err
echo $? > {tmp_path}/full.rc
cp -a {disk}/runs {tmp_path}/after-full
mount -o remount,size=64m {disk}
{_run_cmd(extend)} > {tmp_path}/rerun.out 2> {tmp_path}/rerun.err
echo $? > {tmp_path}/rerun.rc
cp -a {disk}/runs {tmp_path}/after-rerun
"""
    env = {**os.environ, "REPLAYRL_LOG_FILE": str(tmp_path / "replayrl.log")}
    subprocess.run(["unshare", "-rm", "bash", "-c", script], check=True, timeout=600, env=env)

    # The tracking store lives outside the run root (crash_overrides), so the full disk is
    # the run root's own.
    err = (tmp_path / "full.err").read_text()
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("replayrl: error:")]
    assert len(errors) == 1, err
    assert "No space left on device" in errors[0] and "checkpoints/v000003" in errors[0]
    assert "rerun the same command" in errors[0] and "unexpected" not in errors[0]
    # The log file keeps the traceback, down to safetensors' own error.
    assert "SafetensorError" in (tmp_path / "replayrl.log").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "2"

    # Nothing committed was lost: the state still names iteration 2's checkpoint, which is
    # whole, and v3 was never published.
    full = storage.lineage_paths(str(tmp_path / "after-full"), "chain_sum-replay-s0")
    assert storage.read_state(full).next_iteration == 3
    assert storage.complete_versions(full) == [0, 2]

    # Space freed, the same command resumes and completes iteration 3.
    rerun_err = (tmp_path / "rerun.err").read_text()
    assert (tmp_path / "rerun.rc").read_text().strip() == "0", rerun_err
    rerun = storage.lineage_paths(str(tmp_path / "after-rerun"), "chain_sum-replay-s0")
    state = storage.read_state(rerun)
    assert state.next_iteration == 4
    assert 3 in storage.complete_versions(rerun)
    assert json.loads(Path(rerun.state).read_text())["checkpoint"]["iteration"] == 3
