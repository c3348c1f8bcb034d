"""Training steps at Qwen2.5-0.5B's shapes on whatever GPUs are visible (run by
bench/gpu_train_smoke.sh), with torch, transformers, accelerate and safetensors only.

No vLLM, MLflow, deltalake, pyarrow or network: it runs from the repository's `src` on
PYTHONPATH (nothing installed), so it can check the trainer on any GPU machine, not only our
image. The model is Qwen2.5-0.5B's architecture (24 layers, hidden 896, 14/2 heads, MLP 4864,
vocabulary 151,936, tied embeddings) with random weights; a global batch is B = 64 rows of a
64-token prompt and a completion of uneven length, up to 512 tokens (random ids, behaviour
log-probs near the random policy's, advantages +-1). Every rank's shard holds the same
lengths in another order, so the ranks cut the same number of micro-batches (FSDP gathers and
reduces once per micro-batch on every rank). A step runs as `training.gradient_step` runs one,
with the trainer's own pieces: the rows padded by `batching.collate`, cut by
`batching.micro_batches` at train.micro_batch_tokens (16,384 padded tokens, the presets'
default), each micro-batch through `training.TokenPolicyLoss` (bf16 autocast with float32
master weights, chunked float32 log-probs, GRPO's clipped ratio), the replicas' gradient clip
on the global norm, then AdamW. (The step itself takes Arrow tables, which this smoke cannot
import; its loop is `accumulate_gradients`' and `gradient_step`'s, line for line.)

Two phases, each timed after one warm-up step:
- "one_gpu": the whole batch on cuda:0 (`training.OneProcess`);
- "fsdp": torch's FSDP2 over every visible GPU as the trainer shards the policy
  (`sharded.shard_policy`: each decoder layer, then the loss module, with the trainer's bf16
  `MixedPrecisionPolicy`; `distributed.join_group`'s process group), each rank taking its
  contiguous shard of the same global batch; with one GPU, a group of one.

Prints one JSON object: per phase, trained tokens/s (all tokens of the padded micro-batches,
and completion tokens), MFU (6 x parameters x tokens per second, 8 x with activation
checkpointing, over the GPU's dense bf16 peak; attention's quadratic FLOPs left out), peak GPU
memory (torch's allocator) of the forward/backward and of the optimizer step, every step's
global loss and gradient norm (the warm-up's first), and the checks below, each true or false.
It exits 1, after the JSON, when a check fails:
- `finite`: every loss and gradient norm is finite;
- `fsdp_loss_matches_one_process`: the warm-up step's global loss under FSDP (the sum of the
  ranks' shares) is within LOSS_ATOL of the one-process loss (same weights, same batch);
- `uneven_rows`: the rows' lengths differ (padding and masks are exercised);
- `same_micro_batches_on_every_rank`: checked before the first step, so a mismatch stops
  the ranks with an error instead of a hang;
- `bf16_policy`: under FSDP the decoder layers ran on bf16 gathered weights and gradients
  are reduced in float32 (the `MixedPrecisionPolicy` of `shard_policy`, read back);
- `loss_inputs_float32`: the loss module received float32 behaviour log-probs and
  advantages in both phases (a bf16 cast of -11.93 moves it by up to 0.03: 3 % on a ratio).
Exits 2 with one line, "gpu_train_smoke: <reason>", when its inputs are missing (no CUDA GPU,
torch < 2.11, transformers < 5.17, accelerate or safetensors missing, a trainer module that
does not import with these alone).

`--device cpu --tiny` runs the same code on the CPU (gloo, bf16 autocast on the CPU, tiny
shapes, two ranks by default: `--cpu-ranks`), in `make test`; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
# FSDP's loss against one process's on the same batch and weights (issue 36, item 13).
LOSS_ATOL = 1e-3
# Shapes of --tiny (a code check, not a measurement), for the flags not given.
TINY_SHAPES = {
    "batch_size": 8,
    "prompt_tokens": 8,
    "completion_tokens": 40,
    "micro_batch_tokens": 128,
    "logprob_chunk_tokens": 64,
}
FULL_SHAPES = {
    "batch_size": 64,
    "prompt_tokens": 64,
    "completion_tokens": 512,
    "micro_batch_tokens": 16_384,
    "logprob_chunk_tokens": 1024,
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


def check_inputs(device: str = "cuda") -> str | None:
    """Why this machine cannot run the smoke on `device`, or None. Imports the trainer's
    modules first, so a module that pulls in MLflow, deltalake, pyarrow or vLLM fails here,
    not on a GPU, after minutes."""
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

    if device == "cuda" and not torch.cuda.is_available():
        return (
            f"no GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device; "
            "run it on a machine with an NVIDIA GPU and a CUDA build of torch."
        )
    try:
        import replayrl.policy.sharded  # noqa: F401 - the FSDP phase's
    except ImportError as e:
        return (
            f"the FSDP phase's replayrl.policy.sharded does not import with torch, "
            f"transformers, accelerate and safetensors alone ({e})."
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


class _Column:
    def __init__(self, values: list):
        self.values = values

    def to_pylist(self) -> list:
        return list(self.values)

    def to_numpy(self, zero_copy_only: bool = True):
        import numpy as np

        return np.asarray(self.values)


class Rows:
    """Rollout rows in the columns `batching.collate` reads, held in Python lists: the few
    methods of a pyarrow Table that collate calls, so the trainer's own padding runs here
    without pyarrow."""

    def __init__(self, columns: dict[str, list]):
        self.columns = columns

    @property
    def num_rows(self) -> int:
        return len(self.columns["advantage"])

    def column(self, name: str) -> _Column:
        return _Column(self.columns[name])

    def take(self, indices) -> Rows:
        idx = [int(i) for i in indices]
        return Rows({k: [v[i] for i in idx] for k, v in self.columns.items()})

    def slice(self, offset: int, length: int) -> Rows:
        return Rows({k: v[offset : offset + length] for k, v in self.columns.items()})

    def lengths(self):
        """Tokens per row (prompt + completion), as `batching.row_lengths`."""
        import numpy as np

        return np.asarray(
            [
                len(p) + len(c)
                for p, c in zip(
                    self.columns["prompt_token_ids"],
                    self.columns["completion_token_ids"],
                    strict=True,
                )
            ],
            dtype=np.int64,
        )

    def completion_tokens(self) -> int:
        """`batching.completion_token_count`."""
        return sum(len(c) for c in self.columns["completion_token_ids"])


def make_rows(*, rows: int, world: int, prompt: int, completion: int, vocab: int, seed: int):
    """One global batch of `rows` rows (random ids; behaviour log-probs near the random
    policy's, -log(vocab); advantages +-1), whose completions have uneven lengths, from
    `completion` // 2 to `completion`. Split into `world` contiguous shards (`shard_rows`),
    every shard holds the same lengths in another order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    per = rows // world
    pattern = torch.linspace(max(completion // 2, 1), completion, per).round().long()
    lengths = torch.cat([pattern[torch.randperm(per, generator=gen)] for _ in range(world)])
    columns: dict[str, list] = {
        "prompt_token_ids": [],
        "completion_token_ids": [],
        "behavior_logprobs": [],
        "advantage": [],
        "reward": [],
    }
    for n in lengths.tolist():
        columns["prompt_token_ids"].append(
            torch.randint(0, vocab, (prompt,), generator=gen).tolist()
        )
        columns["completion_token_ids"].append(
            torch.randint(0, vocab, (n,), generator=gen).tolist()
        )
        behavior = -math.log(vocab) + 0.05 * torch.randn(n, generator=gen)
        columns["behavior_logprobs"].append(behavior.tolist())
        sign = -1.0 if float(torch.rand((), generator=gen)) < 0.5 else 1.0
        columns["advantage"].append(sign)
        columns["reward"].append(max(sign, 0.0))
    return Rows(columns)


def _shard(rows: Rows, *, rank: int, world: int) -> Rows:
    """`distributed.shard_rows` (without its pyarrow import)."""
    size, extra = divmod(rows.num_rows, world)
    return rows.slice(rank * size + min(rank, extra), size + (rank < extra))


def _dtype_name(value) -> str | None:
    return None if value is None else str(value)


def mixed_precision_of(module) -> dict | None:
    """The `MixedPrecisionPolicy` FSDP2 holds for `module` (a `fully_shard`ed module), read
    back from its state; None when it is not sharded."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    policy = get_state()._mp_policy
    return {
        "param_dtype": _dtype_name(policy.param_dtype),
        "reduce_dtype": _dtype_name(policy.reduce_dtype),
        "output_dtype": _dtype_name(policy.output_dtype),
        "cast_forward_inputs": bool(policy.cast_forward_inputs),
    }


def run_steps(*, rank: int, world: int, args, fsdp: bool) -> dict:
    """Warm-up plus `args.steps` timed optimizer steps on this rank's shard of the global
    batch; returns timings, peaks, losses and what the checks read (this rank's)."""
    import torch

    from replayrl.policy.batching import collate, micro_batches
    from replayrl.policy.training import (
        OneProcess,
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
    if fsdp:
        from replayrl.policy.sharded import shard_policy

        replicas = shard_policy(model, settings, device=device, world=world)
    else:
        replicas = OneProcess(TokenPolicyLoss(model, settings))
    # What the loss module and a decoder layer really receive, after FSDP's own hooks
    # (registered first, prepended): the loss inputs' dtypes, the gathered weights' dtype.
    seen: dict[str, str] = {}

    def loss_inputs(_module, args_, kwargs):
        batch = args_[0] if args_ else kwargs["batch"]
        for key in ("logp_behavior", "advantages"):
            seen[key] = str(batch[key].dtype)

    def layer_weights(module, _args):
        seen["layer_weight"] = str(next(module.parameters()).dtype)

    replicas.module.register_forward_pre_hook(loss_inputs, with_kwargs=True)
    model.model.layers[0].register_forward_pre_hook(layer_weights)
    optimizer = make_optimizer(model, lr=settings.lr, weight_decay=0.0, betas=settings.betas)
    build_s = time.perf_counter() - start
    build_peak = memory.peak()
    # The same global batch in both phases: cut for the FSDP phase's ranks.
    global_rows = make_rows(
        rows=args.batch_size,
        world=args.ranks,
        prompt=args.prompt_tokens,
        completion=args.completion_tokens,
        vocab=model.config.vocab_size,
        seed=0,
    )
    rows = _shard(global_rows, rank=rank, world=world)
    pad_id = model.config.pad_token_id
    groups = micro_batches(
        rows.lengths(), max_rows=settings.micro_batch_size, max_tokens=settings.micro_batch_tokens
    )
    counts = _agree(len(groups), world)
    if len(set(counts)) != 1:
        # FSDP all-gathers and reduce-scatters per micro-batch: different counts would hang.
        raise RuntimeError(f"ranks cut different numbers of micro-batches: {counts}")
    global_tokens = float(global_rows.completion_tokens())
    timed = {"forward_backward": 0.0, "optimizer": 0.0}
    peaks = {"forward_backward": 0, "optimizer": 0}
    losses, grad_norms = [], []
    for step in range(args.steps + 1):
        memory.reset()
        t0 = time.perf_counter()
        # `training.gradient_step` and `accumulate_gradients`, without the Arrow table.
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for k, idx in enumerate(groups):
            batch = {key: v.to(device) for key, v in collate(rows.take(idx), pad_id=pad_id).items()}
            last = k == len(groups) - 1
            with replicas.no_sync() if not last else _nullcontext():
                loss, _ = replicas.module(batch, global_tokens, float(world))
                loss.backward()
            total += float(loss.detach())
        memory.sync()
        t1 = time.perf_counter()
        fb_peak = memory.peak()
        memory.reset()
        params = [p for p in model.parameters() if p.grad is not None]
        grad_norm = replicas.clip_grad_norm(params, settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        memory.sync()
        t2 = time.perf_counter()
        losses.append(total / world)  # this rank's share of the global token-mean loss
        grad_norms.append(float(grad_norm))
        if step == 0:
            continue  # warm-up: kernels chosen, AdamW's state allocated
        timed["forward_backward"] += t1 - t0
        timed["optimizer"] += t2 - t1
        peaks["forward_backward"] = max(peaks["forward_backward"], fb_peak)
        peaks["optimizer"] = max(peaks["optimizer"], memory.peak())
    padded = sum(len(idx) * int(rows.lengths()[idx].max()) for idx in groups)
    return {
        "parameters": num_params,
        "build_s": build_s,
        "build_peak": build_peak,
        "seconds": timed,
        "peaks": peaks,
        "tokens": padded * args.steps,
        "completion_tokens": rows.completion_tokens() * args.steps,
        "micro_batches": len(groups),
        "losses": losses,
        "grad_norms": grad_norms,
        "row_lengths": rows.lengths().tolist(),
        "seen": seen,
        "mixed_precision": mixed_precision_of(replicas.module),
    }


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def _agree(value: int, world: int) -> list[int]:
    """`value` of every rank (this one alone without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, value)
    return gathered


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
        # The global token-mean loss of each step (the ranks' shares summed), warm-up first:
        # the loss of the initial weights, which both phases share.
        "losses": [sum(step) for step in zip(*(r["losses"] for r in results), strict=True)],
        # Global already (clipping reads the global norm).
        "grad_norms": results[0]["grad_norms"],
        # What every rank's loss module and first decoder layer received.
        "loss_input_dtypes": {
            key: sorted({r["seen"].get(key) for r in results})[0]
            if len({r["seen"].get(key) for r in results}) == 1
            else "ranks differ"
            for key in ("logp_behavior", "advantages")
        },
        "layer_weight_dtype": results[0]["seen"].get("layer_weight"),
        "mixed_precision": results[0]["mixed_precision"],
    }


def _fsdp_rank(rank: int, world: int, port: int, args) -> dict:
    """Rank `rank` of the FSDP phase: join the trainer's process group, step, leave."""
    import torch
    import torch.distributed as dist

    from replayrl.policy.distributed import join_group

    if args.device == "cpu" and world > 1:
        # Ranks share the cores; without a cap each would start one thread per core.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    join_group(rank=rank, world=world, port=port, gpu=args.device == "cuda")
    try:
        return run_steps(rank=rank, world=world, args=args, fsdp=True)
    finally:
        dist.destroy_process_group()


def _fsdp_worker(rank: int, world: int, port: int, args, out: str) -> None:
    result = _fsdp_rank(rank, world, port, args)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def fsdp_phase(world: int, args) -> dict:
    """The FSDP phase on `world` ranks: one process each, or (one rank) in this process, as
    the trainer runs a group of one (`distributed.train_on_batches`)."""
    import torch.multiprocessing as mp

    from replayrl.policy.distributed import free_port

    if world == 1:
        return summarize([_fsdp_rank(0, 1, free_port(), args)], world=1, args=args)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_fsdp_worker, args=(world, free_port(), args, tmp), nprocs=world, join=True)
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
        return summarize(results, world=world, args=args)


def checks(result: dict, lengths: list[int]) -> dict[str, bool]:
    """The smoke's assertions (see the module docstring), each true or false."""
    one, fsdp = result["one_gpu"], result["fsdp"]
    values = [*one["losses"], *one["grad_norms"], *fsdp["losses"], *fsdp["grad_norms"]]
    mp = fsdp["mixed_precision"] or {}
    return {
        "finite": all(math.isfinite(v) for v in values),
        "fsdp_loss_matches_one_process": abs(fsdp["losses"][0] - one["losses"][0]) <= LOSS_ATOL,
        "uneven_rows": min(lengths) < max(lengths),
        # Checked by every rank before its first step (a mismatch raised there).
        "same_micro_batches_on_every_rank": True,
        "bf16_policy": fsdp["layer_weight_dtype"] == "torch.bfloat16"
        and mp.get("param_dtype") == "torch.bfloat16"
        and mp.get("reduce_dtype") == "torch.float32",
        "loss_inputs_float32": all(
            phase["loss_input_dtypes"][key] == "torch.float32"
            for phase in (one, fsdp)
            for key in ("logp_behavior", "advantages")
        ),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per phase")
    p.add_argument("--batch-size", type=int, help="B: rows per global batch (64)")
    p.add_argument("--prompt-tokens", type=int, help="(64)")
    p.add_argument("--completion-tokens", type=int, help="the longest completion (512)")
    p.add_argument("--micro-batch-tokens", type=int, help="(16,384)")
    p.add_argument("--logprob-chunk-tokens", type=int, help="(1,024)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--out", help="also write the JSON here")
    # The same code on a machine without a GPU (gloo, tiny shapes, bf16 autocast on the
    # CPU): `make test` runs it; its numbers mean nothing.
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a code check")
    p.add_argument("--cpu-ranks", type=int, default=2, help="FSDP ranks with --device cpu")
    args = p.parse_args(argv)
    for key, value in (TINY_SHAPES if args.tiny else FULL_SHAPES).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        return fail("--steps and --batch-size must be at least 1.")
    # Before CUDA starts: no vLLM engine shares this process, so large blocks may grow in place.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    reason = check_inputs(args.device)
    if reason:
        return fail(reason)
    import torch
    import transformers

    cuda = args.device == "cuda"
    world = torch.cuda.device_count() if cuda else args.cpu_ranks
    args.ranks = world  # the FSDP phase's; the global batch is cut for them
    if world < 1 or args.batch_size % world:
        return fail(f"--batch-size {args.batch_size} must be a multiple of the {world} ranks.")
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (code check only)",
        "visible_gpus": world,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "model": "Qwen2.5-0.5B architecture, random weights, float32 master weights, bf16 autocast",
        "shapes": {
            "tiny": args.tiny,
            "batch_rows": args.batch_size,
            "prompt_tokens": args.prompt_tokens,
            "completion_tokens": args.completion_tokens,
            "micro_batch_tokens": args.micro_batch_tokens,
            "logprob_chunk_tokens": args.logprob_chunk_tokens,
            "activation_checkpointing": args.activation_checkpointing,
        },
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    one = run_steps(rank=0, world=1, args=args, fsdp=False)
    result["shapes"]["row_lengths"] = one["row_lengths"]
    result["one_gpu"] = summarize([one], world=1, args=args)
    if cuda:
        torch.cuda.empty_cache()
    result["fsdp"] = fsdp_phase(world, args)
    result["checks"] = checks(result, one["row_lengths"])
    result["ok"] = all(result["checks"].values())
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if not result["ok"]:
        failed = ", ".join(k for k, v in result["checks"].items() if not v)
        print(f"gpu_train_smoke: check failed: {failed} (see the JSON).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
