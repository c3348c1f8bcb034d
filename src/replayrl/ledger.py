"""The compute ledger: what each iteration cost in generation and in training.

μ = (generation cost per rollout) / (training cost per rollout) is measured here from wall
seconds, not assumed; the paper measured 5–7 on long math solutions. FLOPs are estimates:
2·params·tokens for generation (forward only) and 6·params·tokens for training
(forward + backward). Pure arithmetic: no I/O, no tracker.
"""

from __future__ import annotations

from dataclasses import dataclass

CUMULATIVE_KEYS = (
    "generated_tokens",
    "prompt_tokens",
    "generation_seconds",
    "training_seconds",
    "rollouts_generated",
    "rollouts_trained",
    "generation_flops",
    "training_flops",
)


@dataclass(frozen=True)
class IterationCost:
    rollouts_generated: int  # R
    rollouts_trained: int  # S·B (with repeats)
    prompt_tokens: int
    generated_tokens: int
    trained_tokens: int  # prompt + completion tokens through forward/backward
    generation_seconds: float
    training_seconds: float
    num_params: int


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
        "rollouts_generated": cost.rollouts_generated,
        "rollouts_trained": cost.rollouts_trained,
        "generation_flops": gen_flops,
        "training_flops": train_flops,
    }
    for k in CUMULATIVE_KEYS:
        totals[k] += float(step[k])
    metrics = {f"ledger/{k}": float(v) for k, v in step.items()}
    metrics["ledger/mu"] = mu
    metrics["ledger/generation_seconds_per_rollout"] = gen_per_rollout
    metrics["ledger/training_seconds_per_rollout"] = train_per_rollout
    metrics["ledger/flops"] = gen_flops + train_flops
    for k, v in totals.items():
        metrics[f"cumulative/{k}"] = v
    metrics["cumulative/seconds"] = totals["generation_seconds"] + totals["training_seconds"]
    metrics["cumulative/flops"] = totals["generation_flops"] + totals["training_flops"]
    return metrics, totals
