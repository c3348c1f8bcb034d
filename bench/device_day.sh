#!/usr/bin/env bash
# Everything a lent GPU machine can check, in one call of at most 9 minutes (DEVICE_DAY_BUDGET_S,
# default 540), from this checkout's src/ on PYTHONPATH with nothing installed. The lent machine's
# image has torch, transformers, accelerate and safetensors but no vLLM, MLflow, deltalake or
# pyarrow, so it runs, in this order, each under a timeout of its own:
#   environment       versions, GPUs and which packages are importable (environment.json)
#   train_1gpu        bench/gpu_train_smoke.sh on GPU 0 at Qwen2.5-0.5B's shapes: one process,
#                     then FSDP2 as a group of one (loss within 1e-3 of one process's), the
#                     preset's bf16 settings, float32 loss inputs, MFU and peak-memory floors
#   train_cpu_2ranks  the same smoke's --device cpu --tiny mode on this image's torch: FSDP2 over
#                     two gloo ranks whose rows differ in length (different micro-batch counts,
#                     padded by gradient_step), the GPUs hidden
#   train_2gpu        the smoke on GPUs 0 and 1 (NCCL, ranks of uneven rows), when there are two
#   train_1gpu_ckpt   train_1gpu with --activation-checkpointing (its memory plan and 8x MFU)
#   train_1gpu_plain_alloc  train_1gpu without expandable_segments (which the smoke sets and
#                     replayrl does not): the allocator's reserved peak, with against without
#   gpu_smoke         bench/gpu_smoke.sh (two vLLM iterations, sleep/reload, checkpoints), only
#                     where vLLM imports and the budget has its 570 s left; else skipped
# Each check writes <name>.json (the smoke's own JSON) and <name>.log under $OUT (default
# bench/results/device_day), and device_day.json, rewritten after every check, lists each one's
# status (passed, failed, timed out, skipped), exit code, seconds and the tail of its log: a
# check that fails or hangs leaves the ones before it recorded. Exit 1 when any check failed or
# timed out, else 0. docs/gpu.md ("Device day") says what only the project image can check.
#   usage: OUT=dir bench/device_day.sh [PYTHON]   (PYTHON default: python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
OUT="${OUT:-bench/results/device_day}"
BUDGET_S="${DEVICE_DAY_BUDGET_S:-540}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/device_day.json"
START=$SECONDS
FAILED=0

# record NAME STATUS RC SECONDS [NOTE]: add one check to device_day.json (rewritten whole).
record() {
  "$PY" - "$SUMMARY" "$OUT" "$BUDGET_S" "$@" <<'EOF'
import json, sys
from pathlib import Path
summary, out, budget, name, status, rc, seconds = sys.argv[1:8]
note = sys.argv[8] if len(sys.argv) > 8 else None
path = Path(summary)
data = json.loads(path.read_text()) if path.exists() else {"budget_s": int(budget), "checks": []}
log = Path(out, f"{name}.log")
result = Path(out, f"{name}.json")
data["checks"].append({
    "name": name,
    "status": status,
    "rc": None if rc == "" else int(rc),
    "seconds": int(seconds),
    "json": result.name if result.exists() else None,
    "note": note,
    "log_tail": log.read_text(errors="replace").splitlines()[-15:] if log.exists() else [],
})
data["ok"] = all(c["status"] in ("passed", "skipped") for c in data["checks"])
tmp = path.with_suffix(".tmp")
tmp.write_text(json.dumps(data, indent=2) + "\n")
tmp.replace(path)
EOF
}

left() { echo $(( BUDGET_S - (SECONDS - START) )); }

# check NAME TIMEOUT_S [--skip-rc-2] COMMAND...: run it under min(TIMEOUT_S, the budget left),
# output to NAME.log; exit 2 is "skipped" (inputs missing) with --skip-rc-2, else a failure.
check() {
  local name="$1" limit="$2" skip2=0
  shift 2
  if [[ "${1:-}" == "--skip-rc-2" ]]; then skip2=1; shift; fi
  local remaining
  remaining=$(left)
  (( limit > remaining - 5 )) && limit=$(( remaining - 5 ))
  if (( limit < 30 )); then
    record "$name" skipped "" 0 "out of time: ${remaining} s of the ${BUDGET_S} s budget left"
    return
  fi
  echo "device_day: $name (at most ${limit} s)" >&2
  local t0=$SECONDS rc
  timeout --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  local status=passed
  if (( rc == 124 || rc == 137 )); then
    status="timed out"
  elif (( rc == 2 && skip2 )); then
    status=skipped
  elif (( rc != 0 )); then
    status=failed
  fi
  [[ "$status" == passed || "$status" == skipped ]] || FAILED=1
  record "$name" "$status" "$rc" $(( SECONDS - t0 )) "limit ${limit} s"
  echo "device_day: $name $status (exit $rc, $(( SECONDS - t0 )) s)" >&2
}

rm -f "$SUMMARY"
check environment 60 "$PY" - "$OUT/environment.json" <<'EOF'
import importlib.util, json, os, platform, shutil, subprocess, sys
info = {"python": platform.python_version(), "cpu_count": os.cpu_count()}
info["importable"] = {
    name: importlib.util.find_spec(name) is not None
    for name in ("torch", "transformers", "accelerate", "safetensors", "yaml", "numpy",
                 "vllm", "mlflow", "deltalake", "pyarrow", "pynvml", "pytest")
}
import torch, transformers
info.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
            transformers=transformers.__version__, cuda_available=torch.cuda.is_available())
info["gpus"] = [
    {"name": torch.cuda.get_device_name(i),
     "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
    for i in range(torch.cuda.device_count())
]
if shutil.which("nvidia-smi"):
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.splitlines()
import replayrl.policy.training  # src/ on PYTHONPATH: the trainer imports here
text = json.dumps(info, indent=2)
print(text)
open(sys.argv[1], "w").write(text + "\n")
sys.exit(0 if info["gpus"] else 1)
EOF

GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
smoke() { # smoke NAME TIMEOUT_S GPUS ARGS...: bench/gpu_train_smoke.sh writing NAME.json
  local name="$1" limit="$2" visible="$3"
  shift 3
  check "$name" "$limit" env CUDA_VISIBLE_DEVICES="$visible" GPU_TRAIN_SMOKE_OUT="$OUT/$name.json" \
    bash bench/gpu_train_smoke.sh "$PY" -- "$@"
}
smoke train_1gpu 240 0 --steps 3
smoke train_cpu_2ranks 150 "" --device cpu --tiny --steps 1 --cpu-ranks 2
if (( GPUS >= 2 )); then
  smoke train_2gpu 240 0,1 --steps 3
else
  record train_2gpu skipped "" 0 "${GPUS} GPU(s): two ranks need two GPUs (NCCL refuses two ranks on one)"
fi
smoke train_1gpu_ckpt 180 0 --steps 3 --activation-checkpointing
PYTORCH_CUDA_ALLOC_CONF="" smoke train_1gpu_plain_alloc 180 0 --steps 3
if "$PY" -c 'import vllm, mlflow, deltalake, pyarrow' >/dev/null 2>&1; then
  if (( $(left) >= 575 )); then
    check gpu_smoke 575 --skip-rc-2 env GPU_SMOKE_OUT="$OUT/gpu_smoke.json" bash bench/gpu_smoke.sh "$PY"
  else
    record gpu_smoke skipped "" 0 "needs 575 s, $(left) s left: set DEVICE_DAY_BUDGET_S=1200"
  fi
else
  record gpu_smoke skipped "" 0 "vLLM, MLflow, deltalake or pyarrow missing: the project image's check"
fi
echo "device_day: $( ((FAILED)) && echo 'a check failed' || echo 'all checks passed or skipped'); see $SUMMARY" >&2
exit "$FAILED"
