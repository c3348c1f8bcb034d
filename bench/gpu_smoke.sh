#!/usr/bin/env bash
# GPU smoke test: the inline loop on one GPU, as a Kubeflow task runs it: three RL iterations
# of the tiny model with one vLLM engine (sleeping while the trainer has the GPU, given the
# new weights in place), the trainer and its optimizer on the GPU, a full checkpoint at the
# end; prints one JSON object (device, engines built, per-iteration ledger parts, coverage,
# GPU peaks, pass@1). Budget: < 8 min on one GPU. Needs a CUDA GPU and the `gpu` extra (pip
# install -e '.[gpu]'); without them it stops at once with exit code 2 and says what is missing.
#   usage: bench/gpu_smoke.sh [PYTHON]      (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
fail() { echo "gpu_smoke: $*" >&2; exit 2; }
command -v nvidia-smi >/dev/null 2>&1 || fail "no nvidia-smi: this machine has no NVIDIA GPU driver; run on a GPU node."
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || fail "torch.cuda.is_available() is False for $PY (a CPU-only torch, or no visible GPU)."
"$PY" -c 'import vllm' 2>/dev/null \
  || fail "vllm is not importable by $PY; install the GPU extra: $PY -m pip install -e '.[gpu]'."
export REPLAYRL_CACHE="${REPLAYRL_CACHE:-$PWD/.cache/replayrl}"
exec timeout 480 "$PY" - <<'PYEOF'
import json, tempfile, time

import torch
from mlflow.tracking import MlflowClient

from replayrl import storage
from replayrl.config import load_config
from replayrl.generation_vllm import VLLMBackend
from replayrl.loop import run_inline

start_all = time.perf_counter()
root = tempfile.mkdtemp(prefix="replayrl-gpu-smoke-")
cfg = load_config(
    "configs/tiny-cpu.yaml",
    overrides=[
        f"storage.run_root={root}",
        "iterations=3",
        "eval.every=3",
        "rollout.prompts_per_iteration=64",
        "rollout.backend=vllm",
        "rollout.vllm_gpu_memory_utilization=0.3",
        "model.warm_start_max_steps=400",
        "train.checkpoint_every=3",
    ],
)
built = VLLMBackend.engines_built
summary = run_inline(cfg)
paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
client = MlflowClient(summary.tracking_uri)
run = client.get_run(summary.mlflow_run_id)
iterations = []
for t in range(1, 4):
    values = {}
    for key in run.data.metrics:
        if key.startswith(("ledger/", "gpu/", "rollout/mean_reward", "train/loss")):
            for m in client.get_metric_history(summary.mlflow_run_id, key):
                if m.step == t:
                    values[key] = round(m.value, 4)
    iterations.append({"iteration": t, **values})
import vllm
print(json.dumps(dict(
    device=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
    torch=torch.__version__, vllm=vllm.__version__,
    engines_built=VLLMBackend.engines_built - built,
    checkpoints=storage.complete_versions(paths),
    initial_pass1=summary.initial_pass1,
    final_pass1=summary.rows[-1].pass1 if summary.rows else None,
    min_coverage=min(i.get("ledger/coverage", 0.0) for i in iterations),
    iterations=iterations,
    total_s=round(time.perf_counter() - start_all, 1),
), indent=2))
PYEOF
