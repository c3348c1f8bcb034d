"""A lineage resumed with a changed config, through the real CLI: a change that would make
it another experiment (the learning rate, the buffer) is refused with one line naming the
keys, before anything is touched; the lineage's own config.yaml damaged or gone still gives
one line; a change the lineage accepts (more iterations) goes on."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import tiny_config
from fault_helpers import cli

from replayrl import storage

pytestmark = pytest.mark.slow


def _run(root: Path, *extra: str) -> subprocess.CompletedProcess:
    sets = tiny_config.overrides(root, "iterations=1", *extra)
    return cli("run", "--config", str(tiny_config.PRESET), *[a for s in sets for a in ("--set", s)])


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("replayrl: error:")]
    return line


def test_a_changed_config_on_resume_is_one_line_and_touches_nothing(tmp_path):
    root = tmp_path / "runs"
    assert _run(root).returncode == 0
    paths = storage.lineage_paths(str(root), "chain_sum-replay-s0")
    state = Path(paths.state).read_bytes()

    line = _one_error_line(_run(root, "train.lr=0.5", "buffer.capacity=128"))
    assert "different config" in line and "train.lr" in line and "buffer.capacity" in line
    assert "new --lineage" in line
    assert Path(paths.state).read_bytes() == state

    # The lineage's record of its config damaged, then gone: still one line.
    Path(paths.config).write_text("{{{ not yaml")
    assert "different config" in _one_error_line(_run(root, "train.lr=0.5"))
    Path(paths.config).unlink()
    assert "different config" in _one_error_line(_run(root, "train.lr=0.5"))
    assert Path(paths.state).read_bytes() == state

    # More iterations is the same experiment, longer.
    longer = _run(root, "iterations=2")
    assert longer.returncode == 0, longer.stderr
    assert storage.read_state(paths).next_iteration == 3
