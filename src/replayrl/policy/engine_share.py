"""How much of its GPU's memory a vLLM engine takes (`gpu_memory_utilization`).

`memory_share` is the engine's default share: what is left of 90% after the trainer's
resident memory when the trainer shares the GPU (halved when the trainer trains while the
engine generates), split between the engines on that GPU; 90% alone.
`gpu_sharing_from_env` reads what the asynchronous engine set for its role processes.
Pure arithmetic on sizes and the environment: no torch, no vLLM.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from replayrl.errors import ReplayRLError

# The share of GPU memory the engine takes when nothing else lives on its GPU: the rest is
# the CUDA context, NCCL and buffers outside vLLM's accounting.
ALONE_MEMORY_SHARE = 0.9
# Below this the engine has little room for a KV cache after its own weights.
MIN_MEMORY_SHARE = 0.1
# What a float32 AdamW trainer keeps on the GPU per parameter between its steps: the
# weights, their gradients and AdamW's two moments, 4 bytes each.
TRAINER_BYTES_PER_PARAM = 16
# Without CUDA, vLLM's CPU build reads the share as the fraction of host memory to reserve
# for its KV cache (unless VLLM_CPU_KVCACHE_SPACE sets the size): half, as the trainer, the
# buffer and the OS live there too.
CPU_MEMORY_SHARE = 0.5
# What shares this process's GPU, set by the asynchronous engine for each role it starts.
SHARING_ENV = "REPLAYRL_GPU_SHARING"


def memory_share(
    *,
    trainer_params: int,
    gpu_bytes: int | None,
    engines: int = 1,
    trainer_concurrent: bool = False,
) -> float:
    """The fraction of GPU memory (`gpu_memory_utilization`) one vLLM engine can take.

    trainer_params: parameters of a trainer that keeps its float32 weights, gradients and
        AdamW state on the same GPU; 0 when no trainer shares the GPU.
    gpu_bytes: the GPU's total memory; None without CUDA (then `CPU_MEMORY_SHARE`).
    engines: vLLM engines on this GPU, this one included (each takes the same share; the
        asynchronous engine's workers and evaluator may share a GPU).
    trainer_concurrent: the trainer trains while the engines generate (the asynchronous
        engine). False: the engine sleeps while the trainer runs (the synchronous engine),
        so the trainer's activations need no room beside it. True: half of what is left
        after the trainer's resident state stays free for its activations.

    (0.9 - trainer bytes / GPU bytes), halved when the trainer is concurrent, divided by
    `engines`, rounded down to 0.01; a ReplayRLError when that is below `MIN_MEMORY_SHARE`.
    Worked examples on an 80 GiB GPU: Qwen2.5-0.5B's trainer (494M parameters, 7.9 GB of
    state) beside one sleeping engine: 0.9 - 7.9 / 85.9 = 0.808 -> 0.80; one engine alone:
    0.90; two asynchronous workers and the evaluator alone on it: 0.30 each; the same three
    beside that trainer training: 0.808 / 2 / 3 -> 0.13 each.
    """
    if engines < 1:
        raise ValueError(f"engines must be at least 1, not {engines}")
    if gpu_bytes is None:
        return CPU_MEMORY_SHARE
    trainer_bytes = TRAINER_BYTES_PER_PARAM * max(trainer_params, 0)
    left = ALONE_MEMORY_SHARE - trainer_bytes / gpu_bytes
    if trainer_bytes and trainer_concurrent:
        left /= 2
    share = math.floor(left / engines * 100 + 1e-9) / 100
    if share < MIN_MEMORY_SHARE:
        sharing = []
        if trainer_bytes:
            sharing.append(
                f"a trainer that keeps about {trainer_bytes / 2**30:.1f} GiB on it "
                f"({trainer_params / 1e6:,.0f}M parameters x {TRAINER_BYTES_PER_PARAM} bytes: "
                "float32 weights, gradients, AdamW moments"
                + (", half the rest kept for its activations)" if trainer_concurrent else ")")
            )
        if engines > 1:
            sharing.append(f"{engines} vLLM engines")
        raise ReplayRLError(
            f"The GPU ({gpu_bytes / 2**30:.0f} GiB) is shared by {' and '.join(sharing)}, which "
            f"leaves each vLLM engine {max(share, 0):.2f} of it, below {MIN_MEMORY_SHARE}. Use "
            "a GPU with more memory or more GPUs, train in processes of their own "
            "(train.distributed) or in pods of their own (kubernetes.layout: step), run fewer "
            "asynchronous workers per GPU, or set rollout.vllm_gpu_memory_utilization."
        )
    return share


def gpu_sharing_from_env(environ: Mapping[str, str] | None = None) -> tuple[int, bool] | None:
    """(vLLM engines on this process's GPU, whether a trainer trains on it beside them), as
    the asynchronous engine's supervisor sets them for each role it starts (`SHARING_ENV`,
    "<engines>,<0|1>"); None when nothing set them (the process is not such a role)."""
    value = (os.environ if environ is None else environ).get(SHARING_ENV)
    if not value:
        return None
    try:
        engines, trainer = value.split(",")
        return max(int(engines), 1), trainer.strip() == "1"
    except ValueError:
        raise ReplayRLError(
            f"{SHARING_ENV}={value!r} is not '<engines>,<0|1>' (the asynchronous engine sets it)."
        ) from None
