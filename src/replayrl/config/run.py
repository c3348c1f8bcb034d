"""RunConfig: the sections together, the paper's derived quantities (R, y, x), the config
hash, the arms, and the rules that span sections (each section checks its own fields)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import yaml

from replayrl.config.asynchronous import AsyncConfig
from replayrl.config.infra import KubernetesConfig, StorageConfig, TrackingConfig
from replayrl.config.ranges import check_ranges
from replayrl.config.schema import (
    TINY_VOCAB_SIZE,
    EvalConfig,
    ModelConfig,
    RolloutConfig,
    TaskConfig,
)
from replayrl.config.training import BufferConfig, TrainConfig
from replayrl.errors import ReplayRLError

ARMS = ("replay", "on-policy", "replay-plain")


@dataclass(frozen=True)
class RunConfig:
    """The keys at the top of the file: which arm, which seed, how many iterations."""

    arm: str = field(
        default="replay",
        metadata={
            "help": 'Which arm this run is: "replay", "on-policy" or "replay-plain" (`--arm` '
            'sets it). "on-policy" is derived from the replay settings (same model, data, '
            'seed and gradient steps; N = R = S·B, so each row is used once). "replay-plain" '
            "is the replay settings with buffer.positive_bias = 0 (a plain FIFO, δ = 0), to "
            "separate replay's effect from positive-bias retention's."
        },
    )
    seed: int = field(
        default=0,
        metadata={
            "range": "[0, 4294967295]",
            "help": "Random seed of the run; part of the default lineage name "
            "(<task>-<arm>-s<seed>).",
        },
    )
    iterations: int = field(
        default=300,
        metadata={
            "range": "(0, inf)",
            "help": "Total iterations of generate -> compact -> train -> evaluate (the "
            "asynchronous engine runs iterations x S gradient steps). Not part of the config "
            "hash, so a finished lineage can be extended by raising it.",
        },
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)

    # Derived quantities, named as in the paper.
    @property
    def rollouts_per_iteration(self) -> int:
        """R: fresh rollouts generated per iteration."""
        return self.rollout.prompts_per_iteration * self.rollout.samples_per_prompt

    @property
    def replay_ratio(self) -> float:
        """y = S·B / R: mean number of times a rollout is used."""
        return self.train.steps_per_iteration * self.train.batch_size / self.rollouts_per_iteration

    @property
    def staleness_horizon(self) -> float:
        """x = S·N / R in gradient steps: the paper's horizon, N over the R / S fresh
        rollouts per gradient step. A plain FIFO's rows are used at ages 0 .. x - 1 gradient
        steps (replayrl.core.staleness). N = 512, R = 128, S = 4 -> x = 16."""
        return self.train.steps_per_iteration * self.buffer.capacity / self.rollouts_per_iteration

    @property
    def lineage(self) -> str:
        mode = "async-" if self.asynchronous.enabled else ""
        return self.storage.lineage or f"{self.task.name}-{mode}{self.arm}-s{self.seed}"

    @property
    def total_gradient_steps(self) -> int:
        """Gradient steps of the whole lineage: iterations x S (the asynchronous engine counts
        in gradient steps; an "iteration" of it is S of them)."""
        return self.iterations * self.train.steps_per_iteration

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values, e.g. {"buffer.capacity": 512}, for MLflow params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict) and prefix.split(".")[-1] != "options":
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value

        walk("", self.to_dict())
        return out

    def config_hash(self) -> str:
        """Hash of everything that changes results: not where they are stored or tracked or
        which pods run them, and not `iterations`, so a finished lineage can be extended by
        raising it."""
        d = self.to_dict()
        d.pop("storage")
        d.pop("tracking")
        d.pop("kubernetes")
        d.pop("iterations")
        # The asynchronous split: off (the default) leaves every synchronous lineage's hash as
        # it was; on, how long one segment runs does not change what is computed.
        if not d["asynchronous"]["enabled"]:
            d.pop("asynchronous")
        else:
            for key in ASYNC_HASH_EXEMPT_KEYS:
                d["asynchronous"].pop(key)
        # When a checkpoint is written, and how a step is cut into micro-batches and chunks,
        # do not change what is computed (beyond float summation order).
        for key in HASH_EXEMPT_TRAIN_KEYS:
            d["train"].pop(key)
        # The what-if μ a report shows is a label, not an input.
        d["model"].pop("paper_mu")
        # Nor how much GPU memory the vLLM engine takes, over how many GPUs. The memory share
        # was hashed before it was known not to matter: it is hashed at its old default, so
        # lineages created then keep their hash.
        d["rollout"].pop("tensor_parallel_size")
        d["rollout"].pop("vllm_sleep_level")  # nor how the engine sleeps between them
        d["rollout"]["vllm_gpu_memory_utilization"] = 0.5
        # Knobs added after lineages existed: at their default they leave the hash of an
        # existing lineage unchanged, so it can be resumed.
        for section, key, default in HASH_DEFAULTS_OMITTED:
            if d[section].get(key) == default:
                d[section].pop(key)
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# How long one segment runs and how its processes are watched.
ASYNC_HASH_EXEMPT_KEYS = (
    "segment_steps",
    "segment_seconds",
    "stall_timeout_s",
    "stall_startup_s",
    "stop_grace_s",
    "peer_start_timeout_s",
    "trainer_nodes",  # where the trainers run, not what they compute
    # how weights move, not which ones: every path delivers the published version
    "weight_transfer",
    "weight_bucket_mib",
    "weight_timeout_s",
)
HASH_EXEMPT_TRAIN_KEYS = (
    "checkpoint_every",
    "micro_batch_size",
    "micro_batch_tokens",
    "logprob_chunk_tokens",
    "activation_checkpointing",
)
HASH_DEFAULTS_OMITTED = (
    ("train", "dtype", "auto"),
    ("model", "vocab_size", TINY_VOCAB_SIZE),
    # Evaluation knobs added later: at their defaults, lineages keep the hash they had.
    ("eval", "top_p", 1.0),
    ("eval", "pass1_temperature", None),
    ("eval", "pass1_top_p", 0.95),
    # Hugging Face hub names.
    ("model", "revision", None),
    ("task", "dataset_config", None),
    ("task", "dataset_split", "train"),
    ("task", "revision", None),
    # Prompt formats: "plain" is how every prompt was built before "chat" existed.
    ("task", "prompt_format", "plain"),
    ("task", "system_prompt", None),
    ("task", "chat_template_args", {}),
    ("model", "untie_word_embeddings", False),
    # Sampling across batches: null is how every arm sampled before the knob existed.
    ("buffer", "sample_mode", None),
)


# Section name -> its dataclass, in the order RunConfig declares them.
SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(RunConfig)
    if f.default_factory is not dataclasses.MISSING
}
# The order `validate` checks the sections in (every section; a test keeps them equal).
CHECK_ORDER = (
    "rollout",
    "buffer",
    "train",
    "kubernetes",
    "task",
    "eval",
    "model",
    "asynchronous",
    "tracking",
    "storage",
)


def apply_arm(cfg: RunConfig) -> RunConfig:
    """Derive the strict on-policy arm from the replay settings.

    Same model, data, seed and gradient steps (S, B); fresh rollouts per iteration R = S·B
    (as many as the gradient steps consume) and capacity N = R, so each row is used exactly
    once. Positive bias and staleness limits do not apply. The plain replay arm is the
    replay settings with positive bias δ = 0.
    """
    if cfg.arm not in ARMS:
        raise ReplayRLError(f"Unknown arm '{cfg.arm}'. Choose one of: {', '.join(ARMS)}.")
    if cfg.arm == "replay":
        return cfg
    if cfg.arm == "replay-plain":
        return dataclasses.replace(cfg, buffer=dataclasses.replace(cfg.buffer, positive_bias=0.0))
    consumed = cfg.train.steps_per_iteration * cfg.train.batch_size
    g = cfg.rollout.samples_per_prompt
    if consumed % g:
        raise ReplayRLError(
            f"On-policy arm needs S·B = {consumed} rollouts to be whole groups of "
            f"rollout.samples_per_prompt = {g}; change train.batch_size or rollout.samples_per_prompt."
        )
    return dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(cfg.rollout, prompts_per_iteration=consumed // g),
        buffer=dataclasses.replace(
            cfg.buffer, capacity=consumed, positive_bias=0.0, max_staleness=None
        ),
    )


def validate(cfg: RunConfig) -> None:
    """Every rule: the top-level keys' ranges (`seed`, `iterations`), each section's own
    `check()` (which starts with its fields' ranges, replayrl.config.ranges), then the rules
    across sections. Each message says how to fix the config."""
    check_ranges(cfg, "")
    for name in CHECK_ORDER:
        getattr(cfg, name).check()
    validate_tensor_parallel(cfg)
    validate_sizes(cfg)
    validate_async(cfg)
    validate_prompt_format(cfg)
    validate_trainer_beside_vllm(cfg)


def validate_trainer_beside_vllm(cfg: RunConfig) -> None:
    """In the synchronous engines the trainer shares its process with the vLLM engine, which
    owns the default torch.distributed process group; a one-process ddp or fsdp trainer there
    would create that group, or destroy the engine's when it ends. More than one process
    spawns its own ranks, and the asynchronous trainer has a process of its own."""
    tr = cfg.train
    if (
        cfg.rollout.backend == "vllm"
        and not cfg.asynchronous.enabled
        and tr.distributed != "none"
        and tr.num_processes == 1
    ):
        raise ReplayRLError(
            f"train.distributed={tr.distributed} with train.num_processes=1 would run a "
            f"one-process group inside the vLLM engine's process, whose process group it would "
            f"take over or destroy. One GPU trains without it: set train.distributed=none, or "
            f"train.num_processes >= 2 to spawn that many ranks."
        )


def validate_prompt_format(cfg: RunConfig) -> None:
    """task.prompt_format chat needs a tokenizer with a chat template; the tiny model's byte
    tokenizer has none (and its warm start reads the plain prompts)."""
    if cfg.task.prompt_format == "chat" and cfg.model.source == "tiny":
        raise ReplayRLError(
            "task.prompt_format: chat needs a checkpoint whose tokenizer has a chat template; "
            "the tiny model's byte tokenizer has none. Use prompt_format: plain, or point "
            "model.source at a chat model."
        )


def validate_sizes(cfg: RunConfig) -> None:
    """R, N, B and the prompt pool must fit one another (sections rollout, buffer, train,
    task)."""
    b, tr = cfg.buffer, cfg.train
    rollouts = cfg.rollouts_per_iteration
    if b.capacity < rollouts:
        raise ReplayRLError(
            f"buffer.capacity ({b.capacity}) is smaller than the fresh rollouts per iteration "
            f"R = rollout.prompts_per_iteration × rollout.samples_per_prompt = {rollouts}: the "
            f"newest rows would be dropped before use. Set buffer.capacity >= {rollouts}."
        )
    if tr.batch_size > b.capacity:
        raise ReplayRLError(
            f"train.batch_size ({tr.batch_size}) exceeds buffer.capacity ({b.capacity}); "
            f"a batch cannot be drawn. Lower train.batch_size or raise buffer.capacity."
        )
    if tr.batch_size > rollouts and not b.sample_with_replacement:
        raise ReplayRLError(
            f"train.batch_size ({tr.batch_size}) exceeds the fresh rollouts per iteration "
            f"R = {rollouts}: the first iteration's buffer holds only R rows, so a batch cannot "
            f"be drawn without replacement. Lower train.batch_size to <= {rollouts}, raise "
            f"rollout.prompts_per_iteration, or set buffer.sample_with_replacement: true."
        )
    if cfg.arm == "on-policy" and b.sampling(cfg.arm) != "epoch":
        raise ReplayRLError(
            'The on-policy arm uses each row exactly once: buffer.sample_mode must be "epoch" '
            "or null there."
        )
    if cfg.arm == "on-policy" and b.capacity != tr.steps_per_iteration * tr.batch_size:
        raise ReplayRLError(
            "On-policy arm needs buffer.capacity = S·B; let --arm on-policy derive it."
        )
    if cfg.task.num_train < cfg.rollout.prompts_per_iteration:
        raise ReplayRLError(
            f"task.num_train ({cfg.task.num_train}) is smaller than rollout.prompts_per_iteration "
            f"({cfg.rollout.prompts_per_iteration}); raise task.num_train."
        )


def validate_tensor_parallel(cfg: RunConfig) -> None:
    """rollout.tensor_parallel_size above 1: only for vLLM, in the "step" layout, on pods
    with at least that many GPUs (RolloutConfig.check refuses a size below 1)."""
    r, k = cfg.rollout, cfg.kubernetes
    tp = r.tensor_parallel_size
    if tp <= 1:
        return
    if r.backend != "vllm":
        raise ReplayRLError(
            f"rollout.tensor_parallel_size={tp} needs rollout.backend=vllm (the transformers "
            "backend runs on one device); set it to 1."
        )
    if k.layout != "step":
        raise ReplayRLError(
            f"rollout.tensor_parallel_size={tp} needs kubernetes.layout: step. The inline engine "
            "and task pods give the vLLM engine the trainer's new weights in place, which only "
            "works with its one worker in the trainer's process; set tensor_parallel_size: 1, "
            "or run one pod per step (each generate and evaluate pod starts its engine from "
            "the checkpoint)."
        )
    for name in ("generate_gpus", "evaluate_gpus"):
        gpus = getattr(k, name)
        if gpus < tp:
            raise ReplayRLError(
                f"rollout.tensor_parallel_size={tp} splits the vLLM engine over {tp} GPUs, but "
                f"kubernetes.{name} is {gpus}: raise kubernetes.{name} to {tp}, or lower "
                "tensor_parallel_size."
            )


def validate_async(cfg: RunConfig) -> None:
    """The asynchronous split's rules across sections, when it is on (AsyncConfig.check has
    already checked the section's own fields)."""
    a = cfg.asynchronous
    if not a.enabled:
        return
    if cfg.train.batch_size < a.trainers:
        raise ReplayRLError(
            f"train.batch_size ({cfg.train.batch_size}) is below asynchronous.trainers "
            f"({a.trainers}): each of the T data-parallel trainers takes a share of every batch."
        )
    if cfg.arm == "replay-plain":
        raise ReplayRLError(
            "The asynchronous engine runs the replay and on-policy arms; for plain replay use "
            "--arm replay with --set buffer.positive_bias=0."
        )
    if cfg.train.distributed not in ("none", "fsdp"):
        raise ReplayRLError(
            "The asynchronous engine's trainers are asynchronous.trainers processes of their "
            "own: set train.distributed: none (whole replicas, DistributedDataParallel) or "
            "fsdp (sharded, for policies that do not fit one GPU)."
        )
    if cfg.train.distributed == "fsdp" and a.trainers < 2:
        raise ReplayRLError(
            "train.distributed: fsdp shards the policy over the asynchronous.trainers "
            "processes: set asynchronous.trainers >= 2, or train.distributed: none."
        )
    if cfg.arm == "on-policy" and cfg.train.batch_size % cfg.rollout.samples_per_prompt:
        raise ReplayRLError(
            f"The asynchronous on-policy queue hands out whole groups: train.batch_size "
            f"({cfg.train.batch_size}) must be a multiple of rollout.samples_per_prompt "
            f"({cfg.rollout.samples_per_prompt})."
        )
    min_rows, max_unused = async_min_rows(cfg), async_max_unused_rows(cfg)
    if min_rows > max_unused + cfg.rollouts_per_iteration:
        raise ReplayRLError(
            f"asynchronous.min_rows ({min_rows}) exceeds max_unused_rows ({max_unused}) + one "
            f"batch (R = {cfg.rollouts_per_iteration}): workers would pause before the trainer "
            "could start. Raise max_unused_rows."
        )
    if max_unused < cfg.train.batch_size:
        raise ReplayRLError(
            f"asynchronous.max_unused_rows ({max_unused}) is below train.batch_size "
            f"({cfg.train.batch_size}): the on-policy queue could never fill a batch. Raise it."
        )
    if min_rows > cfg.buffer.capacity:
        raise ReplayRLError(
            f"asynchronous.min_rows ({min_rows}) exceeds buffer.capacity "
            f"({cfg.buffer.capacity}): the trainer would wait forever. Lower it."
        )


def async_min_rows(cfg: RunConfig) -> int:
    """Rows the buffer must hold before the asynchronous trainer takes a step."""
    return cfg.asynchronous.min_rows or cfg.train.batch_size


def async_max_unused_rows(cfg: RunConfig) -> int:
    """Rows never used by a gradient step above which asynchronous workers pause."""
    a = cfg.asynchronous
    if a.max_unused_rows is not None:
        return a.max_unused_rows
    if cfg.arm == "on-policy":
        return 2 * cfg.rollouts_per_iteration
    return max(int(cfg.buffer.capacity / cfg.replay_ratio), cfg.rollouts_per_iteration)
