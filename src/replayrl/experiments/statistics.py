"""Replay arms against on-policy: accuracy curves per arm, compute to reach a target, its
bootstrap confidence interval and split, accuracy at equal compute. Pure arithmetic on
numbers already read from the tracker.

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

Knows nothing about MLflow, files or plots; `replayrl.experiments.compare` reads and writes those.
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


_IGNORED_PREFIXES = ("storage.", "tracking.", "kubernetes.", "model.cache_dir")


def config_differences(params: Sequence[dict[str, str]]) -> list[str]:
    """Config keys whose values differ between lineages of one arm (seeds, iterations and
    where results are stored aside): an arm mixing configs cannot be summarised."""
    keys = set().union(*(p.keys() for p in params)) if params else set()
    return sorted(
        k
        for k in keys
        if k not in ("seed", "iterations")
        and not k.startswith(_IGNORED_PREFIXES)
        and len({p.get(k) for p in params}) > 1
    )


def arm_config_differences(
    params_by_arm: Mapping[str, Sequence[dict[str, str]]],
) -> dict[str, dict[str, str]]:
    """EVERY config key whose value differs between arms -> {arm: its value}, all of them, so
    a reader sees exactly what the comparison varies. Skipped: `seed`, `arm` (the arm's
    name) and where results are stored or tracked. An arm whose seeds ran different
    `iterations` shows them joined by "/"; a key an arm lacks shows "(unset)".

    >>> arm_config_differences({"on-policy": [{"buffer.capacity": "256", "train.lr": "1e-4"}],
    ...                         "replay": [{"buffer.capacity": "512", "train.lr": "1e-4"}]})
    {'buffer.capacity': {'on-policy': '256', 'replay': '512'}}
    """
    values: dict[str, dict[str, str]] = {}
    for arm, params in params_by_arm.items():
        for key in set().union(*(p.keys() for p in params)) if params else ():
            if key in ("seed", "arm") or key.startswith(_IGNORED_PREFIXES):
                continue
            seen = sorted({str(p.get(key, "(unset)")) for p in params})
            values.setdefault(key, {})[arm] = "/".join(seen)
    for by_arm in values.values():
        for arm in params_by_arm:
            by_arm.setdefault(arm, "(unset)")
    return {
        key: {arm: by_arm[arm] for arm in params_by_arm}
        for key, by_arm in sorted(values.items())
        if len(set(by_arm.values())) > 1
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


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


# ---------------------------------------------------------------- the comparison


def own_mu(curves: Sequence[LineageCurve]) -> float | None:
    """The experiment's own μ: the median over its lineages of their measured μ."""
    mus = [m for m in map(measured_mu, curves) if m is not None]
    return statistics.median(mus) if mus else None


def compare(
    curves: Sequence[LineageCurve],
    *,
    target: float | None = None,
    what_if_mu: float | None = PAPER_MU,
    params: Mapping[str, dict[str, str]] | None = None,
    resamples: int = BOOTSTRAP_RESAMPLES,
    bootstrap_seed: int = BOOTSTRAP_SEED,
) -> dict:
    """The comparison as a JSON-ready dict (see the module docstring for each quantity).

    `target`: pass@1 to reach; None = the on-policy arm's final median pass@1. Ratios are
    arm / on-policy, so below 1 means the arm needed less compute than on-policy.
    `what_if_mu`: a μ to show beside the measured one (None: none). `params`: lineage ->
    its flattened config, for the config keys that differ between arms."""
    if what_if_mu is not None and (what_if_mu < 0 or not math.isfinite(what_if_mu)):
        raise ReplayRLError(
            f"The what-if μ must be a finite number >= 0, got {what_if_mu}; the paper measured 5.28 and 6.84 (§3.2)."
        )
    groups = group_by_arm(curves)
    if not groups:
        raise ReplayRLError(
            "No lineage runs (runs tagged with `arm` and `lineage`) in this experiment: run "
            "the arms first, e.g. `replayrl experiment --config configs/tiny-cpu.yaml`."
        )
    mu = own_mu(curves)
    if mu is None:
        raise ReplayRLError(
            "No lineage of this experiment has generation and training seconds in its compute "
            "ledger, so its own μ cannot be measured: run at least one iteration with replayrl."
        )
    mus = {"cost_units": mu, **({WHAT_IF_AXIS: what_if_mu} if what_if_mu is not None else {})}
    axes = [*BASE_AXES, *([WHAT_IF_AXIS] if what_if_mu is not None else [])]
    arms = {arm: arm_curve(cs, mus=mus) for arm, cs in groups.items()}
    baseline = arms.get(BASELINE_ARM)
    if target is None:
        if baseline is None:
            raise ReplayRLError(
                "No on-policy lineage in this experiment, so there is no default target: run "
                "the on-policy arm (--arm on-policy) or pass --target ACC."
            )
        target = quantile(baseline.final_pass1, 0.5)
        target_source = "on-policy final median pass@1"
        given = None
    else:
        target_source = "given"
        given = target
    medians = {arm: (a.compute, a.pass1_median) for arm, a in arms.items()}
    finals = {arm: {axis: medians[arm][0][axis][-1] for axis in axes} for arm in arms}
    budgets = {axis: min(f[axis] for f in finals.values()) for axis in axes}
    reach_index = {
        arm: next((i for i, p in enumerate(pass1) if p >= target - _EPS), None)
        for arm, (_, pass1) in medians.items()
    }
    to_target = {
        arm: {axis: None if i is None else medians[arm][0][axis][i] for axis in axes}
        for arm, i in reach_index.items()
    }
    iterations_to_target = {
        arm: None if i is None else arms[arm].iterations[i] for arm, i in reach_index.items()
    }
    boot = (
        bootstrap(arms, axes=axes, target=given, resamples=resamples, seed=bootstrap_seed)
        if baseline is not None and len(arms) > 1
        else None
    )
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
                        axis: first_reach(c.axis(axis, mu=mus.get(axis, 0.0)), c.pass1, target)
                        for axis in axes
                    },
                }
            )
        arm_mus = [s["measured_mu"] for s in per_seed if s["measured_mu"] is not None]
        base_to = to_target.get(BASELINE_ARM, {})
        base_iters = iterations_to_target.get(BASELINE_ARM)
        out_arms[arm] = {
            "seeds": list(a.seeds),
            "lineages": list(a.lineages),
            "final_iteration": a.iterations[-1],
            "final_pass1": summary(a.final_pass1),
            "final_pass_at_k": summary(a.final_pass_at_k),
            "k": a.k,
            "final_entropy": summary(a.final_entropy),
            "final_compute": finals[arm],
            "measured_mu": statistics.median(arm_mus) if arm_mus else None,
            "iterations_to_target": iterations_to_target[arm],
            "to_target": to_target[arm],
            "ratio_to_on_policy": {
                axis: _ratio(to_target[arm][axis], base_to.get(axis)) for axis in axes
            },
            "ratio_split": {
                axis: split(
                    to_target[arm][axis],
                    iterations_to_target[arm],
                    base_to.get(axis),
                    base_iters,
                )
                for axis in axes
            },
            "ratio_ci": (boot["arms"].get(arm) if boot else None),
            "rollouts_trained_to_target": first_reach(
                a.compute["rollouts_trained"], a.pass1_median, target
            ),
            "at_equal_compute": {
                axis: {
                    "budget": budgets[axis],
                    "pass1": _none_if_nan(value_at(a.compute[axis], a.pass1_median, budgets[axis])),
                }
                for axis in axes
            },
            "per_seed": per_seed,
        }
    by_arm_params = (
        {arm: [params.get(c.lineage, {}) for c in cs] for arm, cs in groups.items()}
        if params
        else {}
    )
    return {
        "target_pass1": target,
        "target_source": target_source,
        "axes": axes,
        "mu_own": mu,
        "mu_what_if": what_if_mu,
        "statistics": {
            "center": "median over seeds",
            "band": "inter-quartile range (25th-75th percentile, linear interpolation)",
            "ci": {k: v for k, v in (boot or {}).items() if k != "arms"} or None,
        },
        "config_differences": arm_config_differences(by_arm_params),
        "arms": out_arms,
        "curves": {
            arm: {
                "iterations": list(a.iterations),
                **{axis: list(a.compute[axis]) for axis in axes},
                "pass1_median": list(a.pass1_median),
                "pass1_q25": list(a.pass1_q25),
                "pass1_q75": list(a.pass1_q75),
            }
            for arm, a in arms.items()
        },
    }


def split(
    arm_to: float | None, arm_iters: int | None, base_to: float | None, base_iters: int | None
) -> dict[str, float] | None:
    """ratio = (cost per iteration ratio) × (iterations-to-target ratio), where an arm's cost
    per iteration is its compute to target over its iterations to target. None when either
    arm misses the target or reaches it at the warm start (no iteration to divide by).

    >>> split(300.0, 20, 600.0, 30)
    {'per_iteration': 0.75, 'iterations': 0.6666666666666666}
    """
    if None in (arm_to, arm_iters, base_to, base_iters) or 0 in (arm_iters, base_iters):
        return None
    if base_to <= 0:
        return None
    return {
        "per_iteration": (arm_to / arm_iters) / (base_to / base_iters),
        "iterations": arm_iters / base_iters,
    }


def _none_if_nan(v: float) -> float | None:
    return None if math.isnan(v) else v


# ---------------------------------------------------------------- the report

NR = "not reached"


def _fmt(v: float | None, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def axis_label(axis: str, result: dict, seconds_label: str) -> str:
    if axis == "generated_tokens":
        return "tokens"
    if axis == "seconds":
        return seconds_label
    if axis == "cost_units":
        return f"cost units (own μ = {result['mu_own']:.2f})"
    return f"cost units (what-if μ = {result['mu_what_if']:g})"


def _ci(ci: dict | None) -> str:
    if not ci or ci["low"] is None and ci["high"] is None and ci.get("fraction_below_1") is None:
        return "-"
    lo = "∞" if ci["low"] is None else f"{ci['low']:.2f}"
    hi = "∞)" if ci["high"] is None else f"{ci['high']:.2f}]"
    return f"[{lo}, {hi}"


def _iqr(s: dict[str, float | None]) -> str:
    if s["median"] is None:
        return "-"
    return f"{s['median']:.3f} [{s['q25']:.3f}, {s['q75']:.3f}]"


def markdown(result: dict, *, seconds_label: str = "seconds", note: str = "") -> str:
    """The report: target and statistics, compute to target with ratios and their bootstrap
    CI, the split of each ratio, accuracy, and the config keys that differ between arms."""
    target, axes, arms = result["target_pass1"], result["axes"], result["arms"]
    labels = {axis: axis_label(axis, result, seconds_label) for axis in axes}
    n_seeds = sorted({len(a["seeds"]) for a in arms.values()})
    ci = result["statistics"]["ci"]
    target_how = (
        "the on-policy arm's final median pass@1 over its seeds"
        if result["target_source"] != "given"
        else "given"
    )
    lines = [
        f"**Target:** held-out pass@1 = {target:.3f} ({target_how}). An arm reaches it at its "
        f"first evaluation where the median pass@1 over its seeds is at or above it.",
        "",
        f"**Statistics:** {'/'.join(map(str, n_seeds))} seed(s) per arm. Curves and finals are "
        f"medians over seeds with the inter-quartile range [25th, 75th percentile]."
        + (
            f" Ratio CI: {ci['level']:.0%} percentile bootstrap over seeds, {ci['resamples']} "
            f"resamples, RNG seed {ci['seed']}, "
            + ("paired by seed (all arms ran the same seeds)" if ci["paired"] else "per arm")
            + ", recomputing the target and each first reach per resample; a resample whose "
            "arm median misses the target counts as an infinite ratio (an upper bound of ∞)."
            if ci
            else ""
        )
        + (
            f" **Fewer than {PAPER_MIN_SEEDS} seeds:** the IQR and CI are coarse."
            if n_seeds[0] < PAPER_MIN_SEEDS
            else ""
        ),
        "",
        f"**Cost units** = μ·(rollouts generated) + (rollouts trained on), in units of one "
        f"rollout's training cost, at this experiment's own μ = {result['mu_own']:.2f} "
        f"(median over its lineages of generation seconds per rollout / training seconds per "
        f"rollout, from their ledgers)"
        + (
            f"; beside it, what-if μ = {result['mu_what_if']:g}, a hypothetical price (the "
            f"paper measured 5.28 for Qwen2.5-7B on long math solutions, §3.2), not measured here."
            if result["mu_what_if"] is not None
            else "."
        ),
    ]
    if note:
        lines += ["", note]
    lines += [
        "",
        "Compute to first reach the target (median over seeds), ratio = arm / on-policy "
        "(below 1: less compute than on-policy) and its CI:",
        "",
        "| arm | seeds | iterations | "
        + " | ".join(f"{labels[a]} | ratio [CI]" for a in axes)
        + " |",
        "|---|---|---:|" + "---:|---:|" * len(axes),
    ]
    for arm, a in arms.items():
        cells = []
        for axis in axes:
            ratio = _fmt(a["ratio_to_on_policy"][axis], ".2f")
            if a["ratio_ci"] and arm != BASELINE_ARM:
                ratio += f" {_ci(a['ratio_ci'][axis])}"
            spec = ",.1f" if axis == "seconds" else ",.0f"
            cells.append(f"{_fmt(a['to_target'][axis], spec, NR)} | {ratio}")
        lines.append(
            f"| {arm} | {len(a['seeds'])} | {_fmt(a['iterations_to_target'], 'd', NR)} | "
            + " | ".join(cells)
            + " |"
        )
    others = [arm for arm in arms if arm != BASELINE_ARM]
    if BASELINE_ARM in arms and others:
        lines += [
            "",
            "The ratio split: ratio = (cost per iteration ratio) × (iterations-to-target "
            "ratio); P(ratio < 1) and how often each median reaches the target, over the "
            "bootstrap resamples:",
            "",
            "| arm | axis | ratio | = per iteration | × iterations | P(ratio < 1) | "
            "arm reaches | on-policy reaches |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for arm in others:
            a = arms[arm]
            ci_arm = a["ratio_ci"] or {}
            for axis in axes:
                sp = a["ratio_split"][axis] or {}
                c = ci_arm.get(axis) or {}
                lines.append(
                    f"| {arm} | {labels[axis]} | {_fmt(a['ratio_to_on_policy'][axis], '.3f')} | "
                    f"{_fmt(sp.get('per_iteration'), '.3f')} | {_fmt(sp.get('iterations'), '.3f')} "
                    f"| {_fmt(c.get('fraction_below_1'), '.0%')} | "
                    f"{_fmt(ci_arm.get('arm_reached_fraction'), '.0%')} | "
                    f"{_fmt(ci_arm.get('on_policy_reached_fraction'), '.0%')} |"
                )
    first = next(iter(arms.values()))
    eq = first["at_equal_compute"]
    budgets = ", ".join(
        f"{eq[axis]['budget']:,.{1 if axis == 'seconds' else 0}f} {labels[axis]}" for axis in axes
    )
    lines += [
        "",
        f"Accuracy: final values (median [IQR] over seeds, at the last common evaluation), and "
        f"median pass@1 interpolated at equal compute — {budgets} (the smaller arm's total).",
        "",
        f"| arm | final pass@1 | final pass@{first['k']} | final entropy | "
        + " | ".join(f"pass@1 at equal {labels[a]}" for a in axes)
        + " | measured μ |",
        "|---|---:|---:|---:|" + "---:|" * len(axes) + "---:|",
    ]
    for arm, a in arms.items():
        eqa = a["at_equal_compute"]
        lines.append(
            f"| {arm} | {_iqr(a['final_pass1'])} | {_iqr(a['final_pass_at_k'])} | "
            f"{_iqr(a['final_entropy'])} | "
            + " | ".join(_fmt(eqa[axis]["pass1"], ".3f") for axis in axes)
            + f" | {_fmt(a['measured_mu'], '.2f')} |"
        )
    diffs = result.get("config_differences") or {}
    if diffs:
        lines += [
            "",
            "Config keys that differ between arms (all of them):",
            "",
            "| key | " + " | ".join(arms) + " |",
            "|---|" + "---|" * len(arms),
        ]
        for key, by_arm in diffs.items():
            lines.append(f"| {key} | " + " | ".join(by_arm.get(arm, "-") for arm in arms) + " |")
    return "\n".join(lines) + "\n"
