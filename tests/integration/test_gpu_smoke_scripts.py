"""The GPU smoke scripts check their inputs: on a machine without a GPU each stops at once with
exit code 2 and one line saying why. The training smoke runs on torch, transformers,
accelerate and safetensors alone: with MLflow, deltalake, pyarrow and vLLM made unimportable
it still gets as far as looking for a GPU (and its trainer modules import).

Both smokes also run here, in their CPU mode (`--device cpu --tiny`): the same code as on a
GPU at tiny shapes (gloo instead of NCCL, the transformers generation backend instead of
vLLM), so neither can rot between GPU days. Each asserts its own checks (exit 1 when one
fails) and writes them to its JSON, which these tests read."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")

BLOCKER = """
import importlib.machinery, runpy, sys
BLOCKED = {"mlflow", "deltalake", "pyarrow", "vllm"}
_find_spec = importlib.machinery.PathFinder.find_spec
def find_spec(name, path=None, target=None):
    # As if not installed: found nowhere, so importlib.util.find_spec gives None (accelerate
    # and transformers ask it whether MLflow is there) and an import raises.
    if name.split(".")[0] in BLOCKED:
        return None
    return _find_spec(name, path, target)
importlib.machinery.PathFinder.find_spec = staticmethod(find_spec)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _env(**extra: str) -> dict[str, str]:
    # Spawned FSDP ranks share the two cores: one thread each.
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", **extra}


def _one_line(done: subprocess.CompletedProcess, prefix: str) -> str:
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith(prefix), done.stderr
    return lines[0]


@no_gpu
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


@no_gpu
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


@no_gpu
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


def _train_smoke(tmp_path: Path, *args: str, blocked: bool = False):
    out = tmp_path / "train_smoke.json"
    script = str(REPO / "bench" / "gpu_train_smoke.py")
    argv = [script, "--device", "cpu", "--tiny", "--steps", "1", "--out", str(out), *args]
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER, *argv] if blocked else [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
        cwd=REPO,
    )
    return done, (json.loads(out.read_text()) if out.exists() else None)


def _check_train_smoke(done, result, *, ranks: int):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert result is not None and result["ok"], done.stderr[-6000:]
    assert all(result["checks"].values()), result["checks"]
    one, fsdp = result["one_gpu"], result["fsdp"]
    assert fsdp is not None and fsdp["gpus"] == ranks
    # Finite losses, warm-up step included, in both phases.
    for phase in (one, fsdp):
        assert len(phase["losses"]) == 2 and all(math.isfinite(v) for v in phase["losses"])
        assert all(math.isfinite(v) for v in phase["grad_norms"])
    # The same global batch, the same weights: FSDP's global loss is one process's.
    assert abs(fsdp["losses"][0] - one["losses"][0]) <= 1e-3
    # Rows of uneven lengths: padding and masks as the trainer's collate builds them.
    lengths = result["shapes"]["row_lengths"]
    assert min(lengths) < max(lengths)
    # The trainer's own bf16 policy: bf16 gathered weights, float32 gradient reduction...
    assert fsdp["layer_weight_dtype"] == "torch.bfloat16"
    assert fsdp["mixed_precision"]["param_dtype"] == "torch.bfloat16"
    assert fsdp["mixed_precision"]["reduce_dtype"] == "torch.float32"
    assert one["mixed_precision"] is None and one["layer_weight_dtype"] == "torch.float32"
    # ... and the loss reads float32 behaviour log-probs and advantages.
    assert set(one["loss_input_dtypes"].values()) == {"torch.float32"}
    assert set(fsdp["loss_input_dtypes"].values()) == {"torch.float32"}


@pytest.mark.slow
def test_gpu_train_smoke_runs_on_the_cpu_and_checks_what_it_prints(tmp_path):
    """`gpu_train_smoke.py --device cpu --tiny --steps 1`: one process, then FSDP2 over two
    gloo ranks, each step through the trainer's loss, collate and micro-batch cut."""
    done, result = _train_smoke(tmp_path)
    _check_train_smoke(done, result, ranks=2)


@pytest.mark.slow
def test_gpu_train_smoke_one_fsdp_rank_equals_one_process(tmp_path):
    """With one rank, FSDP (the trainer's bf16 policy) gives the one-process loss."""
    done, result = _train_smoke(tmp_path, "--cpu-ranks", "1")
    _check_train_smoke(done, result, ranks=1)
    assert result["fsdp"]["micro_batches_per_rank"] == result["one_gpu"]["micro_batches_per_rank"]


@pytest.mark.slow
def test_gpu_train_smoke_cpu_mode_needs_no_mlflow_deltalake_pyarrow_or_vllm(tmp_path):
    """Its whole path, the FSDP phase included (one rank: in this process, where the
    blocked imports hold), with only torch, transformers, accelerate and safetensors."""
    done, result = _train_smoke(tmp_path, "--cpu-ranks", "1", blocked=True)
    _check_train_smoke(done, result, ranks=1)


@pytest.mark.slow
def test_gpu_smoke_runs_two_iterations_on_the_cpu(tmp_path):
    """`gpu_smoke.py --device cpu --tiny`: the GPU preset (chat format reset to plain for the
    byte tokenizer), two iterations with the transformers backend, the agreement check in its
    own process, then iteration 2's stored behaviour log-probs against the trainer's v1."""
    out = tmp_path / "gpu_smoke.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_smoke.py"), "--device", "cpu", "--tiny"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(GPU_SMOKE_OUT=str(out), REPLAYRL_CACHE=str(tmp_path / "cache")),
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["ok"] is True and all(result["checks"].values()), result["checks"]
    assert result["backend"] == "transformers" and result["iterations"] == 2
    # No vLLM engine on the CPU (vLLM asserts exactly one).
    assert result["engines_built"] == 0
    assert 2 in result["checkpoints"] and 1 in result["checkpoints"]
    assert len(result["train_loss"]) == 2 and all(math.isfinite(v) for v in result["train_loss"])
    v1 = result["behavior_vs_trainer"]
    assert v1["rows"] > 0 and v1["policy_version"] == 1
    # float32 on both sides: far inside the GPU tolerances, and v1's, not v0's.
    assert v1["v1"]["mean_abs_diff"] < 1e-3 < v1["v0"]["mean_abs_diff"]
    assert result["logprob_agreement"]["ok"] is True
    assert result["logprob_agreement"]["backend"] == "transformers"
