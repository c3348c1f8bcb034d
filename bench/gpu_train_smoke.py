"""Training steps at Qwen2.5-0.5B's shapes on whatever GPUs are visible (run by
bench/gpu_train_smoke.sh and bench/device_day.sh), with torch, transformers, accelerate and
safetensors only.

No vLLM, MLflow, deltalake, pyarrow or network: it runs from the repository's `src` (put on
sys.path here, for its spawned ranks too; nothing installed), so it checks the trainer on any
GPU machine, not only our image. The model is Qwen2.5-0.5B's architecture (24 layers, hidden
896, 14/2 heads, MLP 4864, vocabulary 151,936, tied embeddings) with random weights. The step
settings are the GPU preset's (configs/qwen2.5-0.5b-gsm8k.yaml, with this smoke's shapes as
overrides), resolved by `train_settings.step_settings` for CUDA as the engine's trainer
resolves them: bf16 autocast over float32 master weights, the preset's lr, clip, betas,
16,384-token micro-batches and 1,024-token log-prob chunks. A global batch is B = 64 rows of
a 64-token prompt and a completion of 128 to 512 tokens (random ids, behaviour log-probs near
the random policy's, advantages +-1), cut into contiguous shards for the ranks, shortest rows
first: the ranks' rows differ in length, so under their token budget they cut different
numbers of micro-batches, and `gradient_step` must pad the ranks with fewer (FSDP gathers and
reduces once per micro-batch on every rank; without the padding they hang).

Every step is `training.gradient_step`, the trainer's own (collate, micro-batch cut, chunked
loss, the replicas' clip on the global norm, the non-finite refusal, AdamW), on a table of
Python lists (`Rows`, since pyarrow is absent). Two phases, each timed after one warm-up
step:
- "one_gpu": the whole batch on cuda:0 (`training.OneProcess`, as `Trainer.train` steps);
- "fsdp": torch's FSDP2 over every visible GPU as the trainer shards the policy
  (`sharded.shard_policy`: each decoder layer, then the loss module, with the trainer's bf16
  `MixedPrecisionPolicy`; `distributed.join_group`'s process group), each rank on its shard
  of the same global batch; with one GPU, a group of one in this process.

Prints one JSON object (and writes it to --out, also when a phase raised): per phase, trained
tokens/s (all tokens of the padded micro-batches, and completion tokens), MFU (6 x parameters
x tokens per second, 8 x with activation checkpointing, over the GPU's dense bf16 peak;
attention's quadratic FLOPs left out), peak GPU memory (torch's allocator) of the forward and
backward (clip included) and of the optimizer step beside the memory plan's
(`memory_plan.plan` of the same config), and the peak the allocator reserved (it sets
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the variable is set, even empty), every step's global loss and gradient norm (the
warm-up's first), the floors and the checks below, each true or false. It exits 1, after the
JSON, when a check fails:
- `finite`: every loss and gradient norm is finite (`gradient_step` refused none);
- `fsdp_loss_matches_one_process`: the warm-up step's global loss under FSDP is within
  LOSS_ATOL of the one-process loss (same weights, same batch);
- `uneven_rows`: the rows' lengths differ (padding and masks are exercised), and, with two
  ranks or more, `ranks_cut_different_micro_batch_counts` (so the padding of item 5 ran);
- `bf16_policy`: the preset's settings resolve to bfloat16 for CUDA, and under FSDP the
  decoder layers ran on bf16 gathered weights with gradients reduced in float32 (the
  `MixedPrecisionPolicy` of `shard_policy`, read back);
- `loss_inputs_float32`: the loss module received float32 behaviour log-probs and
  advantages in both phases (a bf16 cast of -11.93 moves it by up to 0.03: 3 % on a ratio);
- on CUDA only (on the CPU the figures are recorded, and mean nothing): `mfu_floor` (each
  phase's MFU at least MFU_FLOOR, when the GPU's peak is known), `peak_memory_within_plan`
  (the forward/backward peak at most PLAN_MARGIN x the plan's training peak) and
  `peak_memory_holds_the_training_state` (the optimizer step's peak at least the 16 bytes
  per parameter / ranks of float32 weights, gradients and AdamW moments: a lower figure means
  the reading missed the device).
Exits 2 with one line, "gpu_train_smoke: <reason>", when its inputs are missing (no CUDA GPU,
torch < 2.11, transformers < 5.17, accelerate or safetensors missing, a trainer module that
does not import with these alone).

`--device cpu --tiny` runs the same code on the CPU (gloo, bf16 autocast on the CPU, tiny
shapes, two ranks by default: `--cpu-ranks`), in `make test`; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    # At import, so the ranks torch spawns (which import this file again) find it too.
    sys.path.insert(0, str(REPO / "src"))
PRESET = REPO / "configs" / "qwen2.5-0.5b-gsm8k.yaml"
# PyYAML reads the preset (transformers depends on it too).
MIN_VERSIONS = {
    "torch": (2, 11),
    "transformers": (5, 17),
    "accelerate": None,
    "safetensors": None,
    "PyYAML": None,
}
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
# Floors asserted on CUDA. MFU_FLOOR is an estimate, not yet a measurement of this trainer:
# bf16 training of ~0.5B models in transformers reaches roughly 10-20 % MFU on an H100, and
# float32 matmuls without TF32 (a lost autocast) cap it near 7 %; raise it to half the first
# figure a GPU day records (docs/results/LOG.md).
MFU_FLOOR = 0.05
# The memory plan's activation model is within 20 % of the real forward's saved tensors
# (bench/bench_memory_plan.py); a peak above the plan by more under-reserves every GPU plan.
PLAN_MARGIN = 1.2
# float32 weights, gradients and AdamW's two moments, resident at the optimizer step.
TRAINING_STATE_BYTES_PER_PARAM = 16
# Shapes of --tiny (a code check, not a measurement), for the flags not given.
TINY_SHAPES = {
    "batch_size": 8,
    "prompt_tokens": 8,
    "completion_tokens": 40,
    "micro_batch_tokens": 128,
    "logprob_chunk_tokens": 64,
}
# Without --tiny; micro-batch and log-prob chunk sizes are the preset's unless given.
FULL_SHAPES = {"batch_size": 64, "prompt_tokens": 64, "completion_tokens": 512}
GiB = 2**30


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
    import torch

    try:  # the trainer, its settings and the memory plan import with these alone
        import replayrl.policy.memory_plan  # noqa: F401
        import replayrl.policy.train_settings  # noqa: F401
        import replayrl.policy.training  # noqa: F401
    except ImportError as e:
        return (
            f"the trainer's modules do not import with torch, transformers, accelerate, "
            f"safetensors and PyYAML alone ({e})."
        )

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


def smoke_config(args, *, fsdp_ranks: int = 0):
    """The GPU preset with this smoke's shapes; `fsdp_ranks`: trained under FSDP on that many
    ranks (the memory plan differs, the step settings do not)."""
    from replayrl.config import load_config

    overrides = [
        # Nothing is generated here; and a one-rank FSDP group beside a vLLM engine in the
        # same process is refused at load.
        "rollout.backend=transformers",
        f"rollout.max_new_tokens={args.completion_tokens}",
        f"train.batch_size={args.batch_size}",
    ]
    for key in ("micro_batch_tokens", "logprob_chunk_tokens"):
        if getattr(args, key) is not None:
            overrides.append(f"train.{key}={getattr(args, key)}")
    if args.activation_checkpointing:
        overrides.append("train.activation_checkpointing=true")
    if fsdp_ranks:
        overrides += ["train.distributed=fsdp", f"train.num_processes={fsdp_ranks}"]
    return load_config(PRESET, overrides=overrides)


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

    def reserved(self) -> int:
        """Peak bytes the allocator held (what fragmentation and expandable segments move)."""
        import torch

        return int(torch.cuda.max_memory_reserved(self.device)) if self.cuda else 0


def model_config(*, tiny: bool = False):
    """Qwen2.5-0.5B's published configuration (`tiny`: the architecture at toy sizes)."""
    from transformers import Qwen2Config

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
    return Qwen2Config(**shape, eos_token_id=0, pad_token_id=0)


def build_model(device, *, tiny: bool = False):
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(model_config(tiny=tiny))
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
    """Rollout rows in the columns the trainer reads, held in Python lists: the methods of a
    pyarrow Table that `training.gradient_step` and `batching` call on a table that is not
    Arrow, so the trainer's own step runs here without pyarrow."""

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


def make_rows(*, rows: int, world: int, prompt: int, completion: int, vocab: int, seed: int):
    """One global batch of `rows` rows (random ids; behaviour log-probs near the random
    policy's, -log(vocab); advantages +-1) whose completions have uneven lengths, evenly
    spaced from `completion` // 4 to `completion`. In `world` contiguous shards
    (`distributed.shard_rows`), shard 0 holds the shortest rows and the last the longest,
    each in random order: the ranks' lengths differ, within a rank and across them."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    per = rows // world
    spaced = torch.linspace(max(completion // 4, 1), completion, rows).round().long()
    lengths = torch.cat(
        [spaced[r * per : (r + 1) * per][torch.randperm(per, generator=gen)] for r in range(world)]
    )
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


def run_steps(*, rank: int, world: int, args, settings, fsdp: bool) -> dict:
    """Warm-up plus `args.steps` timed `gradient_step`s on this rank's shard of the global
    batch; returns timings, peaks, losses and what the checks read (this rank's)."""
    import torch

    from replayrl.policy.batching import completion_token_count, micro_batches, row_lengths
    from replayrl.policy.distributed import shard_rows
    from replayrl.policy.loss_kernels import TokenPolicyLoss
    from replayrl.policy.training import (
        NonFiniteStepError,
        OneProcess,
        gradient_step,
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
    if fsdp:
        from replayrl.policy.sharded import shard_policy

        replicas = shard_policy(model, settings, device=device, world=world)
    else:  # what `gradient_step` builds for `Trainer.train`, held here to hook it
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
    optimizer = make_optimizer(
        model, lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas
    )
    # `gradient_step` clips, then steps AdamW: the split between its two timed parts.
    marks: dict[str, float] = {}

    def before_optimizer_step(_optimizer, _args, _kwargs):
        memory.sync()
        marks["t1"], marks["fb_peak"] = time.perf_counter(), memory.peak()
        marks["fb_reserved"] = memory.reserved()
        memory.reset()

    optimizer.register_step_pre_hook(before_optimizer_step)
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
    rows = shard_rows(global_rows, rank=rank, world_size=world)  # the trainer's cut
    lengths = row_lengths(rows)
    # The cut `gradient_step` makes (it pads every rank to the most any rank has).
    groups = micro_batches(
        lengths, max_rows=settings.micro_batch_size, max_tokens=settings.micro_batch_tokens
    )
    timed = {"forward_backward": 0.0, "optimizer": 0.0}
    peaks = {"forward_backward": 0, "optimizer": 0, "reserved": 0}
    losses, grad_norms, refused = [], [], None
    for step in range(args.steps + 1):
        memory.reset()
        t0 = time.perf_counter()
        try:
            stats = gradient_step(
                model=model,
                optimizer=optimizer,
                rows=rows,
                pad_id=model.config.pad_token_id,
                settings=settings,
                replicas=replicas,
                step=step + 1,
            )
        except NonFiniteStepError as e:  # global: every rank refuses the same step
            losses.append(float("nan"))
            grad_norms.append(float("nan"))
            refused = str(e)
            break
        memory.sync()
        t2 = time.perf_counter()
        losses.append(stats.loss)  # the global token-mean loss (every rank's the same)
        grad_norms.append(stats.grad_norm)
        if step == 0:
            continue  # warm-up: kernels chosen
        timed["forward_backward"] += marks["t1"] - t0
        timed["optimizer"] += t2 - marks["t1"]
        peaks["forward_backward"] = max(peaks["forward_backward"], marks["fb_peak"])
        peaks["optimizer"] = max(peaks["optimizer"], memory.peak())
        peaks["reserved"] = max(peaks["reserved"], marks["fb_reserved"], memory.reserved())
    timed_steps = max(len(losses) - 1, 0) if refused is None else 0
    padded = sum(len(idx) * int(lengths[idx].max()) for idx in groups)
    return {
        "parameters": num_params,
        "build_s": build_s,
        "build_peak": build_peak,
        "timed_steps": timed_steps,
        "seconds": timed,
        "peaks": peaks,
        "tokens": padded * timed_steps,
        "completion_tokens": completion_token_count(rows) * timed_steps,
        "micro_batches": len(groups),
        "losses": losses,
        "grad_norms": grad_norms,
        "refused": refused,
        "row_lengths": lengths.tolist(),
        "seen": seen,
        "mixed_precision": mixed_precision_of(replicas.module),
    }


def summarize(results: list[dict], *, world: int, args) -> dict:
    import torch

    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    steps = min(r["timed_steps"] for r in results)
    step_s = max(r["seconds"]["forward_backward"] + r["seconds"]["optimizer"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    completion = sum(r["completion_tokens"] for r in results)
    params = results[0]["parameters"]
    factor = 8 if args.activation_checkpointing else 6
    peak = peak_flops(name)
    achieved = factor * params * tokens / step_s if steps and step_s > 0 else None
    peak_bytes = {
        "build": max(r["build_peak"] for r in results),
        **{
            k: max(r["peaks"][k] for r in results)
            for k in ("forward_backward", "optimizer", "reserved")
        },
    }
    return {
        "gpus": world,
        "steps": steps,
        "micro_batches_per_rank": [r["micro_batches"] for r in results],
        "tokens_per_s": round(tokens / step_s, 1) if achieved else None,
        "completion_tokens_per_s": round(completion / step_s, 1) if achieved else None,
        "step_s": round(step_s / steps, 3) if steps else None,
        "mfu": None if peak is None or achieved is None else round(achieved / (peak * world), 4),
        "model_tflops_per_gpu": round(achieved / world / 1e12, 1) if achieved else None,
        "seconds": {
            k: round(max(r["seconds"][k] for r in results) / steps, 3) if steps else None
            for k in ("forward_backward", "optimizer")
        },
        "peak_bytes": peak_bytes,
        "peak_gib": {k: round(v / GiB, 2) for k, v in peak_bytes.items()},
        "build_s": round(max(r["build_s"] for r in results), 1),
        "parameters": params,
        # The global token-mean loss of each step, warm-up first (the loss of the initial
        # weights, which both phases share), and the global gradient norm before clipping.
        "losses": results[0]["losses"],
        "grad_norms": results[0]["grad_norms"],
        "refused": results[0]["refused"],
        "row_lengths_per_rank": [r["row_lengths"] for r in results],
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


def _fsdp_rank(rank: int, world: int, port: int, args, settings) -> dict:
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
        return run_steps(rank=rank, world=world, args=args, settings=settings, fsdp=True)
    finally:
        dist.destroy_process_group()


def _fsdp_worker(rank: int, world: int, port: int, args, settings, out: str) -> None:
    result = _fsdp_rank(rank, world, port, args, settings)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def fsdp_phase(world: int, args, settings) -> dict:
    """The FSDP phase on `world` ranks: one process each, or (one rank) in this process, as
    the trainer runs a group of one (`distributed.train_on_batches`)."""
    import torch.multiprocessing as mp

    from replayrl.policy.distributed import free_port

    if world == 1:
        return summarize([_fsdp_rank(0, 1, free_port(), args, settings)], world=1, args=args)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _fsdp_worker, args=(world, free_port(), args, settings, tmp), nprocs=world, join=True
        )
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
        return summarize(results, world=world, args=args)


def memory_planned(cfg, *, shape, prompt_tokens: int, gpu_bytes: int) -> dict:
    """The memory plan's training peak per GPU for `cfg` (`replayrl plan`'s figure)."""
    from replayrl.policy.memory_plan import plan

    first = plan(cfg, prompt_tokens=prompt_tokens, shape=shape, gpu_bytes=gpu_bytes).per_gpu[0]
    return {
        "training_peak_bytes": first.peak("training"),
        "items_gib": {i.name: round(i.bytes / GiB, 2) for i in first.phases["training"]},
    }


def floors(phase: dict, planned: dict) -> dict:
    """The phase's MFU and peaks against their floors (see the module docstring)."""
    peak = phase["peak_bytes"]
    state = TRAINING_STATE_BYTES_PER_PARAM * phase["parameters"] / phase["gpus"]
    return {
        "mfu": phase["mfu"],
        "mfu_min": MFU_FLOOR,
        "mfu_ok": None if phase["mfu"] is None else phase["mfu"] >= MFU_FLOOR,
        "forward_backward_peak_gib": round(peak["forward_backward"] / GiB, 2),
        "planned_training_peak_bytes": planned["training_peak_bytes"],
        "planned_training_peak_gib": round(planned["training_peak_bytes"] / GiB, 2),
        "peak_gib_max": round(PLAN_MARGIN * planned["training_peak_bytes"] / GiB, 2),
        "within_plan": peak["forward_backward"] <= PLAN_MARGIN * planned["training_peak_bytes"],
        "optimizer_peak_gib": round(peak["optimizer"] / GiB, 2),
        "peak_gib_min": round(state / GiB, 2),
        "holds_the_training_state": peak["optimizer"] >= state,
    }


def checks(result: dict, *, cuda: bool) -> dict[str, bool]:
    """The smoke's assertions (see the module docstring), each true or false."""
    one, fsdp = result["one_gpu"], result["fsdp"]
    values = [*one["losses"], *one["grad_norms"], *fsdp["losses"], *fsdp["grad_norms"]]
    lengths = [n for shard in fsdp["row_lengths_per_rank"] for n in shard]
    mp = fsdp["mixed_precision"] or {}
    out = {
        "finite": all(math.isfinite(v) for v in values),
        "fsdp_loss_matches_one_process": abs(fsdp["losses"][0] - one["losses"][0]) <= LOSS_ATOL,
        "uneven_rows": min(lengths) < max(lengths),
        "bf16_policy": result["settings"]["dtype"] == "bfloat16"
        and fsdp["layer_weight_dtype"] == "torch.bfloat16"
        and mp.get("param_dtype") == "torch.bfloat16"
        and mp.get("reduce_dtype") == "torch.float32",
        "loss_inputs_float32": all(
            phase["loss_input_dtypes"][key] == "torch.float32"
            for phase in (one, fsdp)
            for key in ("logp_behavior", "advantages")
        ),
    }
    if fsdp["gpus"] > 1:
        out["ranks_cut_different_micro_batch_counts"] = len(set(fsdp["micro_batches_per_rank"])) > 1
    if cuda:
        phases = [result["floors"][name] for name in ("one_gpu", "fsdp")]
        if all(f["mfu"] is not None for f in phases):
            out["mfu_floor"] = all(f["mfu_ok"] for f in phases)
        out["peak_memory_within_plan"] = all(f["within_plan"] for f in phases)
        out["peak_memory_holds_the_training_state"] = all(
            f["holds_the_training_state"] for f in phases
        )
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per phase")
    p.add_argument("--batch-size", type=int, help="B: rows per global batch (64)")
    p.add_argument("--prompt-tokens", type=int, help="(64)")
    p.add_argument("--completion-tokens", type=int, help="the longest completion (512)")
    p.add_argument("--micro-batch-tokens", type=int, help="(the preset's: 16,384)")
    p.add_argument("--logprob-chunk-tokens", type=int, help="(the preset's: 1,024)")
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


def _write(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


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

    from replayrl.errors import ReplayRLError
    from replayrl.policy.memory_plan import shape_from_hf_config
    from replayrl.policy.train_settings import step_settings

    cuda = args.device == "cuda"
    world = torch.cuda.device_count() if cuda else args.cpu_ranks
    args.ranks = world  # the FSDP phase's; the global batch is cut for them
    if world < 1 or args.batch_size % world:
        return fail(f"--batch-size {args.batch_size} must be a multiple of the {world} ranks.")
    try:
        cfg = smoke_config(args)
        # As the engine's trainer resolves them on a GPU: --device cpu runs these bf16
        # settings on the CPU (the engine itself would resolve float32 there).
        settings = step_settings(cfg, device="cuda")
    except ReplayRLError as e:
        return fail(f"the preset does not take this smoke's shapes: {e}")
    args.activation_checkpointing = cfg.train.activation_checkpointing
    shape = shape_from_hf_config(
        "tiny" if args.tiny else "qwen2.5-0.5b", model_config(tiny=args.tiny)
    )
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if cuda else 80 * GiB
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (code check only)",
        "visible_gpus": world,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "model": "Qwen2.5-0.5B architecture, random weights, float32 master weights, bf16 autocast",
        "settings_from": f"{PRESET.relative_to(REPO)} via train_settings.step_settings(cuda)",
        "settings": dataclasses.asdict(settings),
        "shapes": {
            "tiny": args.tiny,
            "batch_rows": args.batch_size,
            "prompt_tokens": args.prompt_tokens,
            "completion_tokens": args.completion_tokens,
            "micro_batch_tokens": settings.micro_batch_tokens,
            "logprob_chunk_tokens": settings.logprob_chunk_tokens,
            "activation_checkpointing": args.activation_checkpointing,
        },
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "memory_plan": {
            "one_gpu": memory_planned(
                cfg, shape=shape, prompt_tokens=args.prompt_tokens, gpu_bytes=gpu_bytes
            ),
            "fsdp": memory_planned(
                smoke_config(args, fsdp_ranks=world),
                shape=shape,
                prompt_tokens=args.prompt_tokens,
                gpu_bytes=gpu_bytes,
            ),
        },
    }
    try:
        result["one_gpu"] = summarize(
            [run_steps(rank=0, world=1, args=args, settings=settings, fsdp=False)],
            world=1,
            args=args,
        )
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        result["fsdp"] = fsdp_phase(world, args, settings)
    except Exception as e:  # noqa: BLE001 - recorded in the JSON, then exit 1
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
        result["ok"] = False
        _write(result, args.out)
        print(f"gpu_train_smoke: a phase raised {result['error']}", file=sys.stderr)
        return 1
    result["floors"] = {
        "asserted": cuda,
        **{name: floors(result[name], result["memory_plan"][name]) for name in ("one_gpu", "fsdp")},
    }
    result["checks"] = checks(result, cuda=cuda)
    result["ok"] = all(result["checks"].values())
    _write(result, args.out)
    if not result["ok"]:
        failed = ", ".join(k for k, v in result["checks"].items() if not v)
        print(f"gpu_train_smoke: check failed: {failed} (see the JSON).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
