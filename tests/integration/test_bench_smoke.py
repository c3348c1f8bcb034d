"""Each benchmark runs in `--quick` mode (tiny sizes) and prints one valid JSON object with
its ratios, targets and machine. The figures themselves are not checked here: `make bench`
measures them at full size; this only shows the scripts run end to end on real parts
(Delta tables, a SeaweedFS server, the tiny model, kfp.local)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

EXPECTED_RATIOS = {
    "bench_buffer.py": {"append_local_ratio", "append_s3_ratio", "compact_ratio"},
    "bench_sampling.py": {
        "sample_big_over_small",
        "sample_big_ms",
        "sample_big_over_bare_big",
        "sample_extra_rss_over_full_read",
        "sample_extra_rss_over_table",
        "mirror_sample_big_ms",
        "mirror_sample_big_over_small",
        "mirror_sync_append_big_over_small",
    },
    "bench_train.py": {
        "train_tokens_per_s_ratio",
        "train_peak_rss_ratio",
        "shapes_train_tokens_per_s_ratio",
        "shapes_train_peak_rss_ratio",
    },
    "bench_generation.py": {"generation_tokens_per_s_ratio"},
    "bench_engine.py": {"kfp_local_over_inline"},
    "bench_publication.py": {
        "bf16_over_float32_bytes",
        "trainer_wait_over_bare",
        "trainer_wait_over_float32_sync",
        "bf16_background_total_over_float32_sync",
        "broadcast_over_bare",
        "broadcast_over_float32_sync",
    },
    "bench_download.py": {
        "loopback_parallel_speedup_over_one_stream",
        "loopback_parallel_over_bare",
        "capped_parallel_speedup_over_one_stream",
        "capped_parallel_over_bare",
    },
}


def run_quick(script: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--quick", "--no-write"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    "script",
    [
        "bench_buffer.py",
        pytest.param("bench_sampling.py", marks=pytest.mark.slow),
        pytest.param("bench_train.py", marks=pytest.mark.slow),
        "bench_generation.py",
        pytest.param("bench_engine.py", marks=pytest.mark.slow),
        # ~13 s: a SeaweedFS server and two spawned receiver processes (gloo)
        pytest.param("bench_publication.py", marks=pytest.mark.slow),
        # ~14 s: a SeaweedFS server, and 2 x 20 MiB through a paced proxy several times
        pytest.param("bench_download.py", marks=pytest.mark.slow),
    ],
)
def test_quick_run_prints_its_ratios(script):
    result = run_quick(script)
    assert result["quick"] is True
    assert set(result["ratios"]) == EXPECTED_RATIOS[script]
    for name, value in result["ratios"].items():
        assert isinstance(value, float) and math.isfinite(value) and value >= 0, (name, value)
    assert set(result["met"]) == set(result["targets"])
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["pyarrow"]
    if script == "bench_publication.py":  # a weights-only copy in bf16: half the bytes
        assert 0.49 < result["ratios"]["bf16_over_float32_bytes"] < 0.51
    assert "hostname" not in json.dumps(result["machine"]).lower()
