"""Replay against on-policy: accuracy curves per arm, compute to reach a target, accuracy at
equal compute. Pure arithmetic on numbers already read from the tracker.

Compute is measured on three axes, each cumulative from the warm start (iteration 0):

- `generated_tokens`: completion tokens sampled (the inference work);
- `seconds`: measured generation + training seconds on the machine that ran the lineage
  (GPU-seconds on a GPU, CPU seconds here; the caller labels them);
- `cost_units`: modelled cost with a chosen μ, in units of one rollout's training cost,
  `cost = μ · (rollouts generated) + (rollouts trained on)`. Per iteration that is
  μ·R + S·B, the paper's C = (B + μR)·T summed over T gradient steps when each step trains
  on B rows and R fresh rollouts are generated per step (here S steps share one iteration's
  R: the same total). μ = (generation cost per rollout) / (training cost per rollout); the
  paper measured 5.3 on long math solutions, so a user reads the result for the hardware
  they will run on, not only for this machine.

Seeds of an arm are aligned by iteration, not by compute: every seed of an arm evaluates at
the same iterations, so the arm's curve is, at each evaluated iteration common to all its
seeds, the mean pass@1 (band: min-max over seeds) against the mean cumulative compute. Its
last point is exactly the mean final pass@1.

"Compute to reach the target" is the arm's mean compute at the first evaluated iteration
where its mean pass@1 is at or above the target: no interpolation between evaluations (a
checkpoint is known to reach the target only once it has been evaluated). "Accuracy at
equal compute" interpolates each arm's mean curve linearly at the largest budget both arms
spent (the smaller of their final compute).

Knows nothing about MLflow, files or plots; `replayrl.compare` reads and writes those.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from replayrl.errors import ReplayRLError

PAPER_MU = 5.3  # measured generation/training cost per rollout in the paper (long math solutions)
AXES = ("generated_tokens", "seconds", "cost_units")
BASELINE_ARM = "on-policy"
ARM_ORDER = ("on-policy", "replay")


@dataclass(frozen=True)
class LineageCurve:
    """One lineage's held-out evaluations and the cumulative compute spent before each.

    All sequences are aligned with `iterations` (the evaluated iterations, 0 = warm start,
    increasing); cumulative values are 0 at iteration 0."""

    lineage: str
    arm: str
    seed: int
    iterations: tuple[int, ...]
    pass1: tuple[float, ...]
    pass_at_k: tuple[float, ...]  # nan where not logged
    entropy: tuple[float, ...]  # mean token entropy (nats) of sampled eval completions
    generated_tokens: tuple[float, ...]
    seconds: tuple[float, ...]  # generation + training seconds
    rollouts_generated: tuple[float, ...]
    rollouts_trained: tuple[float, ...]  # with repeats: S·B per iteration
    k: int = 4
    # Totals at the lineage's last recorded iteration, for the measured μ.
    generation_seconds_total: float = 0.0
    training_seconds_total: float = 0.0
    rollouts_generated_total: float = 0.0
    rollouts_trained_total: float = 0.0

    def axis(self, name: str, *, mu: float) -> tuple[float, ...]:
        if name == "cost_units":
            return tuple(
                mu * g + t
                for g, t in zip(self.rollouts_generated, self.rollouts_trained, strict=True)
            )
        if name in ("generated_tokens", "seconds", "rollouts_trained"):
            return getattr(self, name)
        raise ValueError(f"unknown axis {name!r}")


def measured_mu(curve: LineageCurve) -> float | None:
    """(generation seconds per rollout) / (training seconds per rollout) over the lineage."""
    if min(curve.rollouts_generated_total, curve.rollouts_trained_total) <= 0:
        return None
    if curve.training_seconds_total <= 0:
        return None
    per_generated = curve.generation_seconds_total / curve.rollouts_generated_total
    per_trained = curve.training_seconds_total / curve.rollouts_trained_total
    return per_generated / per_trained


@dataclass(frozen=True)
class ArmCurve:
    """An arm's seeds aligned by evaluated iteration: means, and the min-max band."""

    arm: str
    seeds: tuple[int, ...]
    lineages: tuple[str, ...]
    iterations: tuple[int, ...]
    compute: dict[str, tuple[float, ...]]  # axis -> mean cumulative compute per iteration
    pass1_mean: tuple[float, ...]
    pass1_min: tuple[float, ...]
    pass1_max: tuple[float, ...]
    final_pass1: tuple[float, ...]  # per seed, at the last common iteration
    final_pass_at_k: tuple[float, ...]
    final_entropy: tuple[float, ...]
    k: int


def arm_curve(curves: Sequence[LineageCurve], *, mu: float) -> ArmCurve:
    if not curves:
        raise ValueError("an arm needs at least one lineage")
    arms = {c.arm for c in curves}
    if len(arms) != 1:
        raise ValueError(f"lineages of several arms: {sorted(arms)}")
    curves = sorted(curves, key=lambda c: (c.seed, c.lineage))
    common = sorted(set.intersection(*(set(c.iterations) for c in curves)))
    if not common:
        names = ", ".join(c.lineage for c in curves)
        raise ReplayRLError(
            f"The lineages of arm '{curves[0].arm}' ({names}) share no evaluated iteration; "
            f"run them with the same eval.every and iterations."
        )
    index = [{t: i for i, t in enumerate(c.iterations)} for c in curves]

    def at(values_of, name: str | None = None) -> list[list[float]]:
        """values[seed][iteration] over the common iterations."""
        out = []
        for c, idx in zip(curves, index, strict=True):
            values = values_of(c) if name is None else c.axis(name, mu=mu)
            out.append([values[idx[t]] for t in common])
        return out

    pass1 = at(lambda c: c.pass1)
    by_iteration = list(zip(*pass1, strict=True))  # (iterations, seeds)
    compute = {
        axis: tuple(statistics.fmean(col) for col in zip(*at(None, axis), strict=True))
        for axis in (*AXES, "rollouts_trained")
    }
    last = [idx[common[-1]] for idx in index]
    return ArmCurve(
        arm=curves[0].arm,
        seeds=tuple(c.seed for c in curves),
        lineages=tuple(c.lineage for c in curves),
        iterations=tuple(common),
        compute=compute,
        pass1_mean=tuple(statistics.fmean(col) for col in by_iteration),
        pass1_min=tuple(min(col) for col in by_iteration),
        pass1_max=tuple(max(col) for col in by_iteration),
        final_pass1=tuple(c.pass1[i] for c, i in zip(curves, last, strict=True)),
        final_pass_at_k=tuple(c.pass_at_k[i] for c, i in zip(curves, last, strict=True)),
        final_entropy=tuple(c.entropy[i] for c, i in zip(curves, last, strict=True)),
        k=curves[0].k,
    )


def first_reach(compute: Sequence[float], pass1: Sequence[float], target: float) -> float | None:
    """Compute at the first evaluation whose pass@1 is at or above `target`; None if never.

    >>> first_reach([0, 10, 20, 30], [0.2, 0.3, 0.5, 0.4], 0.45)
    20
    """
    for x, y in zip(compute, pass1, strict=True):
        if y >= target - 1e-12:  # a float equal to the target counts as reaching it
            return x
    return None


def value_at(compute: Sequence[float], pass1: Sequence[float], budget: float) -> float:
    """pass@1 interpolated linearly at `budget` (compute increasing); nan outside the curve.

    >>> value_at([0, 10, 20], [0.2, 0.4, 0.3], 5)
    0.30000000000000004
    """
    if not compute or budget < compute[0] or budget > compute[-1]:
        return math.nan
    for (x0, y0), (x1, y1) in itertools.pairwise(zip(compute, pass1, strict=True)):
        if x0 <= budget <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (budget - x0) / (x1 - x0)
    return pass1[-1]


def group_by_arm(curves: Sequence[LineageCurve]) -> dict[str, list[LineageCurve]]:
    groups: dict[str, list[LineageCurve]] = {}
    for c in curves:
        groups.setdefault(c.arm, []).append(c)
    order = {a: i for i, a in enumerate(ARM_ORDER)}
    return dict(sorted(groups.items(), key=lambda kv: (order.get(kv[0], 99), kv[0])))


def config_differences(params: Sequence[dict[str, str]]) -> list[str]:
    """Config keys whose values differ between lineages of one arm (seeds, iterations and
    where results are stored aside): an arm mixing configs cannot be averaged."""
    ignored_prefixes = ("storage.", "tracking.", "kubernetes.", "model.cache_dir")
    keys = set().union(*(p.keys() for p in params)) if params else set()
    return sorted(
        k
        for k in keys
        if k not in ("seed", "iterations")
        and not k.startswith(ignored_prefixes)
        and len({p.get(k) for p in params}) > 1
    )


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"mean": None, "std": None, "min": None, "max": None}
    return {
        "mean": statistics.fmean(finite),
        "std": statistics.pstdev(finite) if len(finite) > 1 else 0.0,
        "min": min(finite),
        "max": max(finite),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def compare(
    curves: Sequence[LineageCurve], *, target: float | None = None, mu: float = PAPER_MU
) -> dict:
    """The comparison as a JSON-ready dict (see the module docstring for each quantity).

    `target`: pass@1 to reach; None = the on-policy arm's final mean pass@1. Ratios are
    arm / on-policy, so below 1 means the arm needed less compute than on-policy."""
    if mu < 0 or not math.isfinite(mu):
        raise ReplayRLError(f"μ must be a finite number >= 0, got {mu}; the paper's is 5.3.")
    groups = group_by_arm(curves)
    if not groups:
        raise ReplayRLError(
            "No lineage runs (runs tagged with `arm` and `lineage`) in this experiment: run "
            "both arms first, e.g. `replayrl experiment --config configs/tiny-cpu.yaml`."
        )
    arms = {arm: arm_curve(cs, mu=mu) for arm, cs in groups.items()}
    baseline = arms.get(BASELINE_ARM)
    if target is None:
        if baseline is None:
            raise ReplayRLError(
                "No on-policy lineage in this experiment, so there is no default target: run "
                "the on-policy arm (--arm on-policy) or pass --target ACC."
            )
        target = statistics.fmean(baseline.final_pass1)
        target_source = "on-policy final mean pass@1"
    else:
        target_source = "given"
    finals = {arm: {axis: a.compute[axis][-1] for axis in AXES} for arm, a in arms.items()}
    budgets = {axis: min(f[axis] for f in finals.values()) for axis in AXES}
    to_target = {
        arm: {axis: first_reach(a.compute[axis], a.pass1_mean, target) for axis in AXES}
        for arm, a in arms.items()
    }
    out_arms = {}
    for arm, a in arms.items():
        per_seed = []
        for c in sorted(groups[arm], key=lambda c: (c.seed, c.lineage)):
            per_seed.append(
                {
                    "seed": c.seed,
                    "lineage": c.lineage,
                    "final_iteration": c.iterations[-1],
                    "final_pass1": c.pass1[-1],
                    "measured_mu": measured_mu(c),
                    "to_target": {
                        axis: first_reach(c.axis(axis, mu=mu), c.pass1, target) for axis in AXES
                    },
                }
            )
        mus = [s["measured_mu"] for s in per_seed if s["measured_mu"] is not None]
        out_arms[arm] = {
            "seeds": list(a.seeds),
            "lineages": list(a.lineages),
            "final_iteration": a.iterations[-1],
            "final_pass1": _stats(a.final_pass1),
            "final_pass_at_k": _stats(a.final_pass_at_k),
            "k": a.k,
            "final_entropy": _stats(a.final_entropy),
            "final_compute": finals[arm],
            "measured_mu": statistics.median(mus) if mus else None,
            "to_target": to_target[arm],
            "ratio_to_on_policy": {
                axis: _ratio(to_target[arm][axis], to_target.get(BASELINE_ARM, {}).get(axis))
                for axis in AXES
            },
            "rollouts_trained_to_target": first_reach(
                a.compute["rollouts_trained"], a.pass1_mean, target
            ),
            "at_equal_compute": {
                axis: {
                    "budget": budgets[axis],
                    "pass1": _none_if_nan(value_at(a.compute[axis], a.pass1_mean, budgets[axis])),
                }
                for axis in AXES
            },
            "per_seed": per_seed,
        }
    return {
        "target_pass1": target,
        "target_source": target_source,
        "mu_model": mu,
        "arms": out_arms,
        "curves": {
            arm: {
                "iterations": list(a.iterations),
                **{axis: list(a.compute[axis]) for axis in AXES},
                "pass1_mean": list(a.pass1_mean),
                "pass1_min": list(a.pass1_min),
                "pass1_max": list(a.pass1_max),
            }
            for arm, a in arms.items()
        },
    }


def _none_if_nan(v: float) -> float | None:
    return None if math.isnan(v) else v


def _fmt(v: float | None, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def markdown(result: dict, *, seconds_label: str = "seconds") -> str:
    """Two Markdown tables: compute to reach the target, then accuracy."""
    mu = result["mu_model"]
    target = result["target_pass1"]
    lines = [
        f"**Target:** held-out pass@1 = {target:.3f} ({result['target_source']}).",
        "",
        f"Compute to first reach the target (mean over seeds). Measured: generated tokens and "
        f"{seconds_label} (generation + training). Modelled: cost units = μ·(rollouts "
        f"generated) + (rollouts trained on), μ = {mu:g}, in units of one rollout's training "
        f"cost. Ratio = arm / on-policy (below 1: less compute than on-policy).",
        "",
        "| arm | seeds | tokens | ratio | seconds | ratio | cost units (μ=" + f"{mu:g}) | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, a in result["arms"].items():
        tt, rr = a["to_target"], a["ratio_to_on_policy"]
        lines.append(
            f"| {arm} | {len(a['seeds'])} | {_fmt(tt['generated_tokens'], ',.0f', NR)} | "
            f"{_fmt(rr['generated_tokens'], '.2f')} | {_fmt(tt['seconds'], ',.1f', NR)} | "
            f"{_fmt(rr['seconds'], '.2f')} | {_fmt(tt['cost_units'], ',.0f', NR)} | "
            f"{_fmt(rr['cost_units'], '.2f')} |"
        )
    first = next(iter(result["arms"].values()))
    eq = first["at_equal_compute"]
    lines += [
        "",
        f"Accuracy: final values (mean ± std over seeds, at the last common evaluation), and "
        f"pass@1 interpolated at equal compute — {eq['generated_tokens']['budget']:,.0f} "
        f"tokens, {eq['seconds']['budget']:,.1f} {seconds_label}, "
        f"{eq['cost_units']['budget']:,.0f} cost units (the smaller arm's total).",
        "",
        f"| arm | final pass@1 | final pass@{first['k']} | final entropy | pass@1 at equal "
        f"tokens | at equal seconds | at equal cost units | measured μ |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, a in result["arms"].items():
        f1, fk, fe = a["final_pass1"], a["final_pass_at_k"], a["final_entropy"]
        eqa = a["at_equal_compute"]
        lines.append(
            f"| {arm} | {_pm(f1)} | {_pm(fk)} | {_pm(fe)} | "
            f"{_fmt(eqa['generated_tokens']['pass1'], '.3f')} | "
            f"{_fmt(eqa['seconds']['pass1'], '.3f')} | "
            f"{_fmt(eqa['cost_units']['pass1'], '.3f')} | {_fmt(a['measured_mu'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


NR = "not reached"


def _pm(s: dict[str, float | None]) -> str:
    if s["mean"] is None:
        return "-"
    return f"{s['mean']:.3f} ± {s['std']:.3f}"
