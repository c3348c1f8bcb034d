#!/usr/bin/env bash
# GPU smoke run at Qwen2.5-0.5B's shapes, nothing downloaded: builds the model's architecture
# from its published configuration with random weights and gives it 30 supervised steps (or
# takes --checkpoint DIR), checks vLLM's log-probs against the trainer's at temperature 1 and
# 0.7, runs TWO full iterations of the GPU preset (each: 1,024 rollouts of up to 512 tokens from
# one vLLM engine in sleep mode, 4 bf16 gradient steps of 512 rows, a full checkpoint after
# each) on one GPU, then checks the behaviour log-probs iteration 2 stored (v1's, after the
# sleep -> in-place reload -> prefix reset) against the trainer's log-probs of checkpoint v1.
# Both agreement checks assert mean |delta| <= 0.05 and <= 2 % of tokens outside the clip; it
# also asserts one engine built, complete checkpoints v1 and v2 and finite losses. Prints JSON:
# generation and training tokens/s, mu, wall seconds and peak GPU memory per phase, the checks
# (bench/gpu_smoke.py says what each figure is). Writes the JSON to bench/results/gpu_smoke.json.
# Exit 1 when a check fails. Device memory is read through NVML (pip install nvidia-ml-py) by a
# thread that never touches CUDA; without it, once after the run. Budget: 9 minutes on one H200
# (it is killed at 9.5).
#
# Needs a CUDA GPU, a torch that sees it, and the `gpu` extra (pip install -e '.[gpu]'); without
# them it stops at once with exit code 2 and says what is missing. The same path runs on the
# CPU in `make test`: bench/gpu_smoke.py --device cpu --tiny (transformers backend, tiny shapes).
#   usage: bench/gpu_smoke.sh [PYTHON] [--checkpoint DIR] [--sft-steps N]
#   (PYTHON default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=""
if [[ $# -gt 0 && "$1" != --* ]]; then PY="$1"; shift; fi
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
fail() { echo "gpu_smoke: $*" >&2; exit 2; }
command -v "$PY" >/dev/null 2>&1 || [[ -x "$PY" ]] || fail "no Python at '$PY'."
"$PY" -c 'import replayrl' 2>/dev/null \
  || fail "replayrl is not importable by $PY; run 'make setup' or pip install -e '.[gpu]'."
[[ -f configs/qwen2.5-0.5b-gsm8k.yaml ]] || fail "configs/qwen2.5-0.5b-gsm8k.yaml is missing."
command -v nvidia-smi >/dev/null 2>&1 \
  || fail "no nvidia-smi: this machine has no NVIDIA GPU driver; run on a GPU node."
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || fail "torch.cuda.is_available() is False for $PY (a CPU-only torch, no visible GPU, or a driver older than the torch wheel's CUDA needs)."
"$PY" -c 'import vllm' 2>/dev/null \
  || fail "vllm is not importable by $PY; install the GPU extra: $PY -m pip install -e '.[gpu]'."
free_gib=$("$PY" -c 'import torch; f, t = torch.cuda.mem_get_info(); print(int(f / 2**30))')
(( free_gib >= 40 )) || fail "the GPU has ${free_gib} GiB free; the 0.5B iteration needs about 40."
mkdir -p bench/results
export REPLAYRL_CACHE="${REPLAYRL_CACHE:-$(mktemp -d)/cache}"
export GPU_SMOKE_OUT="${GPU_SMOKE_OUT:-bench/results/gpu_smoke.json}"
exec timeout 570 "$PY" bench/gpu_smoke.py "$@"
