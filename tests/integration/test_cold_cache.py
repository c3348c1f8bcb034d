"""Two first runs at once on a cold warm-start cache, through the real CLI: `make run` and
`make run-on-policy` started side by side on a new machine. One builds the warm start, the
other waits for it; both lineages start from the same v0 and finish."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tiny_config

from replayrl import storage

pytestmark = pytest.mark.slow


def test_two_first_runs_at_once_share_one_warm_start_on_a_cold_cache(tmp_path):
    cache, root = tmp_path / "cold-cache", tmp_path / "runs"
    sets = [
        f"storage.run_root={root}",
        f"model.cache_dir={cache}",  # cold: nothing built yet
        *tiny_config.MODEL,
        *tiny_config.TASK,
        *tiny_config.LOOP,
        "iterations=1",
    ]
    argv = [sys.executable, "-m", "replayrl.cli.main", "run", "--config", str(tiny_config.PRESET)]
    argv += [a for s in sets for a in ("--set", s)]
    runs = [
        subprocess.Popen([*argv, "--arm", arm], stderr=subprocess.PIPE, text=True)
        for arm in ("replay", "on-policy")
    ]
    errs = [p.communicate(timeout=600)[1] for p in runs]
    for p, err in zip(runs, errs, strict=True):
        assert p.returncode == 0 and "Traceback" not in err, err
    assert any("waiting for it" in err for err in errs)  # they did overlap
    builds = sorted(p.name for p in (cache / "warmstart").iterdir() if p.is_dir())
    assert len(builds) == 1, builds  # one entry, no temporary folder left
    weights = []
    for arm in ("replay", "on-policy"):
        paths = storage.lineage_paths(str(root), f"chain_sum-{arm}-s0")
        assert storage.read_state(paths).next_iteration == 2
        files = storage.checkpoint_files_uri(paths.checkpoint(0))
        weights.append(storage.read_bytes(storage.join(files, "model.safetensors")))
    assert weights[0] == weights[1]
