"""Gradient steps on batches of stored rollouts, at any model shape.

Turns rows of the buffer (prompt ids, completion ids, behaviour log-probs, fixed
advantages) into padded tensors, runs the policy forward and applies the loss from
`losses`. Knows nothing about where the rows or checkpoints live.

This module is the step: its settings and stats, the micro-batches and their gradient
accumulation, the replicas a step runs on, and the optimizer. The model's forward as a
policy loss, chunk by chunk (`TokenPolicyLoss`, `ChunkedPolicyLoss`, `chunked_logprobs`,
`completion_logprobs`, `output_layer`), is `replayrl.policy.loss_kernels`.

Memory grows with the micro-batch and the log-prob chunk, never with the batch or with
rows x tokens x vocabulary:

- **Micro-batches.** A step's B rows are cut into micro-batches of at most
  `micro_batch_size` rows and `micro_batch_tokens` padded tokens (rows sorted by length, so
  little is padding). Each micro-batch's loss is its sum over completion tokens divided by
  the token count of the *whole* batch, so the accumulated gradient is exactly the
  full-batch token mean's (float summation order aside), whatever the cut.
- **Log-probs without full logits.** The model runs up to its last hidden state; the
  output projection, log-softmax, loss and their gradient are computed for chunks of
  `logprob_chunk_tokens` completion tokens at a time (`loss_kernels.ChunkedPolicyLoss`).
  Prompt and padding positions never get logits. A chunk's logits live only while its own
  gradient is taken: peak extra memory is one chunk x vocabulary x 4 bytes (~0.6 GB for
  1024 tokens of Qwen2.5's 151,936), and nothing is recomputed.
- **Mixed precision** (`dtype="bfloat16"`, GPU only): the forward runs under bf16 autocast
  (TF32 matmuls elsewhere); weights, gradients and AdamW moments stay float32, and the
  log-softmax is always float32. Activation checkpointing (`prepare_model`) trades one
  more forward for activations of a single layer.

The host does not wait for the device inside a step: each chunk's loss, clipped tokens and
ratio sum stay tensors on the device (added up in float64) until the step's last
micro-batch is queued, then one transfer reads them (the gradient norm is the step's other
read, needed before the optimizer steps). Selecting a micro-batch's completion tokens with
its mask still reads their count on the host, once per micro-batch, after its decoder
forward is queued. Micro-batches reach a GPU from pinned host memory without blocking
(`batching.collate`), and AdamW is fused on CUDA (`make_optimizer`).

For a GPU day (it cannot be checked on a CPU): torch's allocator option
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` grows segments in place instead of
fragmenting them, which can lower the trainer's peak between micro-batches of different
lengths. replayrl does not set it. vLLM's sleep-mode pool is incompatible with it, but
vLLM 0.33 turns it off around its own allocations and back on after
(vllm/device_allocator/cumem.py, `use_memory_pool`, lines 382-394), so a trainer and a
sleeping engine can share a process with it on. What to check there: the engine still
sleeps and wakes with it set, and the trainer's peak memory
(`torch.cuda.max_memory_reserved`) over a step of uneven rows, with and without it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from replayrl.errors import ReplayRLError
from replayrl.policy.batching import collate, completion_token_count, micro_batches, row_lengths
from replayrl.policy.loss_kernels import TokenPolicyLoss, output_layer

if TYPE_CHECKING:
    # Rows arrive as Arrow tables; pyarrow itself is imported where a function needs it, so
    # the trainer imports without it (bench/gpu_train_smoke.py runs it with torch alone).
    import pyarrow as pa

DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class StepSettings:
    """What one gradient step needs besides the model, the optimizer and the rows."""

    loss_name: str
    clip_eps: float
    is_cap: float | None
    temperature: float  # the sampling temperature the behaviour log-probs were taken at
    grad_clip: float  # 0 = off
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    micro_batch_size: int = 0  # rows per micro-batch; 0 = no row limit
    micro_batch_tokens: int = 0  # padded tokens (rows x longest row) per micro-batch; 0 = none
    logprob_chunk_tokens: int = 1024  # completion tokens whose logits exist at once
    dtype: str = "float32"  # "float32" or "bfloat16" (autocast on CUDA; master weights f32)


@dataclass(frozen=True)
class StepStats:
    loss: float
    clip_fraction: float
    mean_ratio: float
    grad_norm: float
    num_tokens: int
    mean_advantage: float
    mean_reward: float


class NonFiniteStepError(ReplayRLError):
    """A gradient step whose loss or gradient norm is NaN or infinite. It is refused before
    the optimizer step: the weights and the optimizer state are as they were before it, and
    its gradients are dropped. `iteration` and `step` (1-based, within the iteration) say
    where, when the caller knows; `at()` adds them."""

    def __init__(
        self, *, what: str, value: float, iteration: int | None = None, step: int | None = None
    ):
        self.what, self.value, self.iteration, self.step = what, value, iteration, step
        where = ", ".join(
            part
            for part in (
                f"iteration {iteration}" if iteration is not None else "",
                f"gradient step {step}" if step is not None else "",
            )
            if part
        )
        super().__init__(
            f"{where or 'A gradient step'}: the {what} is {value}, so the step was not applied "
            "(weights and optimizer state unchanged, nothing committed). Lower train.lr, keep "
            "train.grad_clip > 0, or look for NaN/inf log-probs or advantages in the rows; "
            "re-running resumes from the last checkpoint."
        )

    def at(self, *, iteration: int | None = None, step: int | None = None) -> NonFiniteStepError:
        """The same error, naming `iteration` and `step` where it did not yet."""
        return NonFiniteStepError(
            what=self.what,
            value=self.value,
            iteration=self.iteration if iteration is None else iteration,
            step=self.step if step is None else step,
        )


def resolve_dtype(dtype: str, device: str) -> str:
    """The compute dtype of training: "auto" is bfloat16 on CUDA and float32 on the CPU.

    bfloat16 on the CPU is refused: the CPU path stays float32 (the reference the GPU path
    is checked against).
    """
    if dtype not in DTYPES:
        raise ReplayRLError(f"train.dtype must be one of {', '.join(DTYPES)}; got '{dtype}'.")
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    if dtype == "bfloat16" and device != "cuda":
        raise ReplayRLError(
            "train.dtype=bfloat16 needs a CUDA GPU, and this process has none; "
            "use train.dtype=auto (float32 on the CPU) or float32."
        )
    return dtype


def prepare_model(model: torch.nn.Module, *, activation_checkpointing: bool = False) -> None:
    """Set a policy up for training: no KV cache, TF32 matmuls on CUDA, and optionally
    activation checkpointing (each decoder layer's activations are recomputed in backward
    instead of kept: roughly 1/3 more compute for far less memory at long sequences)."""
    output_layer(model)  # fail now, not at the first step, on an unsupported model
    model.config.use_cache = False
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def accumulate_gradients(
    *,
    model: torch.nn.Module,
    rows: pa.Table,
    pad_id: int,
    settings: StepSettings,
    denominator: float | None = None,
    scale: float = 1.0,
    no_sync=None,
    groups: list[np.ndarray] | None = None,
    num_micro_batches: int | None = None,
) -> tuple[float, np.ndarray]:
    """Backward of the token-mean policy loss of `rows`, micro-batch by micro-batch, adding
    into the parameters' `.grad`. Returns (loss, sums = [clipped tokens, ratio sum, tokens]).

    `model` is a `TokenPolicyLoss` or a wrapper of one (DDP). `denominator` is the token
    count the loss is a mean over (default: the completion tokens of `rows`; a distributed
    rank passes the global batch's), `scale` multiplies it (a rank passes the world size,
    which DDP's gradient average divides away). `no_sync()` (DDP's, or a `Replicas`') is
    entered for all micro-batches but the last, so gradients are all-reduced once per step.
    `groups`: the micro-batches' row indices (default: `micro_batches` of `rows`).

    `num_micro_batches` (the most any replica has, `gradient_step`) pads this replica's
    micro-batches with passes that add nothing (its first row again, its loss scaled by 0):
    FSDP all-gathers in every forward and reduce-scatters in every backward, so a replica
    with fewer micro-batches than another would leave that one waiting for ever.
    """
    if denominator is None:
        denominator = completion_token_count(rows)
    denominator = max(float(denominator), 1.0)
    device = next(model.parameters()).device
    if groups is None:
        groups = micro_batches(
            row_lengths(rows),
            max_rows=settings.micro_batch_size,
            max_tokens=settings.micro_batch_tokens,
        )
    real = len(groups)
    if num_micro_batches is not None and num_micro_batches > real:
        if not real:
            raise ValueError("a replica without rows cannot take part in a gradient step")
        groups = [*groups, *[groups[0][:1]] * (num_micro_batches - real)]
    # [loss, clipped tokens, ratio sum, tokens], float64 on the device until the last
    # micro-batch is queued: one host sync per step, not one per micro-batch.
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    model.train()
    for k, idx in enumerate(groups):
        batch = collate(rows.take(idx), pad_id=pad_id, device=device)
        last = k == len(groups) - 1
        padding = k >= real
        with no_sync() if (no_sync is not None and not last) else contextlib.nullcontext():
            loss, part = model(batch, denominator, 0.0 if padding else scale)
            loss.backward()
        if not padding:
            totals[0] += loss.detach().double()
            totals[1:] += part
    total, *sums = totals.tolist()
    return total, np.asarray(sums, dtype=np.float64)


class Replicas(Protocol):
    """The copies of the policy a `gradient_step` runs on, each on its own shard of the
    global batch, and how they agree. `OneProcess` is this process alone;
    `replicas.DataParallel` is one DistributedDataParallel replica per process (accelerate's
    workers, the asynchronous engine's trainer group)."""

    module: torch.nn.Module  # this replica's `TokenPolicyLoss`, or its wrapper (DDP)
    world: int  # replicas in all

    def all_sum(self, values: list[float]) -> list[float]:
        """Elementwise sums of `values` over all replicas (float64, so counts stay exact)."""
        ...

    def all_max(self, value: int) -> int:
        """The largest `value` over all replicas."""
        ...

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Entered for every micro-batch but the last, so gradients are all-reduced once a
        step."""
        ...

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Clip the (synchronised) gradients of `params` to a global norm of `max_norm`
        (inf: only measure it); returns the global norm before clipping."""
        ...


class OneProcess:
    """`Replicas` of one: this process steps on the whole batch."""

    world = 1

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def all_sum(self, values: list[float]) -> list[float]:
        return [float(v) for v in values]

    def all_max(self, value: int) -> int:
        return int(value)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        if math.isinf(max_norm):
            if not params:
                return 0.0
            return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def gradient_step(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: pa.Table,
    pad_id: int,
    settings: StepSettings,
    replicas: Replicas | None = None,
    step: int | None = None,
) -> StepStats:
    """One optimizer step of the policy `model` on the token-mean policy loss of a global
    batch (micro-batched, chunked log-probs; see the module docstring). Stats are global.

    A loss or gradient norm that is NaN or infinite raises `NonFiniteStepError` (naming
    `step`, when given) before the optimizer steps: nothing of the step reaches the weights
    or the optimizer state. Both are global (summed over the replicas), so every replica
    refuses the same step.

    Alone (`replicas` None), `rows` is the whole batch. With `replicas` (whose `module`
    wraps `model`), `rows` is this replica's shard of it: each replica divides its token sum
    by the *global* token count and multiplies it by the world size, so the replicas'
    averaged gradient (DDP's) is the one-process gradient of the whole batch (up to float
    summation order), and clipping sees the global norm.
    """
    if replicas is None:
        replicas = OneProcess(TokenPolicyLoss(model, settings))
    (global_tokens,) = replicas.all_sum([completion_token_count(rows)])
    groups = micro_batches(
        row_lengths(rows),
        max_rows=settings.micro_batch_size,
        max_tokens=settings.micro_batch_tokens,
    )
    optimizer.zero_grad(set_to_none=True)
    loss, sums = accumulate_gradients(
        model=replicas.module,
        rows=rows,
        pad_id=pad_id,
        settings=settings,
        denominator=global_tokens,
        scale=replicas.world,
        no_sync=replicas.no_sync,
        groups=groups,
        # Micro-batches are cut per replica by its own rows' lengths: every replica runs
        # as many passes as the one with the most (see `accumulate_gradients`).
        num_micro_batches=replicas.all_max(len(groups)),
    )
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = settings.grad_clip if settings.grad_clip > 0 else math.inf  # inf: measure only
    grad_norm = replicas.clip_grad_norm(params, max_norm)
    stats = step_stats(replicas, rows, loss=loss, sums=sums, grad_norm=grad_norm)
    for what, value in (("loss", stats.loss), ("gradient norm", stats.grad_norm)):
        if not math.isfinite(value):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteStepError(what=what, value=value, step=step)
    optimizer.step()
    # The gradients' memory is better spent on the next generation's KV cache.
    optimizer.zero_grad(set_to_none=True)
    return stats


def step_stats(
    replicas: Replicas, rows: pa.Table, *, loss: float, sums, grad_norm: float
) -> StepStats:
    """The global batch's StepStats from this replica's shard `rows`, its loss and its
    summed [clipped tokens, ratio sum, tokens]."""
    rewards = rows.column("reward").to_numpy(zero_copy_only=False)
    advantages = rows.column("advantage").to_numpy(zero_copy_only=False)
    # Each replica's loss is scaled by the world size (see `gradient_step`).
    loss, clipped, ratio_sum, tokens, adv_sum, reward_sum, num_rows = replicas.all_sum(
        [loss / replicas.world, *sums, float(advantages.sum()), float(rewards.sum()), rows.num_rows]
    )
    return StepStats(
        loss=loss,
        clip_fraction=clipped / tokens if tokens else 0.0,
        # An empty mask means "still on-policy" (1.0), as in `losses`.
        mean_ratio=ratio_sum / tokens if tokens else 1.0,
        grad_norm=grad_norm,
        num_tokens=int(tokens),
        mean_advantage=_mean(advantages, adv_sum, num_rows),
        mean_reward=_mean(rewards, reward_sum, num_rows),
    )


def _mean(column: np.ndarray, total: float, count: float) -> float:
    """`total / count` in the column's float dtype, as `np.mean` divides: for one replica
    (total = column.sum()) this is `np.mean(column)` to the bit. 0.0 for no rows."""
    if not count:
        return 0.0
    kind = column.dtype.type if column.dtype.kind == "f" else np.float64
    return float(kind(total) / kind(count))


# How an optimizer computes its step, not what it has learnt: a checkpoint's values of these
# are not restored over this process's (`make_optimizer`).
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def make_optimizer(
    model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW over `model`'s parameters, its state already allocated
    (`allocate_optimizer_state`).

    With every parameter on a CUDA device (FSDP's DTensors included), the fused AdamW: one
    kernel for the whole update instead of torch's default multi-tensor (foreach) one, which
    launches several per parameter group. Elsewhere (the CPU) AdamW's defaults, as before.
    Place the model first: parameters moved to a GPU after this keep the default kernels.

    The kernel is this process's choice, not the checkpoint's: `Optimizer.load_state_dict`
    would otherwise put the saved param groups' `fused`/`foreach`/`capturable` flags over
    these (torch.optim.Optimizer.load_state_dict, `update_group`), so a checkpoint written
    on a GPU would step fused on the CPU and one from the CPU unfused on a GPU. A load
    pre-hook keeps this optimizer's flags, and `step` is then placed as they need it.
    """
    params = list(model.parameters())
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    optimizer = torch.optim.AdamW(
        params, lr=lr, weight_decay=weight_decay, betas=betas, **({"fused": True} if fused else {})
    )
    optimizer.register_load_state_dict_pre_hook(_keep_implementation)
    allocate_optimizer_state(optimizer)
    return optimizer


def _keep_implementation(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """`state_dict` with each param group's implementation flags set to `optimizer`'s own
    (unchanged when the group counts differ: `load_state_dict` then says so itself)."""
    saved = state_dict["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        return state_dict
    groups = [
        {**group, **{k: mine[k] for k in _IMPLEMENTATION_KEYS if k in mine}}
        for group, mine in zip(saved, optimizer.param_groups, strict=True)
    ]
    return {**state_dict, "param_groups": groups}


def allocate_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate Adam(W)'s state now, as its first `step()` would (the same tensors, zeros,
    step 0, so the steps that follow are bit for bit the same): when the trainer loads, not
    inside the first step, where the moments (2 x the float32 weights) would be carved out
    of memory that just held a micro-batch's activations and fragment it. Parameters that
    already have state, or need no gradient, are left alone."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        on_device = group["capturable"] or group["fused"]
        scalar = torch.float32 if group["fused"] else _scalar_dtype()
        for p in group["params"]:
            state = optimizer.state[p]
            if state or not p.requires_grad:
                continue
            # Where Adam keeps `step`: on the CPU unless capturable or fused (torch.optim.adam).
            state["step"] = (
                torch.zeros((), dtype=scalar, device=p.device)
                if on_device
                else torch.tensor(0.0, dtype=scalar, device="cpu")
            )
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _scalar_dtype() -> torch.dtype:
    """torch.optim's dtype for `step` (float64 only under a float64 default dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
