"""The GPU smoke scripts check their inputs: on a machine without a GPU each stops at once with
exit code 2 and one line saying why. The training smoke runs on torch, transformers,
accelerate and safetensors alone: with MLflow, deltalake, pyarrow and vLLM made unimportable
in every process (a sitecustomize.py on PYTHONPATH, as on the lent GPU machine's image) it gets
as far as looking for a GPU, and its CPU mode runs through.

Both smokes also run here, in their CPU mode (`--device cpu --tiny`): the same code as on a
GPU at tiny shapes (gloo instead of NCCL, the transformers generation backend instead of
vLLM), so neither can rot between GPU days. Each asserts its own checks (exit 1 when one
fails) and writes them to its JSON, which these tests read. bench/device_day.sh, which runs
them on a lent machine, records every check's outcome even when one fails or runs out of time.
"""

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

# A sitecustomize.py on PYTHONPATH, so it runs in every Python process of the smoke, the ranks
# torch spawns included: MLflow, deltalake, pyarrow and vLLM as if not installed, found nowhere
# (importlib.util.find_spec gives None, which transformers and accelerate ask before importing
# MLflow; a finder that raised instead would break their import, unlike a missing package),
# so an import raises ModuleNotFoundError. Each process adds its pid to $BLOCKER_LOG.
BLOCKER = """
import importlib.machinery, os
BLOCKED = {"mlflow", "deltalake", "pyarrow", "vllm"}
_find_spec = importlib.machinery.PathFinder.find_spec
def find_spec(name, path=None, target=None):
    if name.split(".")[0] in BLOCKED:
        return None
    return _find_spec(name, path, target)
importlib.machinery.PathFinder.find_spec = staticmethod(find_spec)
if os.environ.get("BLOCKER_LOG"):
    with open(os.environ["BLOCKER_LOG"], "a") as log:
        log.write(f"{os.getpid()}\\n")
"""


def _blocked_env(tmp_path: Path) -> dict[str, str]:
    """`_env()` in which MLflow, deltalake, pyarrow and vLLM do not import (BLOCKER)."""
    site = tmp_path / "blocker"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = _env(BLOCKER_LOG=str(tmp_path / "blocker.log"))
    env["PYTHONPATH"] = f"{site}{os.pathsep}{env['PYTHONPATH']}"
    return env


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


def test_the_blocker_makes_the_four_packages_unimportable(tmp_path):
    code = (
        "import importlib, importlib.util\n"
        "for name in ('mlflow', 'deltalake', 'pyarrow', 'vllm'):\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise AssertionError(name)\n"
        "import yaml, numpy\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_blocked_env(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    # pyarrow is installed here: without the blocker it imports.
    unblocked = subprocess.run([sys.executable, "-c", "import pyarrow"], env=_env())
    assert unblocked.returncode == 0


@no_gpu
def test_gpu_train_smoke_needs_no_mlflow_deltalake_pyarrow_or_vllm(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_train_smoke.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=_blocked_env(tmp_path),
        cwd=REPO,
    )
    # Not an ImportError: it imported the trainer and reached the GPU check.
    assert "no GPU" in _one_line(done, "gpu_train_smoke: ")


def _train_smoke(tmp_path: Path, *args: str, blocked: bool = False):
    out = tmp_path / "train_smoke.json"
    script = str(REPO / "bench" / "gpu_train_smoke.py")
    argv = [script, "--device", "cpu", "--tiny", "--steps", "1", "--out", str(out), *args]
    done = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=240,
        env=_blocked_env(tmp_path) if blocked else _env(),
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
        assert all(math.isfinite(v) for v in phase["grad_norms"]) and phase["refused"] is None
    # The same global batch, the same weights: FSDP's global loss is one process's.
    assert abs(fsdp["losses"][0] - one["losses"][0]) <= 1e-3
    # Rows of uneven lengths, within a rank and, with two, across the ranks.
    (lengths,) = one["row_lengths_per_rank"]
    assert min(lengths) < max(lengths)
    assert sorted(n for shard in fsdp["row_lengths_per_rank"] for n in shard) == sorted(lengths)
    # The GPU preset's settings as the engine resolves them on a GPU: the trainer's bf16 policy,
    # bf16 gathered weights, float32 gradient reduction...
    assert result["settings"]["dtype"] == "bfloat16" and result["settings"]["lr"] == 1e-6
    assert fsdp["layer_weight_dtype"] == "torch.bfloat16"
    assert fsdp["mixed_precision"]["param_dtype"] == "torch.bfloat16"
    assert fsdp["mixed_precision"]["reduce_dtype"] == "torch.float32"
    assert one["mixed_precision"] is None and one["layer_weight_dtype"] == "torch.float32"
    # ... and the loss reads float32 behaviour log-probs and advantages.
    assert set(one["loss_input_dtypes"].values()) == {"torch.float32"}
    assert set(fsdp["loss_input_dtypes"].values()) == {"torch.float32"}
    # The floors are recorded on the CPU, not asserted; the memory plan's peak beside them.
    floors = result["floors"]
    assert floors["asserted"] is False and "mfu_floor" not in result["checks"]
    for name in ("one_gpu", "fsdp"):
        assert floors[name]["mfu_min"] > 0 and floors[name]["mfu"] is None
        assert floors[name]["planned_training_peak_bytes"] > 0


@pytest.mark.slow
def test_gpu_train_smoke_runs_on_the_cpu_with_no_mlflow_deltalake_pyarrow_or_vllm(tmp_path):
    """`gpu_train_smoke.py --device cpu --tiny --steps 1` with MLflow, deltalake, pyarrow and
    vLLM unimportable in every process (the device image has none of them): one process, then
    FSDP2 over two gloo ranks whose rows differ in length, so they cut different numbers of
    micro-batches and `gradient_step` pads the one with fewer."""
    done, result = _train_smoke(tmp_path, blocked=True)
    _check_train_smoke(done, result, ranks=2)
    assert result["fsdp"]["micro_batches_per_rank"] == [1, 2]
    assert result["checks"]["ranks_cut_different_micro_batch_counts"] is True
    # The blocker ran in this process and in both spawned ranks (and torch's helpers).
    assert len(set((tmp_path / "blocker.log").read_text().split())) >= 3


@pytest.mark.slow
def test_gpu_train_smoke_one_fsdp_rank_equals_one_process(tmp_path):
    """With one rank, FSDP (the trainer's bf16 policy) gives the one-process loss."""
    done, result = _train_smoke(tmp_path, "--cpu-ranks", "1")
    _check_train_smoke(done, result, ranks=1)
    assert result["fsdp"]["micro_batches_per_rank"] == result["one_gpu"]["micro_batches_per_rank"]


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
    # No engine to sleep or reload on the CPU; the ledger still times the (empty) sync.
    assert result["vllm_sleep_level"] is None and len(result["engine_sync_seconds"]) == 2
    v1 = result["behavior_vs_trainer"]
    assert v1["rows"] > 0 and v1["policy_version"] == 1
    # float32 on both sides: far inside the GPU tolerances, and v1's, not v0's.
    assert v1["v1"]["mean_abs_diff"] < 1e-3 < v1["v0"]["mean_abs_diff"]
    assert result["logprob_agreement"]["ok"] is True
    assert result["logprob_agreement"]["backend"] == "transformers"


DEVICE_DAY_CHECKS = [
    "environment",
    "train_1gpu",
    "train_cpu_2ranks",
    "train_2gpu",
    "train_1gpu_ckpt",
    "train_1gpu_plain_alloc",
    "gpu_smoke",
]


@no_gpu
@pytest.mark.slow
def test_device_day_records_every_check_within_its_budget_and_fails_without_a_gpu(tmp_path):
    """bench/device_day.sh on a machine without a GPU, given 60 s: the environment is recorded
    (and fails: no GPU), the GPU smokes fail (exit 2: a lent machine must have a GPU), the CPU
    smoke gets what is left of the budget (here less than it needs: killed, recorded as timed
    out), the two-GPU and vLLM checks are skipped, each is in device_day.json, and it exits 1
    within the budget."""
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "device_day.sh"), sys.executable],
        capture_output=True,
        text=True,
        timeout=180,
        env={**_env(), "OUT": str(out), "DEVICE_DAY_BUDGET_S": "60"},
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    summary = json.loads((out / "device_day.json").read_text())
    checks = {c["name"]: c for c in summary["checks"]}
    assert [c["name"] for c in summary["checks"]] == DEVICE_DAY_CHECKS
    assert summary["ok"] is False and summary["budget_s"] == 60
    environment = json.loads((out / "environment.json").read_text())
    assert checks["environment"]["status"] == "failed" and environment["gpus"] == []
    assert environment["importable"]["torch"] and not environment["importable"]["vllm"]
    assert checks["train_1gpu"]["status"] == "failed" and checks["train_1gpu"]["rc"] == 2
    assert any("no GPU" in line for line in checks["train_1gpu"]["log_tail"])
    cpu = checks["train_cpu_2ranks"]
    assert cpu["status"] in ("timed out", "passed", "skipped"), cpu
    if cpu["status"] == "timed out":
        assert cpu["rc"] in (124, 137) and cpu["seconds"] <= 60
    assert checks["train_2gpu"]["status"] == "skipped" and "GPU" in checks["train_2gpu"]["note"]
    for name in ("train_1gpu_ckpt", "train_1gpu_plain_alloc"):
        assert checks[name]["status"] in ("failed", "skipped")
    assert checks["gpu_smoke"]["status"] == "skipped" and "vLLM" in checks["gpu_smoke"]["note"]
    assert sum(c["seconds"] for c in summary["checks"]) <= 60 + 20
