"""The statistics of replay arms against on-policy: a lineage's accuracy curve and its compute
axes, an arm's median curve over seeds, per-seed paired ratios with exact sign and Wilcoxon
tests, three crossing rules, accuracy at equal compute on a lightly smoothed curve, the
measured μ and (from 8 seeds) the bootstrap confidence interval of a compute ratio. Pure
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
curve is, at each evaluated iteration common to its seeds, the median accuracy over seeds
(band: 25th–75th percentile, linear interpolation between order statistics) against the
median cumulative compute. Its last point is exactly the median final accuracy. The
accuracy is greedy pass@1 unless the reader chose another metric (`METRICS`).

The evidence comes first and is per seed (`paired_test`): a seed fixes the warm start and
the data order that both arms share, so for each seed the ratio (arm's compute to the
target) / (on-policy's), a seed that never reached it counting as an infinite ratio, is one
paired observation. Over n seeds: the median ratio, how many are below 1, an exact
two-sided sign test (`sign_test`) and an exact Wilcoxon signed-rank test on the log ratios
(`wilcoxon_signed_rank`), both exact enumerations at any n (no scipy).

"Compute to reach the target" depends on the crossing rule, so three are reported side by
side: the first evaluation at or above the target (`first_reach`), the first from which the
curve stays at or above it to the end (`sustained_reach`), and, per seed, the first at or
above 98 % of that seed's own best (`compute_to_fraction_of_best`, the paper's Figs. 3, 13,
14). First and sustained apply to each seed and to the median curve. No interpolation
between evaluations (a checkpoint is known to reach the target only once it has been
evaluated). The default target is the on-policy arm's final median accuracy. The median
curve's ratio arm / on-policy splits exactly into (cost per iteration ratio) ×
(iterations-to-target ratio).

Accuracy "at equal compute" is read on the median curve smoothed by a centred moving
average of 3 evaluations (`moving_average`), so a one-evaluation dip does not decide it;
the unsmoothed value is kept beside it.

The median-curve ratio's confidence interval is a percentile bootstrap over seeds
(`bootstrap`), computed only from `BOOTSTRAP_MIN_SEEDS` = 8 seeds per arm: with n = 5 a
bootstrap has at most C(9, 5) = 126 distinct resamples of a statistic that jumps between
evaluations, whose percentiles are a few atoms rather than an interval. Where it runs:
resample each arm's seeds with replacement (the same seeds for every arm when all arms ran
the same seeds), recompute the whole statistic (the median curves, the default target from
the resampled on-policy finals, the first reach) and take the 2.5th and 97.5th percentiles
of the ratios. A resample whose arm median never reaches the target counts as an infinite
ratio, one where only on-policy misses (a given target) as 0; one where both miss is
undefined and left out, its share reported. The RNG is seeded, so a report is reproducible.

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
# Below 8 seeds no bootstrap interval is computed: with n = 5 a percentile bootstrap has at
# most C(2n - 1, n) = 126 distinct resamples of a statistic (a first crossing) that jumps
# between evaluations, so its 2.5th and 97.5th percentiles are a handful of atoms, not an
# interval with 95 % coverage. The paired per-seed tests are exact at any n instead.
BOOTSTRAP_MIN_SEEDS = 8
# The accuracy metric a comparison reads (`replayrl compare --metric`): name -> its label.
METRICS = {
    "pass1": "greedy pass@1",
    "pass1_sampled": "sampled pass@1 (eval.pass1_temperature)",
    "pass_at_k": "pass@k",
}
FRACTION_OF_BEST = 0.98  # the paper's "compute to 98 % of best" (Figs. 3, 13, 14)
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
    # The same on the device's clock (CUDA events; `cumulative/device_seconds`), when the
    # lineage ran on a GPU and logged it.
    device_clock: dict | None = None
    # Wall clock of the lineage at each evaluated iteration (cumulative/wall_seconds: the end
    # of the iteration, or the publication of the evaluated weights); () when not logged.
    wall_seconds: tuple[float, ...] = ()
    # The last value of every metric of the lineage's run (e.g. async/gamma).
    last: Mapping[str, float] = field(default_factory=dict)

    def on_cpu_clock(self) -> LineageCurve:
        """This curve with its measured seconds (and the μ they give) on the CPU clock."""
        if self.cpu_clock is None:
            raise ValueError(f"lineage {self.lineage} has no CPU clock")
        return replace(self, **self.cpu_clock, cpu_clock=None, device_clock=None)

    def on_device_clock(self) -> LineageCurve:
        """This curve with its measured seconds (and the μ they give) on the device clock."""
        if self.device_clock is None:
            raise ValueError(f"lineage {self.lineage} has no device clock")
        return replace(self, **self.device_clock, cpu_clock=None, device_clock=None)

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
    peak_pass_at_k: tuple[float, ...] = ()  # per seed, the best over its common evaluations

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
        peak_pass_at_k=tuple(
            _nanmax(c.pass_at_k[idx[t]] for t in common)
            for c, idx in zip(curves, index, strict=True)
        ),
    )


def _nanmax(values) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


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


# ---------------------------------------------------------------- paired tests over seeds
#
# A seed fixes the warm start and the data order both arms share, so the honest unit of
# evidence is the seed: per seed, the arm's compute to the target over on-policy's. With n
# seeds the exact null distributions below are small enumerations; no normal approximation
# and no scipy (not a dependency).


def sign_test(ratios: Sequence[float]) -> dict[str, float | int]:
    """Exact two-sided sign test of "a ratio is as likely above 1 as below": ratios equal to 1
    are ties and dropped; p = min(1, 2·P(X ≤ min(below, above))), X ~ Binomial(n, 1/2).

    >>> sign_test([0.5, 0.8, 0.9, 0.7, 1.2])["p"], sign_test([0.5] * 5)["p"]
    (0.375, 0.0625)
    """
    below = sum(1 for r in ratios if r < 1)
    above = sum(1 for r in ratios if r > 1)
    n = below + above
    tail = sum(math.comb(n, i) for i in range(min(below, above) + 1)) / 2**n
    return {
        "n": n,
        "below": below,
        "above": above,
        "ties": len(ratios) - n,
        "p": min(1.0, 2 * tail),
    }


def _log_ratio(r: float) -> float:
    if r == 0:
        return -math.inf  # the baseline never reached the target, the arm did
    return math.log(r)  # inf for an arm that never reached it


def wilcoxon_signed_rank(ratios: Sequence[float]) -> dict[str, float | int]:
    """Exact two-sided Wilcoxon signed-rank test of "log(ratio) is symmetric about 0".

    d = log(ratio); d = 0 is dropped (Wilcoxon's convention); |d| is ranked with mid-ranks
    for ties (an infinite ratio, a seed that never reached the target, ranks above every
    finite one); W+ = the sum of the ranks of d > 0. Its exact null distribution (each sign
    equally likely, independently) is enumerated on doubled ranks, which are integers even
    with mid-ranks: p = min(1, 2·min(P(W+ ≤ w), P(W+ ≥ w))).

    >>> wilcoxon_signed_rank([0.5, 0.8, 0.9, 0.7, 1.2])  # W+ = rank of 1.2 = 2; 3 of 32 ≤ 2
    {'n': 5, 'w_plus': 2.0, 'p': 0.1875}
    """
    d = [_log_ratio(r) for r in ratios if r != 1]
    order = sorted(range(len(d)), key=lambda i: abs(d[i]))
    doubled = [0] * len(d)  # 2 × rank, mid-ranks for ties
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and abs(d[order[j + 1]]) == abs(d[order[i]]):
            j += 1
        for k in range(i, j + 1):
            doubled[order[k]] = (i + 1) + (j + 1)
        i = j + 1
    w2 = sum(r for r, x in zip(doubled, d, strict=True) if x > 0)
    counts = [1] + [0] * sum(doubled)  # counts[s]: sign patterns whose doubled W+ is s
    for r in doubled:
        counts = [c + (counts[s - r] if s >= r else 0) for s, c in enumerate(counts)]
    total = 2 ** len(d)
    low, high = sum(counts[: w2 + 1]) / total, sum(counts[w2:]) / total
    return {"n": len(d), "w_plus": w2 / 2, "p": min(1.0, 2 * min(low, high))}


def paired_ratios(
    arm_to: Mapping[int, float | None], base_to: Mapping[int, float | None]
) -> list[tuple[int, float]]:
    """(seed, arm / on-policy compute to target) for every seed both arms ran, with None
    meaning "never reached": arm never -> inf, only on-policy never -> 0, both at the warm
    start -> 1; a seed where neither reached the target says nothing and is left out.

    >>> paired_ratios({0: 10.0, 1: None, 2: 5.0, 3: None}, {0: 20.0, 1: 5.0, 2: None, 3: None})
    [(0, 0.5), (1, inf), (2, 0.0)]
    """
    out = []
    for seed in sorted(set(arm_to) & set(base_to)):
        a, b = arm_to[seed], base_to[seed]
        r = censored_ratio(
            np.array([math.inf if a is None else a]), np.array([math.inf if b is None else b])
        )[0]
        if not math.isnan(r):
            out.append((seed, float(r)))
    return out


def paired_test(arm_to: Mapping[int, float | None], base_to: Mapping[int, float | None]) -> dict:
    """Per-seed paired ratios with their median, the sign test and the Wilcoxon test.
    Infinite ratios are kept as None in `ratios` (JSON has no infinity); `median` is None
    when it falls on a seed that never reached the target."""
    pairs = paired_ratios(arm_to, base_to)
    ratios = [r for _, r in pairs]
    common = set(arm_to) & set(base_to)
    return {
        "seeds": [s for s, _ in pairs],
        "ratios": [None if math.isinf(r) else r for r in ratios],
        "undefined_seeds": len(common) - len(pairs),  # neither arm reached the target
        "median": censored_summary(ratios)["median"],
        "sign": sign_test(ratios),
        "wilcoxon": wilcoxon_signed_rank(ratios),
    }


# ---------------------------------------------------------------- crossing rules


def sustained_reach_index(accuracy: Sequence[float], target: float) -> int | None:
    """Index of the first evaluation from which every later one is at or above `target`
    (the curve crosses and stays); None if the last evaluation is below it.

    >>> sustained_reach_index([0.2, 0.5, 0.3, 0.5, 0.6], 0.45)
    3
    """
    index = None
    for i in range(len(accuracy) - 1, -1, -1):
        if accuracy[i] < target - _EPS:
            break
        index = i
    return index


def sustained_reach(
    compute: Sequence[float], accuracy: Sequence[float], target: float
) -> float | None:
    """Compute at `sustained_reach_index`; None if the curve ends below the target."""
    i = sustained_reach_index(accuracy, target)
    return None if i is None else compute[i]


def compute_to_fraction_of_best(
    compute: Sequence[float], accuracy: Sequence[float], fraction: float = 0.98
) -> float | None:
    """Compute at the first evaluation where accuracy reaches `fraction` × the best accuracy
    of the same curve (the paper's "compute to 98 % of best", Figs. 3, 13, 14: one seed's
    curve, its own best); None when the curve has no finite value.

    >>> compute_to_fraction_of_best([0, 10, 20, 30], [0.2, 0.395, 0.40, 0.30])  # 0.98 × 0.40 = 0.392
    10
    """
    finite = [a for a in accuracy if math.isfinite(a)]
    if not finite:
        return None
    return first_reach(compute, accuracy, fraction * max(finite))


SMOOTHING_WINDOW = 3


def moving_average(values: Sequence[float], window: int = SMOOTHING_WINDOW) -> list[float]:
    """Centred moving average over `window` (odd) evaluations; at either end the window
    shrinks to the evaluations that exist (the first value averages itself and its one
    neighbour for window 3). Light smoothing, so one noisy evaluation does not decide a value
    read between evaluations.

    >>> moving_average([0.32, 0.234, 0.305, 0.30])
    [0.277, 0.28633333333333333, 0.2796666666666667, 0.3025]
    """
    half = window // 2
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half) : i + half + 1]
        out.append(sum(part) / len(part))
    return out
