#!/usr/bin/env bash
# Training steps at Qwen2.5-0.5B's shapes on any GPU machine, with nothing installed but torch,
# transformers, accelerate and safetensors: no vLLM, MLflow, deltalake, pyarrow or network. Runs
# bench/gpu_train_smoke.py from this checkout's src/ (PYTHONPATH, no pip install): random
# weights, vocabulary 151,936, B = 64 rows of 64 + 128 to 512 tokens (uneven lengths, within a
# rank and across ranks), each step the trainer's own `gradient_step` with the GPU preset's
# settings as the engine resolves them on a GPU (bf16 autocast, float32 master weights, chunked
# log-probs), on one GPU and then under FSDP2 as the trainer shards it (its bf16 mixed
# precision) over all visible GPUs (a group of one on one GPU). Prints JSON (tokens/s, MFU, peak
# memory per phase beside the memory plan's, losses, floors, checks) and writes it to
# bench/results/gpu_train_smoke.json (GPU_TRAIN_SMOKE_OUT). Exit 1 when a check fails: a loss or
# gradient norm not finite, FSDP's loss more than 1e-3 from one process's on the same batch, a
# bf16 policy other than the trainer's, bf16 loss inputs, or (on CUDA) an MFU below its floor or
# a peak above 1.2 x the memory plan's. Budget: ~3 minutes on one H100/H200 (killed at 9).
# bench/device_day.sh runs it, with one and two GPUs and in its CPU mode, on a lent machine.
#
# Needs torch >= 2.11 with CUDA, transformers >= 5.17, accelerate and safetensors:
#   python -m pip install 'torch>=2.11' 'transformers>=5.17' accelerate safetensors
# Without a GPU (or with any of them missing) it stops at once with exit code 2 and one line.
# The same code runs on the CPU in `make test`: gpu_train_smoke.py --device cpu --tiny.
#   usage: bench/gpu_train_smoke.sh [PYTHON] [-- extra arguments of gpu_train_smoke.py]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-}"
[[ "$PY" == "--" ]] && PY=""
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
shift $(( $# > 0 ? 1 : 0 )) || true
[[ "${1:-}" == "--" ]] && shift
fail() { echo "gpu_train_smoke: $*" >&2; exit 2; }
command -v "$PY" >/dev/null 2>&1 || [[ -x "$PY" ]] || fail "no Python at '$PY'."
[[ -f src/replayrl/policy/training.py ]] || fail "src/replayrl is missing: run it from a replayrl checkout."
mkdir -p bench/results
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 540 "$PY" bench/gpu_train_smoke.py --out "${GPU_TRAIN_SMOKE_OUT:-bench/results/gpu_train_smoke.json}" "$@"
