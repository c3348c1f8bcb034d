"""Training steps at Qwen2.5-0.5B's shapes on whatever GPUs are visible (run by
bench/gpu_train_smoke.sh), with torch, transformers, accelerate and safetensors only.

No vLLM, MLflow, deltalake, pyarrow or network: it runs from the repository's `src` on
PYTHONPATH (nothing installed), so it can check the trainer on any GPU machine, not only our
image. The model is Qwen2.5-0.5B's architecture (24 layers, hidden 896, 14/2 heads, MLP 4864,
vocabulary 151,936, tied embeddings) with random weights; a global batch is B = 64 rows of a
64-token prompt and a 512-token completion (random ids, behaviour log-probs near the random
policy's, advantages +-1), cut into micro-batches of train.micro_batch_tokens (16,384 padded
tokens, the presets' default). Every micro-batch goes through the trainer's own loss
(`replayrl.policy.training.TokenPolicyLoss`: bf16 autocast with float32 master weights,
chunked float32 log-probs, GRPO's clipped ratio), then the gradient clip and AdamW.

Two phases, each timed after one warm-up step:
- "one_gpu": the whole batch on cuda:0;
- "fsdp": torch's FSDP2 (`fully_shard` per decoder layer, then the root) over every visible
  GPU, each rank taking B / world rows (skipped with one GPU: --fsdp-on-one to force it).

Prints one JSON object: per phase, trained tokens/s (all tokens of the padded micro-batches,
and completion tokens), MFU (6 x parameters x tokens per second, 8 x with activation
checkpointing, over the GPU's dense bf16 peak; attention's quadratic FLOPs left out), and
peak GPU memory (torch's allocator) of the forward/backward and of the optimizer step.
Exits 2 with one line, "gpu_train_smoke: <reason>", when its inputs are missing (no CUDA GPU,
torch < 2.11, transformers < 5.17, accelerate or safetensors missing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIN_VERSIONS = {"torch": (2, 11), "transformers": (5, 17), "accelerate": None, "safetensors": None}
# Dense bf16 peak FLOP/s by device name (vendor datasheets); MFU is null for others.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "A100": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
}


def fail(reason: str) -> int:
    print(f"gpu_train_smoke: {reason}", file=sys.stderr, flush=True)
    return 2


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_inputs() -> str | None:
    """Why this machine cannot run the smoke, or None. Imports the trainer's modules first,
    so a module that pulls in MLflow, deltalake, pyarrow or vLLM fails here, not on a GPU."""
    from importlib import metadata

    for name, minimum in MIN_VERSIONS.items():
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            return f"{name} is not installed; pip install '{name}' (see bench/gpu_train_smoke.sh)."
        if minimum and _version(found) < minimum:
            want = ".".join(map(str, minimum))
            return f"{name} {found} is older than the {want} this smoke needs."
    sys.path.insert(0, str(REPO / "src"))
    import torch

    import replayrl.policy.training  # noqa: F401 - the trainer imports with torch alone

    if not torch.cuda.is_available():
        return (
            f"no GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device; "
            "run it on a machine with an NVIDIA GPU and a CUDA build of torch."
        )
    return None


def peak_flops(name: str) -> float | None:
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


class _Memory:
    """Peak allocated bytes on a CUDA device (0 on the CPU, where --device cpu only checks
    that the code runs)."""

    def __init__(self, device):
        import torch

        self.device, self.cuda = device, device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(device)
        self.reset()

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        import torch

        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated(self.device)) if self.cuda else 0


def build_model(device, *, tiny: bool = False):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from replayrl.policy.memory_plan import published_config

    shape = published_config("qwen2.5-0.5b")
    if tiny:  # --tiny: a code check, not a measurement
        shape.update(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    config = Qwen2Config(**shape, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(torch.float32)


def make_batch(*, rows: int, prompt: int, completion: int, vocab: int, seed: int):
    """One global batch of tensors as `batching.collate` builds them (no padding needed: every
    row has the same length)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    length = prompt + completion
    ids = torch.randint(0, vocab, (rows, length), generator=gen)
    mask = torch.zeros((rows, length - 1))
    mask[:, prompt - 1 :] = 1.0
    # Near the random policy's log-prob of a token, -log(vocab): ratios start near 1.
    behavior = (
        torch.full((rows, length - 1), -math.log(vocab))
        + 0.05 * torch.randn((rows, length - 1), generator=gen)
    ) * mask
    advantages = torch.where(torch.rand(rows, generator=gen) < 0.5, -1.0, 1.0)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": mask,
        "logp_behavior": behavior,
        "advantages": advantages,
    }


def run_steps(*, rank: int, world: int, args, fsdp: bool) -> dict:
    """Warm-up plus `args.steps` timed optimizer steps on this rank's rows; returns timings and
    peaks (this rank's)."""
    import numpy as np
    import torch

    from replayrl.policy.training import (
        StepSettings,
        TokenPolicyLoss,
        make_optimizer,
        prepare_model,
    )

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    memory = _Memory(device)
    start = time.perf_counter()
    model = build_model(device, tiny=args.tiny)
    prepare_model(model, activation_checkpointing=args.activation_checkpointing)
    num_params = sum(p.numel() for p in model.parameters())
    settings = StepSettings(
        loss_name="grpo",
        clip_eps=0.2,
        is_cap=None,
        temperature=1.0,
        grad_clip=1.0,
        lr=1e-6,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        micro_batch_tokens=args.micro_batch_tokens,
        logprob_chunk_tokens=args.logprob_chunk_tokens,
        dtype="bfloat16",
    )
    module = TokenPolicyLoss(model, settings)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(module)
    optimizer = make_optimizer(module, lr=settings.lr, weight_decay=0.0, betas=settings.betas)
    build_s = time.perf_counter() - start
    build_peak = memory.peak()
    rows = args.batch_size // world
    batch = make_batch(
        rows=rows,
        prompt=args.prompt_tokens,
        completion=args.completion_tokens,
        vocab=model.config.vocab_size,
        seed=rank,
    )
    lengths = np.full(rows, args.prompt_tokens + args.completion_tokens)
    groups = micro_batches(lengths, max_tokens=settings.micro_batch_tokens)
    global_tokens = float(batch["completion_mask"].sum()) * world
    timed = {"forward_backward": 0.0, "optimizer": 0.0}
    peaks = {"forward_backward": 0, "optimizer": 0}
    losses = []
    for step in range(args.steps + 1):
        memory.reset()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for idx in groups:
            part = {k: v[torch.as_tensor(idx)].to(device) for k, v in batch.items()}
            loss, _ = module(part, global_tokens, float(world))
            loss.backward()
            total += float(loss.detach())
        memory.sync()
        t1 = time.perf_counter()
        fb_peak = memory.peak()
        memory.reset()
        torch.nn.utils.clip_grad_norm_(module.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        memory.sync()
        t2 = time.perf_counter()
        if step == 0:
            continue  # warm-up: kernels chosen, AdamW's state allocated
        timed["forward_backward"] += t1 - t0
        timed["optimizer"] += t2 - t1
        peaks["forward_backward"] = max(peaks["forward_backward"], fb_peak)
        peaks["optimizer"] = max(peaks["optimizer"], memory.peak())
        losses.append(total / world)
    tokens = int(batch["input_ids"].numel()) * args.steps
    completion = int(batch["completion_mask"].sum()) * args.steps
    return {
        "parameters": num_params,
        "build_s": build_s,
        "build_peak": build_peak,
        "seconds": timed,
        "peaks": peaks,
        "tokens": tokens,
        "completion_tokens": completion,
        "micro_batches": len(groups),
        "losses": losses,
    }


def summarize(results: list[dict], *, world: int, args) -> dict:
    import torch

    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    step_s = max(r["seconds"]["forward_backward"] + r["seconds"]["optimizer"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    completion = sum(r["completion_tokens"] for r in results)
    params = results[0]["parameters"]
    factor = 8 if args.activation_checkpointing else 6
    peak = peak_flops(name)
    achieved = factor * params * tokens / step_s
    gib = 2**30
    return {
        "gpus": world,
        "steps": args.steps,
        "micro_batches_per_rank": results[0]["micro_batches"],
        "tokens_per_s": round(tokens / step_s, 1),
        "completion_tokens_per_s": round(completion / step_s, 1),
        "step_s": round(step_s / args.steps, 3),
        "mfu": None if peak is None else round(achieved / (peak * world), 4),
        "model_tflops_per_gpu": round(achieved / world / 1e12, 1),
        "seconds": {
            k: round(max(r["seconds"][k] for r in results) / args.steps, 3)
            for k in ("forward_backward", "optimizer")
        },
        "peak_gib": {
            "build": round(max(r["build_peak"] for r in results) / gib, 2),
            **{
                k: round(max(r["peaks"][k] for r in results) / gib, 2)
                for k in ("forward_backward", "optimizer")
            },
        },
        "build_s": round(max(r["build_s"] for r in results), 1),
        # Rank 0's part of the global token-mean loss (the whole loss with one rank).
        "loss_rank0": [round(v, 5) for v in results[0]["losses"]],
    }


def _fsdp_worker(rank: int, world: int, port: int, args, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
        )
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = run_steps(rank=rank, world=world, args=args, fsdp=True)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def fsdp_phase(world: int, args) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "ranks.json")
        mp.spawn(_fsdp_worker, args=(world, port, args, out), nprocs=world, join=True)
        return summarize(json.loads(Path(out).read_text()), world=world, args=args)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per phase")
    p.add_argument("--batch-size", type=int, default=64, help="B: rows per global batch")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--completion-tokens", type=int, default=512)
    p.add_argument("--micro-batch-tokens", type=int, default=16_384)
    p.add_argument("--logprob-chunk-tokens", type=int, default=1024)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--fsdp-on-one", action="store_true", help="run the FSDP phase on one GPU too")
    p.add_argument("--out", help="also write the JSON here")
    # A check of this script's code on a machine without a GPU (gloo, tiny shapes, bf16
    # autocast on the CPU); its numbers mean nothing.
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cpu-ranks", type=int, default=2, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        return fail("--steps and --batch-size must be at least 1.")
    # Before CUDA starts: no vLLM engine shares this process, so large blocks may grow in place.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    reason = check_inputs()
    if reason and not (args.device == "cpu" and reason.startswith("no GPU")):
        return fail(reason)
    import torch
    import transformers

    cuda = args.device == "cuda"
    world = torch.cuda.device_count() if cuda else args.cpu_ranks
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (code check only)",
        "visible_gpus": world,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "model": "Qwen2.5-0.5B architecture, random weights, float32 master weights, bf16 autocast",
        "shapes": {
            "batch_rows": args.batch_size,
            "prompt_tokens": args.prompt_tokens,
            "completion_tokens": args.completion_tokens,
            "micro_batch_tokens": args.micro_batch_tokens,
            "logprob_chunk_tokens": args.logprob_chunk_tokens,
            "activation_checkpointing": args.activation_checkpointing,
        },
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    result["one_gpu"] = summarize(
        [run_steps(rank=0, world=1, args=args, fsdp=False)], world=1, args=args
    )
    if cuda:
        torch.cuda.empty_cache()
    if world > 1 or args.fsdp_on_one:
        result["fsdp"] = fsdp_phase(world, args)
    else:
        result["fsdp"] = None
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
    from replayrl.policy.batching import micro_batches
