"""The statistics of replay arms against on-policy: a lineage's accuracy curve and its compute
axes, an arm's median curve over seeds, the first reach of a target, accuracy at equal
compute, the measured μ and the bootstrap confidence interval of a compute ratio. Pure
arithmetic on numbers already read from the tracker.

Compute is measured on these axes, each cumulative from the warm start (iteration 0):

- `generated_tokens`: completion tokens sampled (the inference work);
- `seconds`: measured generation + training seconds on the machine that ran the lineage:
  wall-clock GPU-seconds on a GPU; on a CPU machine the process-CPU clock (user + system,
  all threads) when every lineage logged it, so a comparison run while other jobs share the
  machine still measures the method, else wall seconds (the caller labels which);
- `cost_units`: modelled cost in units of one rollout's training cost,
  `cost = μ · (rollouts generated) + (rollouts trained on)`, with the experiment's OWN μ:
  the median over its lineages of (generation seconds per rollout generated) / (training
  seconds per rollout trained on), read from their ledgers. One price for every arm, since
  μ belongs to the hardware and the rollout length, not to the arm. Per iteration that is
  μ·R + S·B, the paper's C = (B + μR)·T summed over T gradient steps (S steps share one
  iteration's R: the same total);
- `cost_units_what_if` (only when a what-if μ is given, e.g. 5.3, near the paper's 5.28
  measured for Qwen2.5-7B on long math solutions, §3.2): the same formula at that μ, reported BESIDE the own-μ axis and
  labelled "what-if", never in its place.

Statistics follow the paper (median and inter-quartile range over ≥ 4 seeds, §5.1). Seeds of an
arm are aligned by iteration: every seed evaluates at the same iterations, so the arm's
curve is, at each evaluated iteration common to its seeds, the median pass@1 over seeds
(band: 25th–75th percentile, linear interpolation between order statistics) against the
median cumulative compute. Its last point is exactly the median final pass@1.

"Compute to reach the target" is the arm's median compute at the first evaluated iteration
where its median pass@1 is at or above the target: no interpolation between evaluations (a
checkpoint is known to reach the target only once it has been evaluated). The default
target is the on-policy arm's final median pass@1, which the on-policy median curve reaches
by construction (at its last evaluation at the latest). The ratio arm / on-policy splits
exactly into (cost per iteration ratio) × (iterations-to-target ratio), where an arm's cost
per iteration is its compute to target over its iterations to target.

The ratio's confidence interval is a percentile bootstrap over seeds (`bootstrap`): resample
each arm's seeds with replacement (the same seeds for every arm when all arms ran the same
seeds: a seed fixes the warm start and data order both arms share), recompute the whole
statistic (the median curves, the default target from the resampled on-policy finals, the
first reach) and take the 2.5th and 97.5th percentiles of the ratios. A resample whose arm
median never reaches the target counts as an infinite ratio (the arm needed more than it
spent), one where only on-policy misses (a given target) as 0; one where both miss is
undefined and left out, its share reported. So "not reached" widens the interval instead of
silently dropping out, and an upper bound of ∞ says the arm missed the target in more than
2.5 % of resamples. The RNG is seeded, so a report is reproducible.

`replayrl.experiments.arms` assembles these into the comparison of the arms (the result dict)
and `replayrl.experiments.report` renders it as Markdown; this module knows nothing about
MLflow, files or plots: `replayrl.experiments.compare` reads and writes those.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from replayrl.errors import ReplayRLError

# Generation/training cost per rollout: the paper measured 5.28 for Qwen2.5-7B and 6.84 for
# Qwen3-0.6B on long math solutions (§3.2).
PAPER_MU = 5.3
BASE_AXES = ("generated_tokens", "seconds", "cost_units")
WHAT_IF_AXIS = "cost_units_what_if"
AXES = (*BASE_AXES, WHAT_IF_AXIS)  # every axis a result may hold; result["axes"] says which
BASELINE_ARM = "on-policy"
# The third arm, replay with δ = 0 (`buffer.positive_bias=0`), separates replay's effect
# from positive-bias retention's.
ARM_ORDER = ("on-policy", "replay", "replay-plain")
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CI_LEVEL = 0.95
PAPER_MIN_SEEDS = 4  # the paper reports median and IQR over at least 4 seeds (§5.1)
_EPS = 1e-12  # a float equal to the target counts as reaching it


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
    # The same seconds and totals on the process-CPU clock (keys `seconds`,
    # `generation_seconds_total`, `training_seconds_total`), when the lineage logged it.
    cpu_clock: dict | None = None
    # Wall clock of the lineage at each evaluated iteration (cumulative/wall_seconds: the end
    # of the iteration, or the publication of the evaluated weights); () when not logged.
    wall_seconds: tuple[float, ...] = ()
    # The last value of every metric of the lineage's run (e.g. async/gamma).
    last: Mapping[str, float] = field(default_factory=dict)

    def on_cpu_clock(self) -> LineageCurve:
        """This curve with its measured seconds (and the μ they give) on the CPU clock."""
        if self.cpu_clock is None:
            raise ValueError(f"lineage {self.lineage} has no CPU clock")
        return replace(self, **self.cpu_clock, cpu_clock=None)

    def axis(self, name: str, *, mu: float) -> tuple[float, ...]:
        """Cumulative compute on one axis; both cost-unit axes use the `mu` given."""
        if name in ("cost_units", WHAT_IF_AXIS):
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


def own_mu(curves: Sequence[LineageCurve]) -> float | None:
    """The experiment's own μ: the median over its lineages of their measured μ."""
    mus = [m for m in map(measured_mu, curves) if m is not None]
    return statistics.median(mus) if mus else None


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile with linear interpolation between order statistics (numpy's default,
    R's type 7): q = 0.5 is the median, 0.25 and 0.75 bound the inter-quartile range.

    >>> quantile([1, 2, 3, 5], 0.25), quantile([1, 2, 3, 5], 0.5)
    (1.75, 2.5)
    """
    if not values:
        raise ValueError("quantile of no values")
    return float(np.quantile(np.asarray(values, dtype=float), q))


def summary(values: Sequence[float]) -> dict[str, float | None]:
    """Median, IQR bounds (q25, q75), min and max of the finite values; None if there are none.

    >>> summary([0.2, 0.4, 0.3, 0.9])["median"], summary([0.2, 0.4, 0.3, 0.9])["q75"]
    (0.35, 0.525)
    """
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return dict.fromkeys(("median", "q25", "q75", "min", "max"))
    return {
        "median": quantile(finite, 0.5),
        "q25": quantile(finite, 0.25),
        "q75": quantile(finite, 0.75),
        "min": min(finite),
        "max": max(finite),
    }


def censored_summary(values: Sequence[float]) -> dict[str, float | None]:
    """Median and IQR bounds (q25, q75) where +inf counts (e.g. a lineage that never reached
    a target: above every finite value), None where the quantile falls on +inf; and n.

    >>> censored_summary([10.0, 20.0, math.inf])["median"], censored_summary([1.0, math.inf])["q75"]
    (20.0, None)
    """
    if not values:
        return {"median": None, "q25": None, "q75": None, "n": 0}
    big = 1e300  # stands for +inf in the interpolation; nothing finite comes near it
    ordered = [big if math.isinf(v) else v for v in values]

    def q(x: float) -> float | None:
        v = quantile(ordered, x)
        return None if v >= big / 10 else v

    return {"median": q(0.5), "q25": q(0.25), "q75": q(0.75), "n": len(values)}


@dataclass(frozen=True)
class ArmCurve:
    """An arm's seeds aligned by evaluated iteration: the per-seed matrices (seeds ×
    iterations, seeds in increasing order) and their median curve with the IQR band."""

    arm: str
    seeds: tuple[int, ...]
    lineages: tuple[str, ...]
    iterations: tuple[int, ...]
    pass1_by_seed: np.ndarray  # (seeds, iterations)
    compute_by_seed: dict[str, np.ndarray]  # axis -> (seeds, iterations), cumulative
    final_pass_at_k: tuple[float, ...]  # per seed, at the last common iteration
    final_entropy: tuple[float, ...]
    k: int

    @property
    def compute(self) -> dict[str, tuple[float, ...]]:
        """axis -> median cumulative compute over seeds per iteration."""
        return {a: tuple(np.median(m, axis=0).tolist()) for a, m in self.compute_by_seed.items()}

    @property
    def pass1_median(self) -> tuple[float, ...]:
        return tuple(np.median(self.pass1_by_seed, axis=0).tolist())

    @property
    def pass1_q25(self) -> tuple[float, ...]:
        return tuple(np.quantile(self.pass1_by_seed, 0.25, axis=0).tolist())

    @property
    def pass1_q75(self) -> tuple[float, ...]:
        return tuple(np.quantile(self.pass1_by_seed, 0.75, axis=0).tolist())

    @property
    def final_pass1(self) -> tuple[float, ...]:
        return tuple(self.pass1_by_seed[:, -1].tolist())


def arm_curve(curves: Sequence[LineageCurve], *, mus: Mapping[str, float]) -> ArmCurve:
    """`mus`: cost axis -> its μ, e.g. {"cost_units": 0.5, "cost_units_what_if": 5.3}."""
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

    def matrix(values_of) -> np.ndarray:
        return np.array(
            [[values_of(c)[idx[t]] for t in common] for c, idx in zip(curves, index, strict=True)],
            dtype=float,
        )

    axes = ["generated_tokens", "seconds", "rollouts_trained", *mus]
    last = [idx[common[-1]] for idx in index]
    return ArmCurve(
        arm=curves[0].arm,
        seeds=tuple(c.seed for c in curves),
        lineages=tuple(c.lineage for c in curves),
        iterations=tuple(common),
        pass1_by_seed=matrix(lambda c: c.pass1),
        compute_by_seed={a: matrix(lambda c, a=a: c.axis(a, mu=mus.get(a, 0.0))) for a in axes},
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
        if y >= target - _EPS:
            return x
    return None


def first_reach_index(pass1: Sequence[float], target: float) -> int | None:
    """Index of the first evaluation whose pass@1 is at or above `target`; None if never.

    >>> first_reach_index([0.2, 0.3, 0.5, 0.4], 0.45)
    2
    """
    return next((i for i, p in enumerate(pass1) if p >= target - _EPS), None)


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


# ---------------------------------------------------------------- the bootstrap


def _reach(pass1: np.ndarray, compute: np.ndarray, target: np.ndarray):
    """Per resample (rows): the index of the first evaluation at or above the target and
    the compute there (inf where never reached). pass1, compute: (resamples, iterations)."""
    hit = pass1 >= target[:, None] - _EPS
    first = hit.argmax(axis=1)
    at = np.take_along_axis(compute, first[:, None], axis=1)[:, 0]
    return first, np.where(hit.any(axis=1), at, np.inf)


def censored_ratio(arm: np.ndarray, base: np.ndarray) -> np.ndarray:
    """arm / base compute to target, inf meaning "never reached": arm never -> inf, only
    the base never -> 0, both never -> nan (undefined), both at the warm start (0) -> 1.

    >>> censored_ratio(np.array([10, np.inf, 5, np.inf, 0]), np.array([20, 5, np.inf, np.inf, 0]))
    array([0.5, inf, 0. , nan, 1. ])
    """
    arm, base = np.asarray(arm, dtype=float), np.asarray(base, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = arm / base
    out = np.where(np.isinf(arm) & np.isfinite(base), np.inf, out)
    out = np.where(np.isfinite(arm) & np.isinf(base), 0.0, out)
    out = np.where(np.isinf(arm) & np.isinf(base), np.nan, out)
    return np.where((arm == 0) & (base == 0), 1.0, out)


def percentile_interval(values: np.ndarray, level: float = CI_LEVEL) -> tuple[float, float]:
    """Percentile interval by order statistics (no interpolation, so an infinite ratio is
    kept as a bound, not turned into nan): the ceil(n·a)-th and ceil(n·(1 - a))-th smallest
    of n values, a = (1 - level)/2.

    >>> percentile_interval(np.arange(1, 41.0))
    (1.0, 39.0)
    """
    v = np.sort(np.asarray(values, dtype=float))
    n, a = len(v), (1 - level) / 2
    lo = v[max(math.ceil(n * a - 1e-9) - 1, 0)]  # 1e-9: 40 · 0.025 is 1.0000000000000002
    hi = v[min(math.ceil(n * (1 - a) - 1e-9) - 1, n - 1)]
    return float(lo), float(hi)


def bootstrap(
    arms: Mapping[str, ArmCurve],
    *,
    axes: Sequence[str],
    target: float | None,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = CI_LEVEL,
) -> dict:
    """Percentile bootstrap over seeds of each non-baseline arm's compute ratio to target
    (see the module docstring). `target` None = the resampled on-policy final median.

    Returns {"resamples", "seed", "level", "paired", "arms": {arm: {axis: {"low", "high",
    "fraction_below_1", "undefined_fraction"}, "arm_reached_fraction",
    "on_policy_reached_fraction"}}}; a bound is None where it is infinite (the arm's median
    missed the target in more than (1 - level)/2 of the resamples)."""
    base = arms[BASELINE_ARM]
    rng = np.random.default_rng(seed)
    paired = len({a.seeds for a in arms.values()}) == 1
    shared = rng.integers(0, len(base.seeds), size=(resamples, len(base.seeds)))
    draws = {}
    for name, a in arms.items():  # baseline first: ARM_ORDER
        n = len(a.seeds)
        draws[name] = shared if paired else rng.integers(0, n, size=(resamples, n))

    def medians(a: ArmCurve, idx: np.ndarray, m: np.ndarray) -> np.ndarray:
        return np.median(m[idx], axis=1)  # (resamples, seeds, iterations) -> (resamples, it.)

    base_pass1 = medians(base, draws[BASELINE_ARM], base.pass1_by_seed)
    targets = base_pass1[:, -1] if target is None else np.full(resamples, float(target))
    out = {"resamples": resamples, "seed": seed, "level": level, "paired": paired, "arms": {}}
    base_to = {}
    for axis in axes:
        _, base_to[axis] = _reach(
            base_pass1, medians(base, draws[BASELINE_ARM], base.compute_by_seed[axis]), targets
        )
    for name, a in arms.items():
        if name == BASELINE_ARM:
            continue
        pass1 = medians(a, draws[name], a.pass1_by_seed)
        entry: dict = {}
        for axis in axes:
            _, arm_to = _reach(pass1, medians(a, draws[name], a.compute_by_seed[axis]), targets)
            ratios = censored_ratio(arm_to, base_to[axis])
            defined = ratios[~np.isnan(ratios)]
            lo, hi = percentile_interval(defined, level) if len(defined) else (math.nan,) * 2
            entry[axis] = {
                "low": lo if math.isfinite(lo) else None,
                "high": hi if math.isfinite(hi) else None,
                "fraction_below_1": float(np.mean(defined < 1)) if len(defined) else None,
                "undefined_fraction": float(np.mean(np.isnan(ratios))),
            }
            entry["arm_reached_fraction"] = float(np.mean(np.isfinite(arm_to)))
        entry["on_policy_reached_fraction"] = float(np.mean(np.isfinite(base_to[axes[0]])))
        out["arms"][name] = entry
    return out


def compute_to_fraction_of_best(
    compute: Sequence[float], accuracy: Sequence[float], fraction: float = 0.98
) -> float | None:
    """One seed's compute at its first evaluation whose accuracy reaches `fraction` × its own
    best accuracy (the paper's "compute to 98 % of best", Figs. 13, 14); None when it has no
    finite accuracy. No interpolation between evaluations, as in `first_reach`.

    >>> compute_to_fraction_of_best([0, 10, 20, 30], [0.2, 0.49, 0.5, 0.4])
    10
    """
    if len(compute) != len(accuracy):
        raise ValueError("compute and accuracy must be aligned, one value per evaluation")
    finite = [a for a in accuracy if math.isfinite(a)]
    if not finite:
        return None
    target = fraction * max(finite)
    for c, a in zip(compute, accuracy, strict=True):
        if math.isfinite(a) and a >= target - _EPS:
            return c
    return None  # unreachable: the best itself reaches it
