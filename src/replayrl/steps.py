"""The four steps of one iteration (plus opening a lineage), as plain functions.

Each step takes the config, the lineage's storage paths and a few numbers, reads what it
needs from storage, writes its output to storage, and returns a small result. The inline
engine calls them in a loop; the Kubeflow components call the same functions, one pod per
step. An optional in-process `StepCache` lets the inline engine skip reloading a model it
already holds; it never changes results (a cached policy equals the checkpoint on disk).

Every step is idempotent: a retry overwrites its own partial output and nothing else.
Before it writes, a step checks that the lineage has not committed its iteration yet
(`storage.check_iteration_open`), so a run that lost the race for an iteration stops
instead of overwriting the rows or checkpoint the winner's commit points at.
Randomness is seeded from (seed, iteration, step), so the same config gives the same rows,
checkpoints and metrics in either engine.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from replayrl import storage
from replayrl.advantages import compute_advantages
from replayrl.buffer import ReplayBuffer
from replayrl.config import RunConfig, default_cache_dir
from replayrl.errors import ReplayRLError
from replayrl.evaluate import EvalResult, evaluate_policy
from replayrl.generation import make_backend
from replayrl.metrics import percentile
from replayrl.models import initial_policy_dir, load_optimizer_state, load_policy, save_policy
from replayrl.rewards import score
from replayrl.schema import ROLLOUT_SCHEMA, USAGE_SCHEMA, rollout_id
from replayrl.storage import LineagePaths
from replayrl.tasks import TaskSplits, load_task
from replayrl.train import StepSettings, gradient_step, make_optimizer

log = logging.getLogger(__name__)

# What training reads of a sampled row; the text columns are never decoded for it.
TRAIN_COLUMNS = [
    "rollout_id",
    "iteration",
    "policy_version",
    "prompt_token_ids",
    "completion_token_ids",
    "behavior_logprobs",
    "reward",
    "advantage",
]


def derive_seed(seed: int, *parts: object) -> int:
    blob = "/".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:4], "little") & 0x7FFFFFFF


@dataclass
class StepCache:
    """In-process memo for the inline engine: task splits and the newest policy."""

    splits: TaskSplits | None = None
    policy_version: int | None = None
    policy: tuple | None = None  # (model, tokenizer)
    optimizer_state: dict | None = None
    extras: dict = field(default_factory=dict)


def task_splits(cfg: RunConfig, cache: StepCache | None = None) -> TaskSplits:
    if cache is not None and cache.splits is not None:
        return cache.splits
    t = cfg.task
    splits = load_task(
        name=t.name,
        num_train=t.num_train,
        num_eval=t.num_eval,
        seed=cfg.seed,
        path=t.path,
        options=t.options,
        open_file=storage.open_input,
    )
    if cache is not None:
        cache.splits = splits
    return splits


def policy(cfg: RunConfig, paths: LineagePaths, version: int, cache: StepCache | None = None):
    """(model, tokenizer) of checkpoint v{version}."""
    if cache is not None and cache.policy_version == version and cache.policy is not None:
        return cache.policy
    local = storage.checkpoint_local_dir(paths.checkpoint(version), default_cache_dir(cfg))
    model, tokenizer = load_policy(local)
    if torch.cuda.is_available():
        model = model.to("cuda")  # a GPU pod trains and evaluates there; CPU otherwise
    if cache is not None:
        cache.policy_version, cache.policy, cache.optimizer_state = (
            version,
            (model, tokenizer),
            None,
        )
    return model, tokenizer


def replay_buffer(paths: LineagePaths, cache: StepCache | None = None) -> ReplayBuffer:
    """The lineage's buffer; the inline engine keeps one open (its snapshots are refreshed
    incrementally, which is much cheaper than reopening the Delta log every step)."""
    if cache is not None and paths.buffer in cache.extras:
        return cache.extras[paths.buffer]
    buf = ReplayBuffer(paths.buffer, storage_options=storage.delta_storage_options(paths.buffer))
    if cache is not None:
        cache.extras[paths.buffer] = buf
    return buf


# ---------------------------------------------------------------- open


def initial_policy(cfg: RunConfig, cache: StepCache | None = None) -> Path:
    """A local directory with v0: the user's model or the (cached) warm-started tiny model."""
    return initial_policy_dir(cfg, task_splits(cfg, cache))


def publish_initial_policy(cfg: RunConfig, paths: LineagePaths, local: Path) -> None:
    """Checkpoint v0 of the lineage, copied from `local`."""
    if not storage.is_complete(paths.checkpoint(0)):
        storage.write_checkpoint(local, paths.checkpoint(0))


# ---------------------------------------------------------------- generate


@dataclass(frozen=True)
class GenerateResult:
    iteration: int
    policy_version: int
    rows: int
    prompt_tokens: int
    generated_tokens: int
    generation_seconds: float
    append_seconds: float
    mean_reward: float
    frac_correct: float
    frac_unparsed: float
    frac_truncated: float
    mean_completion_tokens: float
    buffer_version: int


def iteration_prompts(cfg: RunConfig, splits: TaskSplits, iteration: int):
    rng = np.random.default_rng(derive_seed(cfg.seed, "prompts", iteration))
    n = cfg.rollout.prompts_per_iteration
    idx = rng.choice(len(splits.train), size=n, replace=n > len(splits.train))
    return [splits.train[i] for i in idx]


def _generation_backend(cfg: RunConfig, paths: LineagePaths, version: int, cache):
    """The configured backend holding policy v{version}: vLLM loads the checkpoint directory
    itself (fetched from S3 when needed); transformers wraps the (cached) model."""
    r = cfg.rollout
    if r.backend == "vllm":
        local = storage.checkpoint_local_dir(paths.checkpoint(version), default_cache_dir(cfg))
        options = dict(
            dtype=r.vllm_dtype, gpu_memory_utilization=r.vllm_gpu_memory_utilization, seed=cfg.seed
        )
        return make_backend(
            "vllm", None, None, batch_size=r.batch_size, checkpoint_dir=local, vllm_options=options
        )
    model, tokenizer = policy(cfg, paths, version, cache)
    return make_backend(r.backend, model, tokenizer, batch_size=r.batch_size)


def generate(
    cfg: RunConfig,
    paths: LineagePaths,
    *,
    iteration: int,
    policy_version: int,
    cache: StepCache | None = None,
) -> GenerateResult:
    """Policy v{policy_version} samples G completions for each of this iteration's prompts;
    rewards and advantages (fixed now, not at use) are computed and the rows replace any
    rows already stored for this iteration in one commit."""
    splits = task_splits(cfg, cache)
    problems = iteration_prompts(cfg, splits, iteration)
    backend = _generation_backend(cfg, paths, policy_version, cache)
    start = time.perf_counter()
    try:
        completions = backend.generate(
            [p.prompt for p in problems],
            num_samples=cfg.rollout.samples_per_prompt,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            seed=derive_seed(cfg.seed, "generate", iteration),
        )
    finally:
        # A vLLM engine holds most of the GPU: free it before training.
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    generation_seconds = time.perf_counter() - start
    rewards = [
        score(kind=splits.reward_kind, completion=c.text, answer=problems[c.prompt_index].answer)
        for c in completions
    ]
    lineage = cfg.lineage
    group_ids = [f"{lineage}/{iteration}/{c.prompt_index}" for c in completions]
    reward_values = np.array([r.reward for r in rewards], dtype=np.float64)
    advantages = compute_advantages(
        loss=cfg.train.loss,
        rewards=reward_values,
        group_ids=np.array(group_ids),
        delta_v=cfg.train.delta_v,
    )
    now = datetime.now(UTC)
    table = pa.table(
        {
            "rollout_id": [
                rollout_id(
                    lineage=lineage,
                    iteration=iteration,
                    prompt_index=c.prompt_index,
                    sample_index=c.sample_index,
                )
                for c in completions
            ],
            "lineage": [lineage] * len(completions),
            "iteration": [iteration] * len(completions),
            "policy_version": [policy_version] * len(completions),
            "prompt_id": [problems[c.prompt_index].prompt_id for c in completions],
            "group_id": group_ids,
            "prompt": [problems[c.prompt_index].prompt for c in completions],
            "completion": [c.text for c in completions],
            "prompt_token_ids": [c.prompt_token_ids for c in completions],
            "completion_token_ids": [c.completion_token_ids for c in completions],
            "behavior_logprobs": [c.logprobs for c in completions],
            "reward": reward_values.astype(np.float32),
            "correct": [r.correct for r in rewards],
            "advantage": np.asarray(advantages, dtype=np.float32),
            "finish_reason": [c.finish_reason for c in completions],
            "created_at": [now] * len(completions),
        }
    ).cast(ROLLOUT_SCHEMA)
    start = time.perf_counter()
    storage.check_iteration_open(paths, iteration=iteration)
    version = replay_buffer(paths, cache).append(table, iteration=iteration)
    append_seconds = time.perf_counter() - start
    lengths = [len(c.completion_token_ids) for c in completions]
    return GenerateResult(
        iteration=iteration,
        policy_version=policy_version,
        rows=len(completions),
        prompt_tokens=sum(len(c.prompt_token_ids) for c in completions),
        generated_tokens=sum(lengths),
        generation_seconds=generation_seconds,
        append_seconds=append_seconds,
        mean_reward=float(reward_values.mean()),
        frac_correct=float(np.mean([r.correct for r in rewards])),
        frac_unparsed=float(np.mean([not r.parsed for r in rewards])),
        frac_truncated=float(np.mean([c.finish_reason == "length" for c in completions])),
        mean_completion_tokens=float(np.mean(lengths)),
        buffer_version=version,
    )


# ---------------------------------------------------------------- compact


@dataclass(frozen=True)
class CompactResult:
    iteration: int
    buffer_version: int  # the version train pins
    rows: int
    rows_deleted: int
    files: int
    bytes: int
    seconds: float
    files_vacuumed: int


def compact(
    cfg: RunConfig,
    paths: LineagePaths,
    *,
    iteration: int,
    current_policy_version: int,
    cache: StepCache | None = None,
) -> CompactResult:
    """Retention (FIFO capacity, positive bias, max staleness), bin-packing, vacuum."""
    b = cfg.buffer
    buf = replay_buffer(paths, cache)
    storage.check_iteration_open(paths, iteration=iteration)
    report = buf.compact(
        capacity=b.capacity,
        positive_bias=b.positive_bias,
        max_staleness=b.max_staleness,
        current_policy_version=current_policy_version,
        target_file_bytes=b.target_file_bytes,
        min_files_to_compact=b.compact_min_files,
        vacuum_grace_s=b.vacuum_grace_s,
    )
    stats = buf.stats(
        current_policy_version=current_policy_version, version=report.version, include_reuse=False
    )
    return CompactResult(
        iteration=iteration,
        buffer_version=report.version,
        rows=report.rows_after,
        rows_deleted=report.rows_deleted,
        files=stats.files,
        bytes=stats.bytes,
        seconds=report.seconds,
        files_vacuumed=report.files_vacuumed,
    )


# ---------------------------------------------------------------- train


@dataclass(frozen=True)
class TrainResult:
    iteration: int
    policy_version: int  # the checkpoint written
    steps: int
    loss: float
    clip_fraction: float
    mean_ratio: float
    grad_norm: float
    trained_tokens: int
    rollouts_trained: int
    unique_rollouts: int
    age_p50: float
    age_p95: float
    mean_sample_reward: float
    training_seconds: float
    checkpoint_seconds: float
    num_params: int  # of the trained model, for the ledger's FLOP estimate


def train(
    cfg: RunConfig,
    paths: LineagePaths,
    *,
    iteration: int,
    policy_version: int,
    buffer_version: int,
    cache: StepCache | None = None,
) -> TrainResult:
    """S gradient steps on B rows each, sampled from the pinned buffer version; writes
    checkpoint v{policy_version + 1} (with optimizer state) and the usage log."""
    tr = cfg.train
    buf = replay_buffer(paths, cache)
    storage.check_iteration_open(paths, iteration=iteration)
    batches = buf.sample(
        version=buffer_version,
        batch_size=tr.batch_size,
        num_batches=tr.steps_per_iteration,
        seed=derive_seed(cfg.seed, "sample", iteration),
        mode="epoch" if cfg.arm == "on-policy" else "uniform",
        replace=cfg.buffer.sample_with_replacement,
        columns=TRAIN_COLUMNS,
    )
    gradient_steps = _train_distributed if tr.distributed != "none" else _train_in_process
    stats, training_seconds, checkpoint_seconds, num_params = gradient_steps(
        cfg, paths, iteration=iteration, policy_version=policy_version, batches=batches, cache=cache
    )
    return _train_result(
        cfg,
        paths,
        buf,
        batches,
        stats,
        iteration=iteration,
        policy_version=policy_version,
        training_seconds=training_seconds,
        checkpoint_seconds=checkpoint_seconds,
        num_params=num_params,
    )


def step_settings(cfg: RunConfig) -> StepSettings:
    """The loss and optimizer settings of one gradient step, from `train` and the rollout
    temperature (the behaviour log-probs were taken at it)."""
    tr = cfg.train
    return StepSettings(
        loss_name=tr.loss,
        clip_eps=tr.clip_eps,
        is_cap=tr.is_cap,
        temperature=cfg.rollout.temperature,
        grad_clip=tr.grad_clip,
        lr=tr.lr,
        weight_decay=tr.weight_decay,
        betas=(tr.adam_beta1, tr.adam_beta2),
    )


def _train_in_process(
    cfg: RunConfig, paths: LineagePaths, *, iteration: int, policy_version: int, batches, cache
):
    """The gradient steps in this process (the cached model is trained in place) and the
    checkpoint v{policy_version + 1}; (stats, training s, checkpoint s, parameters)."""
    settings = step_settings(cfg)
    model, tokenizer = policy(cfg, paths, policy_version, cache)
    optimizer = make_optimizer(
        model, lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas
    )
    if (
        cache is not None
        and cache.optimizer_state is not None
        and cache.policy_version == policy_version
    ):
        optimizer.load_state_dict(cache.optimizer_state)
    else:
        local = storage.checkpoint_local_dir(
            paths.checkpoint(policy_version), default_cache_dir(cfg)
        )
        load_optimizer_state(optimizer, local)
    # The cached model is trained in place: it stops being v{policy_version} now.
    if cache is not None:
        cache.policy_version = None
    torch.manual_seed(derive_seed(cfg.seed, "train", iteration))
    start = time.perf_counter()
    stats = []
    for rows in batches:
        stats.append(
            gradient_step(
                model=model,
                optimizer=optimizer,
                rows=rows,
                pad_id=tokenizer.pad_token_id,
                settings=settings,
            )
        )
    training_seconds = time.perf_counter() - start
    new_version = policy_version + 1
    start = time.perf_counter()
    target = paths.checkpoint(new_version)
    storage.check_iteration_open(paths, iteration=iteration)
    if storage.is_s3(target):
        with tempfile.TemporaryDirectory(prefix="replayrl-ckpt-") as tmp:
            save_policy(model, tokenizer, Path(tmp), optimizer=optimizer)
            storage.write_checkpoint(Path(tmp), target)
    else:
        # Locally, write in place (no copy): clear a crashed attempt's partial output first;
        # the COMPLETE marker still goes last.
        storage.delete(target)
        save_policy(model, tokenizer, Path(target), optimizer=optimizer)
        storage.mark_complete(target)
    if cache is not None:
        cache.policy_version, cache.policy, cache.optimizer_state = (
            new_version,
            (model, tokenizer),
            optimizer.state_dict(),
        )
    checkpoint_seconds = time.perf_counter() - start
    return stats, training_seconds, checkpoint_seconds, sum(p.numel() for p in model.parameters())


def _train_distributed(
    cfg: RunConfig, paths: LineagePaths, *, iteration: int, policy_version: int, batches, cache
):
    """The gradient steps on `train.num_processes` processes (replayrl.distributed); the
    checkpoint is written to a scratch directory and published like any other."""
    from replayrl.distributed import train_on_batches

    tr = cfg.train
    local = storage.checkpoint_local_dir(paths.checkpoint(policy_version), default_cache_dir(cfg))
    target = paths.checkpoint(policy_version + 1)
    with tempfile.TemporaryDirectory(prefix="replayrl-ckpt-") as tmp:
        start = time.perf_counter()
        stats = train_on_batches(
            checkpoint_dir=local,
            out_dir=Path(tmp),
            batches=batches,
            settings=step_settings(cfg),
            mode=tr.distributed,
            num_processes=tr.num_processes,
            cpu=not torch.cuda.is_available(),
            seed=derive_seed(cfg.seed, "train", iteration),
        )
        training_seconds = time.perf_counter() - start
        start = time.perf_counter()
        storage.check_iteration_open(paths, iteration=iteration)
        storage.write_checkpoint(Path(tmp), target)
        checkpoint_seconds = time.perf_counter() - start
        num_params = _saved_param_count(Path(tmp))
    if cache is not None:
        cache.policy_version = None  # the trained model lives only in storage
    return stats, training_seconds, checkpoint_seconds, num_params


def _saved_param_count(directory: Path) -> int:
    """Parameters in a saved checkpoint's safetensors files, read from their headers."""
    from safetensors import safe_open

    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                total += int(np.prod(f.get_slice(key).get_shape()))
    return total


def _train_result(
    cfg: RunConfig,
    paths: LineagePaths,
    buf: ReplayBuffer,
    batches: list[pa.Table],
    stats: list,
    *,
    iteration: int,
    policy_version: int,
    training_seconds: float,
    checkpoint_seconds: float,
    num_params: int,
) -> TrainResult:
    """After the new checkpoint is complete: prune old ones, log the usage of every sampled
    row, and summarise the steps."""
    new_version = policy_version + 1
    storage.prune_checkpoints(paths, keep=cfg.train.keep_checkpoints, protect={0, new_version})
    used = pa.concat_tables(batches)
    ages = new_version - 1 - used.column("policy_version").to_numpy()
    usage = pa.table(
        {
            "lineage": [cfg.lineage] * used.num_rows,
            "iteration": [iteration] * used.num_rows,
            "train_step": np.repeat(np.arange(len(batches)), [b.num_rows for b in batches]),
            "rollout_id": used.column("rollout_id"),
            "policy_version_at_use": [policy_version] * used.num_rows,
            "rollout_policy_version": used.column("policy_version"),
        }
    ).cast(USAGE_SCHEMA)
    storage.check_iteration_open(paths, iteration=iteration)
    buf.log_usage(usage, iteration=iteration)
    trained_tokens = sum(
        len(p) + len(c)
        for p, c in zip(
            used.column("prompt_token_ids").to_pylist(),
            used.column("completion_token_ids").to_pylist(),
            strict=True,
        )
    )
    return TrainResult(
        iteration=iteration,
        policy_version=new_version,
        steps=len(stats),
        loss=float(np.mean([s.loss for s in stats])),
        clip_fraction=float(np.mean([s.clip_fraction for s in stats])),
        mean_ratio=float(np.mean([s.mean_ratio for s in stats])),
        grad_norm=float(np.mean([s.grad_norm for s in stats])),
        trained_tokens=trained_tokens,
        rollouts_trained=used.num_rows,
        unique_rollouts=len(set(used.column("rollout_id").to_pylist())),
        age_p50=percentile(ages, 50),
        age_p95=percentile(ages, 95),
        mean_sample_reward=float(np.mean([s.mean_reward for s in stats])),
        training_seconds=training_seconds,
        checkpoint_seconds=checkpoint_seconds,
        num_params=num_params,
    )


# ---------------------------------------------------------------- evaluate


def evaluate(
    cfg: RunConfig, paths: LineagePaths, *, policy_version: int, cache: StepCache | None = None
) -> EvalResult:
    """Held-out greedy pass@1, sampled pass@k, entropy and length of v{policy_version}."""
    splits = task_splits(cfg, cache)
    problems = splits.eval[: cfg.eval.num_prompts]
    if not problems:
        raise ReplayRLError("The held-out set is empty; raise task.num_eval.")
    model, tokenizer = policy(cfg, paths, policy_version, cache)
    backend = make_backend("transformers", model, tokenizer, batch_size=cfg.rollout.batch_size)
    e = cfg.eval
    return evaluate_policy(
        backend=backend,
        problems=problems,
        reward_kind=splits.reward_kind,
        max_new_tokens=cfg.rollout.max_new_tokens,
        num_samples=e.num_samples,
        k=e.pass_k,
        temperature=e.temperature,
        seed=derive_seed(cfg.seed, "eval"),
    )


def eval_due(cfg: RunConfig, iteration: int) -> bool:
    every = cfg.eval.every
    return iteration == 1 or iteration == cfg.iterations or (every > 0 and iteration % every == 0)
