"""The four steps of one iteration, as plain functions (what a lineage starts from is in
`replayrl.engine.inputs`).

Each step takes the config, the lineage's storage paths and a few numbers, reads what it
needs, writes its output to storage, and returns a small result. The inline engine and a
Kubeflow "task" pod pass the long-lived `TaskResources` of their task (the trainer with its
optimizer in memory, one generation engine, the buffer's in-memory mirror); a Kubeflow
pod per step passes none, and the step loads what it needs from storage (weights only for
generation and evaluation) and lets it go. The results are the same either way.

Every step is idempotent: a retry overwrites its own partial output and nothing else.
Before it writes, a step checks that the lineage has not committed its iteration yet
(`storage.check_iteration_open`), so a run that lost the race for an iteration stops
instead of overwriting the rows or checkpoint the winner's commit points at.
Randomness is seeded from (seed, iteration, step), so the same config gives the same rows,
checkpoints and metrics in either engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa

from replayrl import storage
from replayrl.buffer.schema import ROLLOUT_SCHEMA, rollout_id
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import RunConfig
from replayrl.core import clock
from replayrl.core.advantages import compute_advantages
from replayrl.core.rewards import score
from replayrl.core.staleness import (
    summarize_since_last_use,
)
from replayrl.engine import record
from replayrl.engine.inputs import replay_buffer, task_splits
from replayrl.engine.metric_schema import replay_metrics, train_metrics
from replayrl.engine.resources import TaskResources, device
from replayrl.engine.tracking import this_accelerator
from replayrl.engine.trainer_group import close_trainers, load_trainer
from replayrl.errors import ReplayRLError
from replayrl.policy import train_settings
from replayrl.policy.evaluation import EvalResult, evaluate_policy
from replayrl.policy.problems import Problem, TaskSplits
from replayrl.policy.prompts import format_problems
from replayrl.policy.training import StepSettings
from replayrl.storage import LineagePaths

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


# ---------------------------------------------------------------- generate


@dataclass(frozen=True)
class GenerateResult:
    iteration: int
    policy_version: int
    started_at: float  # unix seconds when the step began (the per-step engine's wall clock)
    rows: int
    prompt_tokens: int
    generated_tokens: int
    generation_seconds: float  # the backend's sampling only
    scoring_seconds: float  # rewards, advantages and building the rows
    append_seconds: float
    mean_reward: float
    frac_correct: float
    frac_unparsed: float
    frac_truncated: float
    mean_completion_tokens: float
    buffer_version: int
    # CPU seconds of generation, rewards and buffer_append (replayrl.core.clock), by ledger part.
    cpu_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # Device seconds of generation (replayrl.core.clock.DeviceTimer) on a GPU; empty on the CPU.
    device_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # What generated the rows (`tracking.this_accelerator`): the lineage's run is tagged with
    # it when the iteration is recorded. "" in results from before it was measured.
    accelerator: str = ""
    accelerators: int = 0


def iteration_prompts(cfg: RunConfig, splits: TaskSplits, iteration: int):
    rng = np.random.default_rng(derive_seed(cfg.seed, "prompts", iteration))
    n = cfg.rollout.prompts_per_iteration
    idx = rng.choice(len(splits.train), size=n, replace=n > len(splits.train))
    return [splits.train[i] for i in idx]


def prompted(cfg: RunConfig, problems, backend) -> list[Problem]:
    """`problems` with their prompts in `task.prompt_format`: "chat" renders each with the chat
    template of the tokenizer `backend` holds (the checkpoint's own, `replayrl.policy.prompts`);
    "plain" leaves them as they are."""
    t = cfg.task
    return format_problems(
        problems,
        tokenizer=backend.tokenizer if t.prompt_format == "chat" else None,
        prompt_format=t.prompt_format,
        system_prompt=t.system_prompt,
        template_args=t.chat_template_args,
    )


@dataclass(frozen=True)
class Rollouts:
    """One batch of scored rollouts, not yet stored: `table` (ROLLOUT_SCHEMA rows) and what
    making it took."""

    table: pa.Table
    generation: clock.Clocks  # the backend's sampling
    scoring: clock.Clocks  # rewards, advantages and building the rows
    prompt_tokens: int
    generated_tokens: int
    mean_reward: float
    frac_correct: float
    frac_unparsed: float
    frac_truncated: float
    mean_completion_tokens: float
    # The sampling's device seconds (replayrl.core.clock.DeviceTimer); None on the CPU.
    generation_device_seconds: float | None = None


def make_rollouts(
    cfg: RunConfig, splits: TaskSplits, backend, *, iteration: int, policy_version: int
) -> Rollouts:
    """`backend` (holding policy v{policy_version}) samples G completions for each of
    `iteration`'s prompts; rewards and advantages are computed now (fixed, never at use).
    The same `iteration` and seed always draw the same prompts and rollout ids. The
    asynchronous engine's workers call it with their batch number as `iteration`."""
    # The rows record the prompt exactly as the policy read it: its text and token ids.
    problems = prompted(cfg, iteration_prompts(cfg, splits, iteration), backend)
    start = clock.now()
    device_timer = clock.cuda_timer()
    device_timer.start()
    completions = backend.generate(
        [p.prompt for p in problems],
        num_samples=cfg.rollout.samples_per_prompt,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        seed=derive_seed(cfg.seed, "generate", iteration),
    )
    generation = clock.since(start)
    generation_device = device_timer.stop()
    start = clock.now()
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
    lengths = [len(c.completion_token_ids) for c in completions]
    return Rollouts(
        table=table,
        generation=generation,
        scoring=clock.since(start),
        prompt_tokens=sum(len(c.prompt_token_ids) for c in completions),
        generated_tokens=sum(lengths),
        mean_reward=float(reward_values.mean()),
        frac_correct=float(np.mean([r.correct for r in rewards])),
        frac_unparsed=float(np.mean([not r.parsed for r in rewards])),
        frac_truncated=float(np.mean([c.finish_reason == "length" for c in completions])),
        mean_completion_tokens=float(np.mean(lengths)),
        generation_device_seconds=generation_device,
    )


def generate(
    cfg: RunConfig,
    paths: LineagePaths,
    *,
    iteration: int,
    policy_version: int,
    resources: TaskResources | None = None,
) -> GenerateResult:
    """Policy v{policy_version} samples G completions for each of this iteration's prompts;
    rewards and advantages (fixed now, not at use) are computed and the rows replace any
    rows already stored for this iteration in one commit."""
    started_at = time.time()
    splits = task_splits(cfg, resources)
    # With resources the engine lives for the task (its start-up is counted once, as
    # start-up); without, this pod starts one and frees it before training.
    own = TaskResources(cfg, paths, splits=splits, for_one_step=True) if resources is None else None
    try:
        backend = (resources or own).backend_at(policy_version)
        made = make_rollouts(
            cfg, splits, backend, iteration=iteration, policy_version=policy_version
        )
    finally:
        if own is not None:
            own.close()
    start = clock.now()
    storage.check_iteration_open(paths, iteration=iteration)
    version = replay_buffer(paths, resources).append(made.table, iteration=iteration)
    append = clock.since(start)
    accelerator, accelerators = this_accelerator()
    return GenerateResult(
        iteration=iteration,
        policy_version=policy_version,
        started_at=started_at,
        rows=made.table.num_rows,
        prompt_tokens=made.prompt_tokens,
        generated_tokens=made.generated_tokens,
        generation_seconds=made.generation.wall,
        scoring_seconds=made.scoring.wall,
        append_seconds=append.wall,
        mean_reward=made.mean_reward,
        frac_correct=made.frac_correct,
        frac_unparsed=made.frac_unparsed,
        frac_truncated=made.frac_truncated,
        mean_completion_tokens=made.mean_completion_tokens,
        buffer_version=version,
        cpu_seconds={
            "generation": made.generation.cpu,
            "rewards": made.scoring.cpu,
            "buffer_append": append.cpu,
        },
        device_seconds=_measured(generation=made.generation_device_seconds),
        accelerator=accelerator,
        accelerators=accelerators,
    )


def _measured(**device_seconds: float | None) -> dict[str, float]:
    """Device seconds by ledger part, leaving out the parts no device measured."""
    return {part: s for part, s in device_seconds.items() if s is not None}


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
    # Rows kept only for the positive bias δ (correct rows older than the FIFO part), and
    # their ages in gradient steps at this iteration's first step, (v - v_row)·S: unlike
    # the FIFO rows they are not bounded by the horizon x. 0, NaN and NaN without any.
    bias_rows: int = 0
    bias_age_mean: float = math.nan
    bias_age_max: float = math.nan
    # CPU seconds of buffer_compact (replayrl.core.clock), by ledger part.
    cpu_seconds: dict[str, float] = dataclasses.field(default_factory=dict)


def compact(
    cfg: RunConfig,
    paths: LineagePaths,
    *,
    iteration: int,
    current_policy_version: int,
    resources: TaskResources | None = None,
) -> CompactResult:
    """Retention (FIFO capacity, positive bias, max staleness) and bin-packing. Old files
    are vacuumed only after a full checkpoint (`after_checkpoint`): until then the buffer
    version the last checkpoint pairs with must stay restorable."""
    start = clock.now()
    buf = replay_buffer(paths, resources)
    storage.check_iteration_open(paths, iteration=iteration)
    report = record.retain(cfg, buf, current_policy_version=current_policy_version)
    stats = buf.stats(
        current_policy_version=current_policy_version, version=report.version, include_reuse=False
    )
    took = clock.since(start)
    return CompactResult(
        iteration=iteration,
        buffer_version=report.version,
        rows=report.rows_after,
        rows_deleted=report.rows_deleted,
        files=stats.files,
        bytes=stats.bytes,
        seconds=took.wall,
        bias_rows=report.bias_rows,
        **_bias_ages(report, current_policy_version, cfg.train.steps_per_iteration),
        cpu_seconds={"buffer_compact": took.cpu},
    )


def _bias_ages(report, current_policy_version: int, steps_per_iteration: int) -> dict:
    """{"bias_age_mean", "bias_age_max"}: ages in gradient steps at the first step of the
    coming training of the rows a compaction kept only for the positive bias."""
    if report.bias_oldest_policy_version is None:
        return {"bias_age_mean": math.nan, "bias_age_max": math.nan}
    s = steps_per_iteration
    return {
        "bias_age_mean": float((current_policy_version - report.bias_mean_policy_version) * s),
        "bias_age_max": float((current_policy_version - report.bias_oldest_policy_version) * s),
    }


# ---------------------------------------------------------------- train


@dataclass(frozen=True)
class TrainResult:
    iteration: int
    policy_version: int  # the policy version after these steps
    steps: int
    loss: float
    clip_fraction: float
    mean_ratio: float
    grad_norm: float
    trained_tokens: int
    rollouts_trained: int
    unique_rollouts: int
    # Ages of the sampled rows in gradient steps (replayrl.core.staleness): step of use minus
    # the step the row's policy was current at, (v_use - v_row)·S + k.
    age_p50: float
    age_p95: float
    age_mean: float
    age_max: float
    # Steps since a sampled row's previous use (App. 10.3), over the uses of rows used
    # before; NaN when none was. frac_first_use: uses of rows never used before.
    since_last_use_mean: float
    since_last_use_p50: float
    frac_first_use: float
    mean_sample_reward: float
    sample_seconds: float  # drawing the batches from the buffer
    training_seconds: float  # the gradient steps only
    checkpoint_seconds: float  # writing the full checkpoint; 0 when none was due
    usage_seconds: float  # reading the drawn rows' earlier uses, logging this iteration's
    checkpoint_written: bool  # a full checkpoint v{policy_version} was written
    usage_version: int  # buffer/usage table version after this iteration's usage log
    num_params: int  # of the trained model, for the ledger's FLOP estimate
    # CPU seconds of buffer_sample, training, checkpoint and usage_log (replayrl.core.clock), by
    # ledger part: this process's (rank 0's under `train.distributed`; the other ranks are
    # processes alive for the task, joined only when it ends).
    cpu_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # Device seconds of training (replayrl.core.clock.DeviceTimer) on a GPU (rank 0's GPU under
    # `train.distributed`); empty on the CPU.
    device_seconds: dict[str, float] = dataclasses.field(default_factory=dict)


def train(
    cfg: RunConfig,
    paths: LineagePaths,
    *,
    iteration: int,
    policy_version: int,
    buffer_version: int,
    resources: TaskResources | None = None,
    checkpoint: bool = True,
) -> TrainResult:
    """S gradient steps on B rows each, sampled from the pinned buffer version, and the
    usage log. Policy v{policy_version} becomes v{policy_version + 1}; the full checkpoint
    of it is written when `checkpoint` (always without resources: nothing outlives the pod).
    With resources the trainer lives for the task, a group of `train.num_processes` ranks
    under `train.distributed` too (`trainer_group.load_trainer`): between full checkpoints
    its weights reach the generation engine in memory."""
    tr = cfg.train
    buf = replay_buffer(paths, resources)
    storage.check_iteration_open(paths, iteration=iteration)
    start = clock.now()
    sample_args = dict(
        version=buffer_version,
        batch_size=tr.batch_size,
        num_batches=tr.steps_per_iteration,
        seed=derive_seed(cfg.seed, "sample", iteration),
        mode=cfg.buffer.sampling(cfg.arm),
        replace=cfg.buffer.sample_with_replacement,
        columns=TRAIN_COLUMNS,
    )
    if resources is not None:
        batches = resources.mirror(TRAIN_COLUMNS).sample(**sample_args)
    else:
        batches = buf.sample(**sample_args)
    sample = clock.since(start)
    if resources is not None:
        resources.before_training()
    # One trainer (or trainer group) for the whole task; without resources, one for this
    # step, closed after it.
    trainer = (
        resources.trainer_at(policy_version, step_settings(cfg))
        if resources is not None
        else load_trainer(cfg, paths, version=policy_version, settings=step_settings(cfg))
    )
    try:
        start = clock.now()
        device_timer = clock.cuda_timer()
        device_timer.start()
        stats = trainer.train(batches, seed=derive_seed(cfg.seed, "train", iteration))
        training = clock.since(start)
        training_device = device_timer.stop()
        written = checkpoint or resources is None
        checkpointing = clock.Clocks(0.0, 0.0)
        if written:
            start = clock.now()
            trainer.save(
                paths.checkpoint(trainer.version),
                before_write=lambda: storage.check_iteration_open(paths, iteration=iteration),
            )
            checkpointing = clock.since(start)
        num_params = trainer.num_params
    finally:
        if resources is None:
            close_trainers(trainer)
    return _train_result(
        cfg,
        paths,
        buf,
        batches,
        stats,
        iteration=iteration,
        policy_version=policy_version,
        sample=sample,
        training=training,
        checkpointing=checkpointing,
        checkpoint_written=written,
        num_params=num_params,
        device_seconds=_measured(training=training_device),
    )


def step_settings(cfg: RunConfig) -> StepSettings:
    """The gradient step's settings of `cfg` for the device this process trains on
    (`train_settings.step_settings`, which a GPU check imports without pyarrow)."""
    return train_settings.step_settings(cfg, device=device())


def _train_result(
    cfg: RunConfig,
    paths: LineagePaths,
    buf: ReplayBuffer,
    batches: list[pa.Table],
    stats: list,
    *,
    iteration: int,
    policy_version: int,
    sample: clock.Clocks,
    training: clock.Clocks,
    checkpointing: clock.Clocks,
    checkpoint_written: bool,
    num_params: int,
    device_seconds: dict[str, float],
) -> TrainResult:
    """After the gradient steps (and the checkpoint, when due): log the usage of every
    sampled row, and summarise the steps."""
    new_version = policy_version + 1
    used = pa.concat_tables(batches)
    uses = record.log_uses(
        cfg, paths, buf, batches, iteration=iteration, policy_version=policy_version
    )
    usage = uses.clocks
    trained_tokens = sum(
        len(p) + len(c)
        for p, c in zip(
            used.column("prompt_token_ids").to_pylist(),
            used.column("completion_token_ids").to_pylist(),
            strict=True,
        )
    )
    replay = replay_metrics(ages=uses.ages, gaps=uses.gaps)  # the record path's statistics
    means = train_metrics(stats)
    return TrainResult(
        iteration=iteration,
        policy_version=new_version,
        steps=len(stats),
        loss=means["train/loss"],
        clip_fraction=means["train/clip_fraction"],
        mean_ratio=means["train/mean_ratio"],
        grad_norm=means["train/grad_norm"],
        trained_tokens=trained_tokens,
        rollouts_trained=used.num_rows,
        unique_rollouts=len(set(used.column("rollout_id").to_pylist())),
        age_p50=replay["replay/sample_age_p50"],
        age_p95=replay["replay/sample_age_p95"],
        age_mean=replay["replay/sample_age_mean"],
        age_max=replay["replay/sample_age_max"],
        since_last_use_mean=replay["replay/steps_since_last_use_mean"],
        since_last_use_p50=summarize_since_last_use(uses.gaps)["p50"],
        frac_first_use=replay["replay/frac_first_use"],
        mean_sample_reward=means["train/sample_reward"],
        sample_seconds=sample.wall,
        training_seconds=training.wall,
        checkpoint_seconds=checkpointing.wall,
        usage_seconds=usage.wall,
        checkpoint_written=checkpoint_written,
        usage_version=uses.usage_version,
        num_params=num_params,
        cpu_seconds={
            "buffer_sample": sample.cpu,
            "training": training.cpu,
            "checkpoint": checkpointing.cpu,
            "usage_log": usage.cpu,
        },
        device_seconds=device_seconds,
    )


# ---------------------------------------------------------------- evaluate


def evaluate(
    cfg: RunConfig,
    paths: LineagePaths,
    *,
    policy_version: int,
    resources: TaskResources | None = None,
) -> EvalResult:
    """Held-out greedy pass@1, sampled pass@k, entropy and length of v{policy_version}, with
    the generation backend (`rollout.backend`): the task resources' own (the trainer's model, or
    the task's one vLLM engine given the trainer's weights), or without resources one started
    for this step from a weights-only copy of the checkpoint and closed after it. vLLM gives
    no distribution, so its evaluation's entropy is NaN (not logged)."""
    splits = task_splits(cfg, resources)
    problems = splits.eval[: cfg.eval.num_prompts]
    if not problems:
        raise ReplayRLError("The held-out set is empty; raise task.num_eval.")
    start = clock.now()
    device_timer = clock.cuda_timer()
    device_timer.start()
    own = TaskResources(cfg, paths, splits=splits, for_one_step=True) if resources is None else None
    e = cfg.eval
    try:
        backend = (resources or own).backend_at(policy_version)
        result = evaluate_policy(
            backend=backend,
            problems=prompted(cfg, problems, backend),
            reward_kind=splits.reward_kind,
            max_new_tokens=cfg.rollout.max_new_tokens,
            num_samples=e.num_samples,
            k=e.pass_k,
            temperature=e.temperature,
            seed=derive_seed(cfg.seed, "eval"),
            top_p=e.top_p,
            pass1_temperature=e.pass1_temperature,
            pass1_top_p=e.pass1_top_p,
        )
    finally:
        if own is not None:
            own.close()
    took = clock.since(start)
    return dataclasses.replace(
        result, seconds=took.wall, cpu_seconds=took.cpu, device_seconds=device_timer.stop()
    )


def eval_due(cfg: RunConfig, iteration: int) -> bool:
    every = cfg.eval.every
    return iteration == 1 or iteration == cfg.iterations or (every > 0 and iteration % every == 0)
