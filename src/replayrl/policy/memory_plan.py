"""How much GPU memory a config needs, per GPU, before anything is downloaded.

`plan(cfg, gpus=8, gpu_bytes=80 * 2**30)` returns a `MemoryPlan`: for each kind of GPU the
config's layout uses (one process that trains and generates; DDP or FSDP trainer ranks with a
sleeping vLLM engine beside rank 0; asynchronous workers and trainers on GPUs of their own) the
bytes of each thing that lives there at its peak, and whether that fits. `replayrl plan`
prints it; opening a lineage on a GPU refuses a plan that does not fit (`check_fits`).

What is counted, per GPU (P = the model's parameters, n = trainer ranks sharing it under FSDP):

- the trainer's weights (float32, 4 B x P), gradients (float32, 4 B x P) and AdamW state
  (two float32 moments, 8 B x P): the mixed-precision path keeps float32 master weights and
  only runs the forward under bf16 autocast. Under FSDP each of the three is divided by n, and
  the gathered float32 parameters of two decoder layers (the one computing and the one being
  prefetched) come on top. Under DDP its gradient buckets hold another 4 B x P.
- the activations of one micro-batch (`activation_bytes`): what the forward keeps for backward,
  per token and decoder layer, from the hidden size, the query/key-value heads and the MLP's
  intermediate size; with activation checkpointing only each layer's input is kept, plus one
  layer's full set while it is recomputed. Under bf16 autocast the bf16 copies of the weights
  the kept layers used are kept too (2 B per parameter of those layers). The micro-batch is
  train.micro_batch_tokens padded tokens (or its row limit times the longest row).
- the output layer: its float32 gradient and, in bf16, a bf16 copy of its weight, held from
  the forward to the backward by the chunked loss; and the logits of one chunk,
  train.logprob_chunk_tokens x vocabulary x 4 B, about three times over at once (the logits,
  the log-softmax's exponentials and the logits' gradient).
- vLLM: its weights (2 B x P in bf16/fp16, 4 B x P with rollout.vllm_dtype float32) and its KV
  cache, 2 (K and V) x layers x key-value heads x head dim x 2 B per token. The plan wants room
  for min(rollout.batch_size, 256) sequences of prompt + max_new_tokens tokens (vLLM runs fewer
  at once when it has less, which is slower but not an error), and refuses less than one.

A fit leaves 10 % of each GPU free (the CUDA context, NCCL and allocator fragmentation; vLLM's
own `gpu_memory_utilization` default of 0.9 does the same). The activation model is checked
against the saved-tensor bytes of the real forward at configs/shapes-cpu.yaml's shapes
(bench/bench_memory_plan.py, within 20 %).

With asynchronous workers the plan also estimates what one publication of the weights costs
on each path against the time between publications (`sync_cost`).

Model shapes come from a local checkpoint's config.json, the tiny model's config, or the
published configs of the models the presets name (`KNOWN_SHAPES`); nothing is downloaded. The
parameter count is the model built on the meta device (no memory). Knows nothing about
storage, engines or trackers.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from replayrl.config import RunConfig
from replayrl.errors import ReplayRLError
from replayrl.policy import sync_cost
from replayrl.policy.sync_cost import WeightSync

GiB = 2**30
# The share of a GPU a plan may fill (the rest: CUDA context, NCCL, fragmentation).
USABLE_SHARE = 0.9
# vLLM's default max_num_seqs: sequences it decodes at once.
VLLM_MAX_NUM_SEQS = 256
# Prompt tokens assumed per sequence when the config cannot say (chat prompts of math tasks
# are a few hundred tokens); `replayrl plan --prompt-tokens` overrides it.
DEFAULT_PROMPT_TOKENS = 512
# Concurrent copies of the logits chunk (float32 logits, the log-softmax's exponentials, the
# logits' gradient).
LOGITS_COPIES = 3

# The published config.json of the models the presets name (Hugging Face hub), so a plan
# needs no download. Keys: the repository name, lower case, without its owner.
_QWEN25_05B = dict(
    model_type="qwen2",
    vocab_size=151_936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32_768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    use_sliding_window=False,
    tie_word_embeddings=True,
)
_QWEN3_06B = dict(
    model_type="qwen3",
    vocab_size=151_936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40_960,
    tie_word_embeddings=True,
)
_QWEN25_7B = dict(
    model_type="qwen2",
    vocab_size=152_064,
    hidden_size=3584,
    intermediate_size=18_944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=131_072,
    tie_word_embeddings=False,
)
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _QWEN25_05B,
    "qwen2.5-0.5b-instruct": _QWEN25_05B | {"max_position_embeddings": 32_768},
    "qwen3-0.6b": _QWEN3_06B,
    "qwen2.5-7b": _QWEN25_7B,
    "qwen2.5-7b-instruct": _QWEN25_7B | {"max_position_embeddings": 32_768},
    "qwen2.5-math-7b": _QWEN25_7B | {"max_position_embeddings": 4096},
}


def published_config(name: str) -> dict[str, Any]:
    """The published config.json values of a model the presets name (a `KNOWN_SHAPES` key),
    as keyword arguments for its transformers config class (`model_type` left out): what the
    GPU smokes build their random-weight models from."""
    return {k: v for k, v in KNOWN_SHAPES[name].items() if k != "model_type"}


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know of a decoder-only model."""

    name: str
    num_params: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (all but the embedding and output layer)."""
        outside = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return (self.num_params - outside) // self.num_layers

    @property
    def kv_bytes_per_token(self) -> int:
        """vLLM's KV cache per token in bf16: K and V, every layer, every key-value head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


def shape_from_hf_config(name: str, hf: Any) -> ModelShape:
    """The shape of a transformers config, its parameters counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    num_params = sum(p.numel() for p in model.parameters())
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(
        name=name,
        num_params=int(num_params),
        hidden_size=int(text.hidden_size),
        num_layers=int(text.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        intermediate_size=int(text.intermediate_size),
        vocab_size=int(text.vocab_size),
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
    )


def model_shape(cfg: RunConfig, *, model_config: str | Path | None = None) -> ModelShape:
    """The shape of the config's model: `model_config` (a config.json or a checkpoint
    directory) when given; the tiny model's config; a local checkpoint's config.json; else the
    published shape of a model `KNOWN_SHAPES` names (matched on the last part of
    model.source, e.g. s3://bucket/models/Qwen2.5-0.5B-Instruct). A ReplayRLError otherwise."""
    from transformers import AutoConfig, Qwen2Config

    m = cfg.model
    if model_config is not None:
        path = Path(model_config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ReplayRLError(
                f"No model config at '{model_config}' (a config.json or its folder)."
            )
        return shape_from_hf_config(str(model_config), AutoConfig.from_pretrained(path))
    if m.source == "tiny":
        hf = Qwen2Config(
            vocab_size=m.vocab_size,
            hidden_size=m.hidden_size,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads,
            num_key_value_heads=m.num_kv_heads,
            intermediate_size=m.intermediate_size,
            tie_word_embeddings=True,
        )
        return shape_from_hf_config("tiny", hf)
    local = Path(m.source.removeprefix("file://")).expanduser()
    if (local / "config.json").is_file():
        return shape_from_hf_config(m.source, AutoConfig.from_pretrained(local))
    base = m.source.rstrip("/").rsplit("/", 1)[-1].lower()
    if base not in KNOWN_SHAPES:
        raise ReplayRLError(
            f"The plan does not know the shape of model.source '{m.source}' and reads no "
            f"remote config: pass --model-config with its config.json (or a local checkpoint "
            f"folder). Known by name: {', '.join(sorted(KNOWN_SHAPES))}."
        )
    return replace(_known_shape(base), name=m.source)


@functools.cache
def _known_shape(base: str) -> ModelShape:
    from transformers import AutoConfig

    kwargs = dict(KNOWN_SHAPES[base])
    return shape_from_hf_config(base, AutoConfig.for_model(kwargs.pop("model_type"), **kwargs))


# ------------------------------------------------------------------ activations


def layer_activation_bytes_per_token(shape: ModelShape, *, bf16: bool) -> int:
    """Bytes one decoder layer keeps for backward per token (Qwen2/Qwen3 in transformers, SDPA
    attention), counted tensor by tensor:

    float32: the layer's input and its RMS-normalised copy, twice (attention and MLP halves:
    4 x 4h); queries, keys and their rotary copies (2 x 4q + 2 x 4kv); the queries, keys and
    values SDPA reads with keys and values repeated to every query head (3 x 4q), its output
    and the output projection's input (2 x 4q); the MLP's gate, its SiLU, the up projection
    and their product (4 x 4i). bf16 autocast: the same in 2 bytes per element for what the
    bf16 matmuls produce, plus the bf16 casts of the projections' inputs: one of the normalised
    input per half (2 x 2h; one per projection would be 5 x 2h, but the measurement of
    bench/bench_memory_plan.py finds about one per half), one for the output projection and
    one for down (2q + 2i), while the residual stream and the norms stay float32.
    """
    h, i = shape.hidden_size, shape.intermediate_size
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    if not bf16:
        return 4 * (4 * h + 2 * q + 2 * kv + 5 * q + 4 * i)
    return 4 * 4 * h + 2 * (2 * q + 2 * kv + 5 * q + 4 * i) + 2 * (2 * h + q + i)


def activation_bytes(
    shape: ModelShape,
    *,
    tokens: int,
    completion_tokens: int,
    bf16: bool,
    checkpointing: bool,
    recompute: bool = True,
) -> int:
    """What one micro-batch of `tokens` padded tokens (`completion_tokens` of them scored)
    keeps from its forward to its backward, the output layer excluded: every layer's set, or
    with activation checkpointing each layer's float32 input; the final norm's input and
    output; the chunked loss's gradient with respect to the last hidden states (float32,
    completion tokens x hidden); and under bf16 autocast the bf16 copies of the weights of
    the layers whose sets are kept. `recompute`: with checkpointing, add one layer's set (and
    its weight copies), rebuilt during backward; the peak has it, the forward's end does not."""
    h = shape.hidden_size
    per_layer = layer_activation_bytes_per_token(shape, bf16=bf16) * tokens
    copies = 2 * shape.layer_params if bf16 else 0
    if checkpointing:
        layers = shape.num_layers * 4 * h * tokens + (per_layer + copies if recompute else 0)
    else:
        layers = shape.num_layers * (per_layer + copies)
    edges = 2 * 4 * h * tokens + 4 * h * completion_tokens
    return layers + edges


# ------------------------------------------------------------------ the plan


@dataclass
class Item:
    name: str
    bytes: int
    note: str = ""


@dataclass
class GpuPlan:
    """One kind of GPU in the layout, at the peak of each phase it runs."""

    role: str
    count: int  # GPUs of this kind
    capacity_bytes: int  # USABLE_SHARE of the GPU
    phases: dict[str, list[Item]] = field(default_factory=dict)

    def peak(self, phase: str) -> int:
        return sum(item.bytes for item in self.phases[phase])

    @property
    def peak_bytes(self) -> int:
        return max((self.peak(p) for p in self.phases), default=0)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes


@dataclass
class MemoryPlan:
    model: ModelShape
    layout: str
    gpus: int
    gpu_bytes: int
    micro_batch_tokens: int
    activation_checkpointing: bool
    per_gpu: list[GpuPlan]
    problems: list[str]  # why it does not fit (empty when it does)
    warnings: list[str]
    # One publication's cost on each weight path (`sync_cost`); None without workers.
    weight_sync: WeightSync | None = None

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fits"] = self.fits
        for g, gpu in zip(out["per_gpu"], self.per_gpu, strict=True):
            g["peak_bytes"] = gpu.peak_bytes
            g["fits"] = gpu.fits
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def micro_batch_tokens(cfg: RunConfig, *, prompt_tokens: int, ranks: int) -> int:
    """Padded tokens of the largest micro-batch: train.micro_batch_tokens, or fewer rows'
    worth when train.micro_batch_size or a rank's share of B limits it; a row longer than the
    budget is a micro-batch of its own."""
    t = cfg.train
    row = prompt_tokens + cfg.rollout.max_new_tokens
    rows = math.ceil(t.batch_size / max(ranks, 1))
    if t.micro_batch_size:
        rows = min(rows, t.micro_batch_size)
    tokens = rows * row
    if t.micro_batch_tokens:
        tokens = min(tokens, max(t.micro_batch_tokens // row, 1) * row)
    return max(tokens, row)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def trainer_items(
    cfg: RunConfig,
    shape: ModelShape,
    *,
    ranks: int,
    sharded: bool,
    tokens: int,
    prompt_tokens: int,
    bf16: bool,
) -> list[Item]:
    """The training phase of one trainer rank's GPU."""
    p = shape.num_params
    div = ranks if sharded else 1
    share = f" / {ranks} ranks" if sharded and ranks > 1 else ""
    items = [
        Item("trainer weights", 4 * p // div, "float32" + share),
        Item("gradients", 4 * p // div, "float32" + share),
        Item("optimizer state", 8 * p // div, "AdamW: two float32 moments" + share),
    ]
    if sharded and ranks > 1:
        items.append(Item("gathered layers", 2 * 4 * shape.layer_params, "FSDP: two layers"))
    elif cfg.train.distributed == "ddp" and ranks > 1:
        items.append(Item("DDP gradient buckets", 4 * p, "a second float32 copy of the gradients"))
    ckpt = cfg.train.activation_checkpointing
    completion = tokens * cfg.rollout.max_new_tokens // (cfg.rollout.max_new_tokens + prompt_tokens)
    acts = activation_bytes(
        shape, tokens=tokens, completion_tokens=completion, bf16=bf16, checkpointing=ckpt
    )
    other = activation_bytes(
        shape, tokens=tokens, completion_tokens=completion, bf16=bf16, checkpointing=not ckpt
    )
    items.append(
        Item(
            "activations",
            acts,
            f"{tokens:,} tokens, checkpointing {'on' if ckpt else 'off'} "
            f"({_gib(other)} with it {'off' if ckpt else 'on'})",
        )
    )
    head = shape.vocab_size * shape.hidden_size
    items.append(
        Item(
            "output layer",
            4 * head + (2 * head if bf16 else 0),
            "its float32 gradient" + (" and bf16 weight" if bf16 else "") + ", held by the loss",
        )
    )
    chunk = cfg.train.logprob_chunk_tokens
    items.append(
        Item(
            "logits chunk",
            LOGITS_COPIES * chunk * shape.vocab_size * 4,
            f"{chunk} tokens x {shape.vocab_size:,} x 4 B, x{LOGITS_COPIES}",
        )
    )
    return items


def vllm_items(
    cfg: RunConfig, shape: ModelShape, *, room_bytes: int, prompt_tokens: int
) -> tuple[list[Item], list[str]]:
    """vLLM's weights and KV cache in `room_bytes`, and what it cannot hold."""
    r = cfg.rollout
    weight_bytes = (4 if r.vllm_dtype == "float32" else 2) * shape.num_params
    seq = prompt_tokens + max(r.max_new_tokens, 1)
    per_seq = shape.kv_bytes_per_token * seq
    concurrent = min(r.batch_size, VLLM_MAX_NUM_SEQS)
    wanted = per_seq * concurrent
    kv = max(min(wanted, room_bytes - weight_bytes), 0)
    fits_seqs = kv // per_seq if per_seq else 0
    problems: list[str] = []
    if fits_seqs < 1:
        problems.append(
            f"vLLM: {_gib(room_bytes)} of room holds its weights ({_gib(weight_bytes)}) but not "
            f"the KV cache of one {seq:,}-token sequence ({_gib(per_seq)})"
        )
        kv = per_seq
    note = f"{fits_seqs:,} of {concurrent} sequences x {seq:,} tokens" + (
        "" if fits_seqs >= concurrent else " (vLLM runs fewer at once)"
    )
    return [Item("vLLM weights", weight_bytes, r.vllm_dtype), Item("vLLM KV cache", kv, note)], (
        problems
    )


def vllm_sleep_level(cfg: RunConfig) -> int:
    """The vLLM sleep level of `cfg`'s engine: `rollout.vllm_sleep_level` when set, else the
    layout's. Both `replayrl plan` and the engine (`engine.resources.TaskResources`) take it
    from here. Level 1 copies the weights to pinned host memory and back (the model's size in
    bf16 each way: 15 GB at 7B, every iteration); level 2 discards them. Where an engine
    sleeps (the inline engine, a Kubeflow "task" pod) every iteration's gradient steps change
    the weights, which are then loaded into the engine in full before it wakes, so the copy
    level 1 keeps is never used: level 2. Engines that never sleep (step-layout generate
    pods, asynchronous workers) have no level; 1 is returned for them. Example: the inline
    engine of `configs/qwen2.5-0.5b-gsm8k.yaml` -> 2; the same with
    `kubernetes.layout=step` or `asynchronous.enabled=true` -> 1; with
    `rollout.vllm_sleep_level=1` -> 1 whatever the layout."""
    if cfg.rollout.vllm_sleep_level is not None:
        return cfg.rollout.vllm_sleep_level
    sleeps = not cfg.asynchronous.enabled and cfg.kubernetes.layout == "task"
    return 2 if sleeps else 1


def default_prompt_tokens(cfg: RunConfig) -> int:
    """Prompt tokens per sequence the plan assumes: the demo's bare expressions are a dozen
    bytes; a checkpoint's chat prompts `DEFAULT_PROMPT_TOKENS`."""
    return 16 if cfg.model.source == "tiny" else DEFAULT_PROMPT_TOKENS


def plan(
    cfg: RunConfig,
    *,
    gpus: int | None = None,
    gpu_bytes: int = 80 * GiB,
    prompt_tokens: int | None = None,
    shape: ModelShape | None = None,
) -> MemoryPlan:
    """The memory plan of `cfg` on `gpus` GPUs (None = as many as its layout uses) of
    `gpu_bytes` each. The trainer is planned in bf16 unless train.dtype is float32."""
    shape = shape or model_shape(cfg)
    prompt = default_prompt_tokens(cfg) if prompt_tokens is None else prompt_tokens
    t, a = cfg.train, cfg.asynchronous
    bf16 = t.dtype != "float32"
    sharded = t.distributed == "fsdp"
    capacity = int(USABLE_SHARE * gpu_bytes)
    problems: list[str] = []
    warnings: list[str] = []
    per_gpu: list[GpuPlan] = []
    vllm = cfg.rollout.backend == "vllm"
    if a.enabled:
        ranks = a.trainers
        layout = (
            f"asynchronous: W={a.workers} vLLM worker GPUs, T={ranks} trainer GPUs"
            f" ({'FSDP' if sharded else 'replicas'})"
        )
        needed = a.workers + ranks
        tokens = micro_batch_tokens(cfg, prompt_tokens=prompt, ranks=ranks)
        trainer = GpuPlan("trainer", ranks, capacity)
        trainer.phases["training"] = trainer_items(
            cfg, shape, ranks=ranks, sharded=sharded, tokens=tokens, prompt_tokens=prompt, bf16=bf16
        )
        per_gpu.append(trainer)
        if vllm:
            worker = GpuPlan("vLLM worker", a.workers, capacity)
            items, why = vllm_items(cfg, shape, room_bytes=capacity, prompt_tokens=prompt)
            worker.phases["generation"] = items
            problems += why
            per_gpu.insert(0, worker)
    else:
        ranks = t.num_processes if t.distributed != "none" else 1
        needed = ranks
        tokens = micro_batch_tokens(cfg, prompt_tokens=prompt, ranks=ranks)
        training = trainer_items(
            cfg, shape, ranks=ranks, sharded=sharded, tokens=tokens, prompt_tokens=prompt, bf16=bf16
        )
        if t.distributed == "none":
            layout = "synchronous, one process: the trainer and a sleeping vLLM share one GPU"
            first = GpuPlan("trainer + vLLM", 1, capacity)
            first.phases["training"] = training
            if vllm:
                # Between its steps the trainer keeps weights, gradients and AdamW state.
                resident = [
                    Item("trainer (resident)", 16 * shape.num_params, "weights, grads, AdamW")
                ]
                room = capacity - resident[0].bytes
                items, why = vllm_items(cfg, shape, room_bytes=room, prompt_tokens=prompt)
                first.phases["generation"] = resident + items
                problems += why
            per_gpu.append(first)
        else:
            kind = "FSDP" if sharded else "DDP"
            layout = (
                f"synchronous, {kind} over {ranks} trainer processes alive for the task; vLLM "
                "in the main process (rank 0) on GPU 0, asleep while they train"
            )
            first = GpuPlan("rank 0 + vLLM", 1, capacity)
            first.phases["training"] = training
            if vllm:
                # Between its steps rank 0 keeps its weights, gradients and AdamW state (its
                # shards under FSDP) on GPU 0 for the whole task.
                kept = 16 * shape.num_params // (ranks if sharded else 1)
                resident = [
                    Item(
                        "rank 0 (resident)",
                        kept,
                        "weights, grads, AdamW" + (f" / {ranks} ranks" if sharded else ""),
                    )
                ]
                room = capacity - kept
                items, why = vllm_items(cfg, shape, room_bytes=room, prompt_tokens=prompt)
                first.phases["generation"] = resident + items
                problems += why
            per_gpu.append(first)
            host = 4 * shape.num_params / GiB
            warnings.append(
                f"host memory: rank 0 alone reads the float32 checkpoint ({host:.1f} GiB) once "
                "per task"
                + (
                    f" and sends the other ranks their shards; each iteration it gathers the "
                    f"whole weights ({host:.1f} GiB) to give them to the engine"
                    if sharded
                    else "; each iteration the engine is given rank 0's replica in place"
                )
                + f"; a full checkpoint every {t.checkpoint_every} iteration(s)"
            )
            if ranks > 1:
                rest = GpuPlan(f"ranks 1-{ranks - 1}", ranks - 1, capacity)
                rest.phases["training"] = list(training)
                per_gpu.append(rest)
        layout += f"; {cfg.kubernetes.layout} layout on Kubeflow"
    total = gpus if gpus is not None else needed
    if total < needed:
        problems.append(f"the layout needs {needed} GPUs, {total} given")
    for gpu in per_gpu:
        for phase, items in gpu.phases.items():
            used = sum(i.bytes for i in items)
            if used > capacity:
                top = sorted(items, key=lambda i: -i.bytes)[:3]
                parts = ", ".join(f"{i.name} {_gib(i.bytes)}" for i in top)
                problems.append(
                    f"{gpu.role}, {phase}: needs {_gib(used)} of the {_gib(capacity)} usable "
                    f"({USABLE_SHARE:.0%} of {_gib(gpu_bytes)}); largest: {parts}"
                )
    if vllm and not a.enabled:
        level = vllm_sleep_level(cfg)
        host = 2 * shape.num_params / GiB
        chosen = "rollout.vllm_sleep_level; " if cfg.rollout.vllm_sleep_level else ""
        warnings.append(
            f"vLLM's sleep level for this layout: {level} ({chosen}"
            + (
                "weights discarded, the trainer's new ones loaded in full; level 1 would copy "
                f"{host:.1f} GiB to pinned host memory and back each iteration)"
                if level == 2
                else f"weights copied to {host:.1f} GiB of pinned host memory and back)"
            )
        )
    if bf16 and not t.activation_checkpointing:
        warnings.append(
            "train.activation_checkpointing is off: turn it on to keep one layer's activations"
        )
    return MemoryPlan(
        model=shape,
        layout=layout,
        gpus=total,
        gpu_bytes=gpu_bytes,
        micro_batch_tokens=tokens,
        activation_checkpointing=t.activation_checkpointing,
        per_gpu=per_gpu,
        problems=problems,
        warnings=warnings,
        weight_sync=sync_cost.estimate(cfg, shape.num_params, prompt_tokens=prompt),
    )


def refusal(p: MemoryPlan) -> str:
    """The one-paragraph error for a plan that does not fit."""
    return (
        f"This config does not fit its GPUs ({p.gpus} x {_gib(p.gpu_bytes)}, "
        f"{p.model.name}, {p.model.num_params / 1e9:.2f}B parameters, {p.layout}): "
        + "; ".join(p.problems)
        + ". Use train.distributed=fsdp over more GPUs, train.activation_checkpointing=true, a "
        "smaller train.micro_batch_tokens, or GPUs with more memory; `replayrl plan --config "
        "FILE` prints the whole plan."
    )


def check_fits(cfg: RunConfig, *, gpu_bytes: int | None, gpus: int | None = None) -> None:
    """Raise a ReplayRLError with the numbers when `cfg` cannot fit GPUs of `gpu_bytes`;
    nothing without a GPU (`gpu_bytes` None) or for a model whose shape is unknown here."""
    if gpu_bytes is None:
        return
    try:
        shape = model_shape(cfg)
    except ReplayRLError:
        return
    p = plan(cfg, gpus=gpus, gpu_bytes=gpu_bytes, shape=shape)
    if not p.fits:
        raise ReplayRLError(refusal(p))
