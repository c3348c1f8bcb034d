#!/usr/bin/env bash
# GPU smoke test: two RL iterations of the tiny model with vLLM generation and GPU training
# (replayrl.generation_vllm + replayrl.distributed), then greedy pass@1 with vLLM; prints one
# JSON object (device, per-iteration seconds, generated tokens/s, pass@1). Budget: < 8 min on
# one GPU. Needs a CUDA GPU and the `gpu` extra (pip install -e '.[gpu]'); without them it
# stops at once with exit code 2 and says what is missing. It calls the library directly, not
# the inline engine, so it checks the GPU pieces whatever the engine wiring.
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
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from replayrl import steps
from replayrl.advantages import compute_advantages
from replayrl.config import load_config
from replayrl.distributed import train_on_batches
from replayrl.evaluate import evaluate_policy
from replayrl.generation_vllm import VLLMBackend
from replayrl.rewards import score
from replayrl.train import StepSettings

start_all = time.perf_counter()
# The CPU demo preset, bigger per iteration so the GPU has work: R = 64 prompts x 8 samples.
cfg = load_config(
    "configs/tiny-cpu.yaml",
    overrides=["rollout.prompts_per_iteration=64", "model.warm_start_max_steps=400"],
)
splits = steps.task_splits(cfg)
t0 = time.perf_counter()
checkpoint = steps.initial_policy(cfg)  # cached warm start (CPU); v0
warm_start_s = time.perf_counter() - t0
tr, ro = cfg.train, cfg.rollout
settings = StepSettings(
    loss_name=tr.loss, clip_eps=tr.clip_eps, is_cap=tr.is_cap, temperature=ro.temperature,
    grad_clip=tr.grad_clip, lr=tr.lr, weight_decay=tr.weight_decay,
    betas=(tr.adam_beta1, tr.adam_beta2),
)
vllm_options = dict(gpu_memory_utilization=0.3, max_model_len=64, seed=cfg.seed)


def pass1(directory):
    backend = VLLMBackend(directory, **vllm_options)
    try:
        return evaluate_policy(
            backend=backend, problems=splits.eval[:256], reward_kind=splits.reward_kind,
            max_new_tokens=ro.max_new_tokens, num_samples=1, k=1, temperature=1.0,
            seed=cfg.seed, sampled=False,
        ).pass1
    finally:
        backend.close()


iterations = []
work = Path(tempfile.mkdtemp(prefix="replayrl-gpu-smoke-"))
initial_pass1 = pass1(checkpoint)
for t in (1, 2):
    it_start = time.perf_counter()
    problems = steps.iteration_prompts(cfg, splits, t)
    t1 = time.perf_counter()
    backend = VLLMBackend(checkpoint, **vllm_options)
    load_s = time.perf_counter() - t1
    t1 = time.perf_counter()
    completions = backend.generate(
        [p.prompt for p in problems], num_samples=ro.samples_per_prompt,
        max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p,
        seed=steps.derive_seed(cfg.seed, "generate", t),
    )
    generate_s = time.perf_counter() - t1
    backend.close()
    rewards = np.array([
        score(kind=splits.reward_kind, completion=c.text,
              answer=problems[c.prompt_index].answer).reward
        for c in completions
    ])
    advantages = compute_advantages(
        loss=tr.loss, rewards=rewards,
        group_ids=np.array([c.prompt_index for c in completions]), delta_v=tr.delta_v,
    )
    table = pa.table({
        "prompt_token_ids": [c.prompt_token_ids for c in completions],
        "completion_token_ids": [c.completion_token_ids for c in completions],
        "behavior_logprobs": [c.logprobs for c in completions],
        "advantage": np.asarray(advantages, dtype=np.float32),
        "reward": rewards.astype(np.float32),
    })
    rng = np.random.default_rng(t)
    batches = [table.take(rng.choice(table.num_rows, tr.batch_size, replace=False))
               for _ in range(tr.steps_per_iteration)]
    t1 = time.perf_counter()
    out_dir = work / f"v{t}"
    stats = train_on_batches(
        checkpoint_dir=checkpoint, out_dir=out_dir, batches=batches, settings=settings,
        mode="ddp", num_processes=1, cpu=False, seed=t,
    )
    train_s = time.perf_counter() - t1
    checkpoint = out_dir
    tokens = sum(len(c.completion_token_ids) for c in completions)
    iterations.append(dict(
        iteration=t, seconds=round(time.perf_counter() - it_start, 3),
        vllm_load_s=round(load_s, 3), generate_s=round(generate_s, 3),
        train_s=round(train_s, 3), rollouts=len(completions), generated_tokens=tokens,
        generated_tokens_per_s=round(tokens / generate_s, 1),
        mean_reward=float(rewards.mean()), loss=float(np.mean([s.loss for s in stats])),
        grad_norm=float(np.mean([s.grad_norm for s in stats])),
    ))
import vllm
print(json.dumps(dict(
    device=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
    torch=torch.__version__, vllm=vllm.__version__, warm_start_s=round(warm_start_s, 1),
    initial_pass1=initial_pass1, final_pass1=pass1(checkpoint), iterations=iterations,
    total_s=round(time.perf_counter() - start_all, 1),
), indent=2))
PYEOF
