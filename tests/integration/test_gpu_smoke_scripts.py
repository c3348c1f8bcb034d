"""The GPU smoke scripts check their inputs: on a machine without a GPU each stops at once with
exit code 2 and one line saying why. The training smoke runs on torch, transformers,
accelerate and safetensors alone: with MLflow, deltalake, pyarrow and vLLM made unimportable
it still gets as far as looking for a GPU (and its trainer modules import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path"),
]

BLOCKER = """
import importlib.abc, runpy, sys
BLOCKED = {"mlflow", "deltalake", "pyarrow", "vllm"}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Blocker())
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "src")}


def _one_line(done: subprocess.CompletedProcess, prefix: str) -> str:
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith(prefix), done.stderr
    return lines[0]


def test_gpu_smoke_exits_2_without_a_gpu():
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_smoke.sh"), sys.executable],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    line = _one_line(done, "gpu_smoke: ")
    assert "GPU" in line or "nvidia-smi" in line or "vllm" in line


def test_gpu_train_smoke_exits_2_without_a_gpu(tmp_path):
    out = tmp_path / "smoke.json"
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_train_smoke.sh"), sys.executable],
        capture_output=True,
        text=True,
        timeout=300,
        env={**_env(), "GPU_TRAIN_SMOKE_OUT": str(out)},
    )
    assert "no GPU" in _one_line(done, "gpu_train_smoke: ")
    assert not out.exists()


def test_gpu_train_smoke_needs_no_mlflow_deltalake_pyarrow_or_vllm():
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER, str(REPO / "bench" / "gpu_train_smoke.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=REPO,
    )
    # Not an ImportError: it imported the trainer and reached the GPU check.
    assert "no GPU" in _one_line(done, "gpu_train_smoke: ")
