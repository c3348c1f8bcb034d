"""The compute ledger: what each iteration cost, in tokens, FLOPs, wall and CPU seconds.

Every iteration's wall clock is split into named parts that add up to it:

    startup         process start, imports, opening the lineage, loading the trainer,
                    starting the generation engine: paid once per run or Kubeflow task and
                    spread evenly over the task's iterations
    generation      sampling the completions (the engine's own work)
    engine_sync     vLLM: sleeping while the trainer runs, waking, loading new weights
    rewards         scoring the completions, advantages, building the rows
    buffer_append   writing the iteration's rows
    buffer_compact  retention and bin-packing
    buffer_sample   drawing the training batches
    training        the gradient steps
    usage_log       recording which rows each step used
    checkpoint      writing a full checkpoint (0 in iterations without one)
    evaluation      held-out evaluation (0 in iterations without one)
    commit          the previous iteration's commit (state swap, MLflow) and what follows
                    it (lease renewal, pruning, vacuum)

`ledger/coverage` = sum of the parts / wall; what is left is interpreter time between
them. μ = (generation seconds per rollout) / (training seconds per rollout) uses the
steady-state generation and training parts only, as the paper defines it (§3.2: 6.84 for Qwen3-0.6B and 5.28 for
Qwen2.5-7B on long math solutions); `ledger/mu_effective` charges every overhead: the generation side
carries weight sync, scoring, append and engine start, the training side sampling, compaction, the usage log,
checkpoints and the trainer's load, and the rest (process start, opening, commit,
evaluation) is split evenly between them. FLOPs are estimates: 2·params·tokens for
generation (forward only) and 6·params·tokens for training (forward + backward).

Each part is also read on the process's CPU clock (`replayrl.core.clock`: user + system seconds
of all threads, plus child processes waited for within the part; a child still running is
not counted), logged beside its wall seconds as `ledger/{part}_cpu_seconds`, with
`ledger/total_cpu_seconds` the iteration's (its start-up share included; over
`ledger/wall_seconds` it is the cores kept busy on average, which drops when the process
waits for a core on a shared machine). Cumulative: `cumulative/{generation,training,
total}_cpu_seconds`, and the CPU compute axis `cumulative/cpu_seconds` =
steady-state generation + training CPU seconds, the counterpart of `cumulative/seconds`:
a comparison run on a machine busy with other jobs reads the method's own work on it,
where wall seconds also count the waits for a core. On a GPU the CPU clock sees only the
host side (launches, Python, waiting for the device), not the device's work.

On a CUDA device the generation, training and evaluation parts are also read on the device
(`replayrl.core.clock.DeviceTimer`: a pair of events on the current stream, waited for at
the end of the part only) and logged as `ledger/{part}_device_seconds`; cumulative:
`cumulative/{generation,training}_device_seconds` and the device compute axis
`cumulative/device_seconds` = generation + training device seconds, logged in iterations
where both were measured (a trainer in this process: not under `train.distributed`, whose
processes have streams of their own). On the CPU none of them is logged (absent, not 0).

Example: a generation part that ran 2.0 s of wall clock but only 1.2 s on a core (it waited
0.8 s for one) logs `ledger/generation_seconds` 2.0 and `ledger/generation_cpu_seconds` 1.2.
Pure arithmetic: no I/O, no tracker, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WALL_PARTS = (
    "startup",
    "generation",
    "engine_sync",
    "rewards",
    "buffer_append",
    "buffer_compact",
    "buffer_sample",
    "training",
    "usage_log",
    "checkpoint",
    "evaluation",
    "commit",
)
# Parts charged to one side in mu_effective; the rest is split evenly.
_GENERATION_SIDE = ("generation", "engine_sync", "rewards", "buffer_append", "engine_start")
_TRAINING_SIDE = (
    "training",
    "buffer_sample",
    "buffer_compact",
    "usage_log",
    "checkpoint",
    "trainer_load",
)

CUMULATIVE_KEYS = (
    "generated_tokens",
    "prompt_tokens",
    "generation_seconds",
    "training_seconds",
    "wall_seconds",
    "rollouts_generated",
    "rollouts_trained",
    "generation_flops",
    "training_flops",
    "generation_cpu_seconds",
    "training_cpu_seconds",
    "total_cpu_seconds",
    "generation_device_seconds",
    "training_device_seconds",
)
_CPU_TOTALS = ("generation_cpu_seconds", "training_cpu_seconds", "total_cpu_seconds")
_DEVICE_TOTALS = ("generation_device_seconds", "training_device_seconds")
# The parts a device is timed around (`ledger/{part}_device_seconds`).
DEVICE_PARTS = ("generation", "training", "evaluation")


@dataclass(frozen=True)
class IterationCost:
    rollouts_generated: int  # R
    rollouts_trained: int  # S·B (with repeats)
    prompt_tokens: int
    generated_tokens: int
    trained_tokens: int  # prompt + completion tokens through forward/backward
    generation_seconds: float  # steady-state generation only (no engine start)
    training_seconds: float  # the gradient steps only
    num_params: int
    # Seconds by WALL_PARTS name (missing = 0), and the iteration's wall clock; wall 0 =
    # not measured (then no coverage is logged).
    parts: dict[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0
    # The start-up share split further, for mu_effective: {"engine_start": s,
    # "trainer_load": s}; the rest of `startup` is process start and opening.
    startup_detail: dict[str, float] = field(default_factory=dict)
    # CPU seconds by WALL_PARTS name (missing = 0) and the iteration's, read on
    # `replayrl.core.clock`; empty = not measured (then no CPU metrics are logged).
    cpu_parts: dict[str, float] = field(default_factory=dict)
    cpu_seconds: float = 0.0
    # Device seconds by DEVICE_PARTS name, for the parts a CUDA device was timed in
    # (`replayrl.core.clock.DeviceTimer`); empty on the CPU (then no device metrics are logged).
    device_parts: dict[str, float] = field(default_factory=dict)


def iteration_metrics(
    cost: IterationCost, totals: dict[str, float] | None
) -> tuple[dict[str, float], dict[str, float]]:
    """(metrics to log for this iteration, updated cumulative totals)."""
    totals = {k: float((totals or {}).get(k, 0.0)) for k in CUMULATIVE_KEYS}
    gen_flops = 2.0 * cost.num_params * (cost.prompt_tokens + cost.generated_tokens)
    train_flops = 6.0 * cost.num_params * cost.trained_tokens
    gen_per_rollout = cost.generation_seconds / max(cost.rollouts_generated, 1)
    train_per_rollout = cost.training_seconds / max(cost.rollouts_trained, 1)
    mu = gen_per_rollout / train_per_rollout if train_per_rollout > 0 else float("nan")
    step = {
        "generated_tokens": cost.generated_tokens,
        "prompt_tokens": cost.prompt_tokens,
        "generation_seconds": cost.generation_seconds,
        "training_seconds": cost.training_seconds,
        "wall_seconds": cost.wall_seconds,
        "rollouts_generated": cost.rollouts_generated,
        "rollouts_trained": cost.rollouts_trained,
        "generation_flops": gen_flops,
        "training_flops": train_flops,
        "generation_cpu_seconds": cost.cpu_parts.get("generation", 0.0),
        "training_cpu_seconds": cost.cpu_parts.get("training", 0.0),
        "total_cpu_seconds": cost.cpu_seconds,
    }
    device = {p: float(s) for p, s in cost.device_parts.items() if p in DEVICE_PARTS}
    # The device axis needs both of its parts (under train.distributed training is not timed).
    measured_device = "generation" in device and "training" in device
    for k in _DEVICE_TOTALS:
        step[k] = device[k.removesuffix("_device_seconds")] if measured_device else 0.0
    for k in CUMULATIVE_KEYS:
        totals[k] += float(step[k])
    measured_cpu = bool(cost.cpu_parts)
    metrics = {
        f"ledger/{k}": float(v)
        for k, v in step.items()
        if (measured_cpu or k not in _CPU_TOTALS) and k not in _DEVICE_TOTALS
    }
    # Each timed part, whether or not the axis is complete.
    metrics.update({f"ledger/{part}_device_seconds": s for part, s in device.items()})
    metrics["ledger/mu"] = mu
    metrics["ledger/generation_seconds_per_rollout"] = gen_per_rollout
    metrics["ledger/training_seconds_per_rollout"] = train_per_rollout
    metrics["ledger/flops"] = gen_flops + train_flops
    parts = {name: float(cost.parts.get(name, 0.0)) for name in WALL_PARTS}
    # generation and training are logged above under their long-standing names.
    for name, seconds in parts.items():
        if name not in ("generation", "training"):
            metrics[f"ledger/{name}_seconds"] = seconds
    if measured_cpu:
        # generation and training CPU seconds are logged above, with the totals.
        for name in WALL_PARTS:
            if name not in ("generation", "training"):
                metrics[f"ledger/{name}_cpu_seconds"] = float(cost.cpu_parts.get(name, 0.0))
    if cost.wall_seconds > 0:
        metrics["ledger/coverage"] = sum(parts.values()) / cost.wall_seconds
        metrics["ledger/mu_effective"] = mu_effective(cost, parts)
    for k, v in totals.items():
        if (measured_cpu or k not in _CPU_TOTALS) and (measured_device or k not in _DEVICE_TOTALS):
            metrics[f"cumulative/{k}"] = v
    # The comparison's compute axis: steady-state generation + training seconds.
    metrics["cumulative/seconds"] = totals["generation_seconds"] + totals["training_seconds"]
    if measured_cpu:
        # The same axis on the CPU clock, for machines shared with other jobs.
        metrics["cumulative/cpu_seconds"] = (
            totals["generation_cpu_seconds"] + totals["training_cpu_seconds"]
        )
    if measured_device:
        # The same axis on the device's clock: what the comparison measures on a GPU.
        metrics["cumulative/device_seconds"] = (
            totals["generation_device_seconds"] + totals["training_device_seconds"]
        )
    metrics["cumulative/flops"] = totals["generation_flops"] + totals["training_flops"]
    return metrics, totals


def mu_effective(cost: IterationCost, parts: dict[str, float]) -> float:
    """μ with every overhead charged (see the module docstring); NaN without training."""
    detail = {**parts, **cost.startup_detail}
    # The startup share not explained by engine start and trainer load: process start,
    # imports, opening the lineage.
    other_startup = max(
        parts["startup"] - sum(cost.startup_detail.values()),
        0.0,
    )
    shared = other_startup + parts["commit"] + parts["evaluation"]
    generation = sum(detail.get(k, 0.0) for k in _GENERATION_SIDE) + shared / 2
    training = sum(detail.get(k, 0.0) for k in _TRAINING_SIDE) + shared / 2
    if training <= 0 or cost.rollouts_trained == 0:
        return float("nan")
    per_generated = generation / max(cost.rollouts_generated, 1)
    return per_generated / (training / cost.rollouts_trained)
