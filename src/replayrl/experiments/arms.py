"""The comparison of the arms: lineages grouped by arm, the target, per-seed paired ratios to
on-policy with exact tests under three crossing rules, each arm's median-curve compute to
reach the target with its ratio, split and (from 8 seeds) bootstrap CI, accuracy (final and
peak) and at equal compute, and the config keys that differ, as one JSON-ready dict
(`compare`); `restate` recomputes what it can for a comparison.json written by an earlier
version. Pure arithmetic on the curves already read from the tracker; each quantity is
defined in `replayrl.experiments.statistics`, and `replayrl.experiments.report` renders it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from replayrl.errors import ReplayRLError
from replayrl.experiments.statistics import (
    ARM_ORDER,
    BASE_AXES,
    BASELINE_ARM,
    BOOTSTRAP_MIN_SEEDS,
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    FRACTION_OF_BEST,
    METRICS,
    PAPER_MU,
    SMOOTHING_WINDOW,
    WHAT_IF_AXIS,
    ArmCurve,
    LineageCurve,
    arm_curve,
    bootstrap,
    compute_to_fraction_of_best,
    first_reach,
    first_reach_index,
    measured_mu,
    moving_average,
    own_mu,
    paired_test,
    quantile,
    summary,
    sustained_reach,
    value_at,
)

WALL_AXIS = "wall_seconds"  # per-seed paired ratios only, where every lineage logged it
RULES = ("first", "sustained", "fraction_of_best")


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


# ---------------------------------------------------------------- the comparison


def compare(
    curves: Sequence[LineageCurve],
    *,
    target: float | None = None,
    what_if_mu: float | None = PAPER_MU,
    params: Mapping[str, dict[str, str]] | None = None,
    resamples: int = BOOTSTRAP_RESAMPLES,
    bootstrap_seed: int = BOOTSTRAP_SEED,
    metric: str = "pass1",
    peak: bool = False,
    bootstrap_min_seeds: int = BOOTSTRAP_MIN_SEEDS,
) -> dict:
    """The comparison as a JSON-ready dict (see `replayrl.experiments.statistics` for each
    quantity).

    `target`: pass@1 to reach; None = the on-policy arm's final median pass@1. Ratios are
    arm / on-policy, so below 1 means the arm needed less compute than on-policy.
    `what_if_mu`: a μ to show beside the measured one (None: none). `params`: lineage ->
    its flattened config, for the config keys that differ between arms. `metric`: which
    accuracy the curves' `pass1` holds (a key of METRICS; the reader chose it); `peak`: the
    report shows each seed's best over the run instead of its final value. The bootstrap
    runs only when every arm has at least `bootstrap_min_seeds` seeds."""
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
    target, target_source, given = _target(baseline, target)
    reach = _reach(arms, axes, target)
    enough = min(len(a.seeds) for a in arms.values()) >= bootstrap_min_seeds
    boot = (
        bootstrap(arms, axes=axes, target=given, resamples=resamples, seed=bootstrap_seed)
        if baseline is not None and len(arms) > 1 and enough
        else None
    )
    walls = all(c.wall_seconds and all(map(math.isfinite, c.wall_seconds)) for c in curves)
    seed_axes = [*axes, *([WALL_AXIS] if walls else [])]
    out_arms = {
        arm: _arm_entry(
            arm,
            a,
            _per_seed(groups[arm], axes=seed_axes, mus=mus, target=target),
            axes=axes,
            target=target,
            reach=reach,
            ci=boot["arms"].get(arm) if boot else None,
        )
        for arm, a in arms.items()
    }
    by_arm_params = (
        {arm: [params.get(c.lineage, {}) for c in cs] for arm, cs in groups.items()}
        if params
        else {}
    )
    result = {
        "target_pass1": target,
        "target_source": target_source,
        "metric": {"name": metric, "label": METRICS[metric]},
        "accuracy_reported": "peak" if peak else "final",
        "axes": axes,
        "mu_own": mu,
        "mu_what_if": what_if_mu,
        "statistics": _statistics_entry(boot, enough, bootstrap_min_seeds),
        "config_differences": arm_config_differences(by_arm_params),
        "arms": out_arms,
        "curves": {arm: _curve_entry(a, axes) for arm, a in arms.items()},
    }
    result["paired"] = paired_section(out_arms, seed_axes)
    result["paired_accuracy"] = paired_accuracy_section(out_arms)
    result["crossings"] = median_curve_crossings(result)
    return result


def _statistics_entry(boot: dict | None, enough: bool, min_seeds: int) -> dict:
    return {
        "center": "median over seeds",
        "band": "inter-quartile range (25th-75th percentile, linear interpolation)",
        "paired": "per-seed ratio arm / on-policy; exact two-sided sign and Wilcoxon tests",
        "smoothing": f"centred moving average of {SMOOTHING_WINDOW} evaluations (equal compute)",
        "ci": {k: v for k, v in (boot or {}).items() if k != "arms"} or None,
        "ci_withheld": None
        if enough
        else f"fewer than {min_seeds} seeds per arm: a percentile bootstrap over so few seeds "
        "has too few distinct resamples of a first crossing to be an interval",
    }


def paired_section(arms_out: Mapping[str, dict], axes: Sequence[str]) -> dict:
    """arm -> rule -> axis -> `paired_test` of that arm's per-seed compute to target against
    on-policy's (seeds matched by number), for each crossing rule its per-seed entries hold
    (`to_target`: first crossing; `to_target_sustained`; `to_fraction_of_best`: each seed's
    own 98 % of best). Works on a result dict, so an older comparison.json can be restated."""
    base = arms_out.get(BASELINE_ARM)
    if base is None:
        return {}
    keys = {"first": "to_target", "sustained": "to_target_sustained"}
    keys["fraction_of_best"] = "to_fraction_of_best"
    out: dict = {}
    for arm, a in arms_out.items():
        if arm == BASELINE_ARM:
            continue
        out[arm] = {}
        for rule, key in keys.items():
            if not all(key in s for s in (*a["per_seed"], *base["per_seed"])):
                continue  # an older result file without this rule's per-seed values
            out[arm][rule] = {
                axis: paired_test(
                    {s["seed"]: s[key][axis] for s in a["per_seed"]},
                    {s["seed"]: s[key][axis] for s in base["per_seed"]},
                )
                for axis in axes
                if all(axis in s[key] for s in (*a["per_seed"], *base["per_seed"]))
            }
    return out


def paired_accuracy_section(arms_out: Mapping[str, dict]) -> dict:
    """arm -> {"final", "peak"} -> `paired_test` of the arm's accuracy over on-policy's, seed
    by seed (above 1: the arm's seed ended, or peaked, higher); "peak" only where the
    per-seed entries hold each seed's best."""
    base = arms_out.get(BASELINE_ARM)
    if base is None:
        return {}
    keys = {"final": "final_pass1", "peak": "best_pass1"}
    return {
        arm: {
            what: paired_test(
                {s["seed"]: s[key] for s in a["per_seed"]},
                {s["seed"]: s[key] for s in base["per_seed"]},
            )
            for what, key in keys.items()
            if all(key in s for s in (*a["per_seed"], *base["per_seed"]))
        }
        for arm, a in arms_out.items()
        if arm != BASELINE_ARM
    }


def median_curve_crossings(result: dict) -> dict:
    """arm -> axis -> {"first", "sustained"}: compute where the arm's MEDIAN curve first
    reaches the target, and where it reaches it for good (stays at or above it to the end),
    with each one's ratio to on-policy's by the same rule. From the result dict's curves."""
    target, axes = result["target_pass1"], result["axes"]
    to: dict = {}
    iterations: dict = {}
    for arm, c in result["curves"].items():
        pass1 = c["pass1_median"]
        to[arm] = {
            axis: {
                "first": first_reach(c[axis], pass1, target),
                "sustained": sustained_reach(c[axis], pass1, target),
            }
            for axis in axes
        }
        iterations[arm] = {
            "first_iteration": first_reach(c["iterations"], pass1, target),
            "sustained_iteration": sustained_reach(c["iterations"], pass1, target),
        }
    base = to.get(BASELINE_ARM, {})
    return {
        arm: {
            axis: {
                **by_rule,
                **iterations[arm],
                **{
                    f"{rule}_ratio": _ratio(by_rule[rule], base.get(axis, {}).get(rule))
                    for rule in ("first", "sustained")
                },
            }
            for axis, by_rule in by_axis.items()
        }
        for arm, by_axis in to.items()
    }


def _target(baseline: ArmCurve | None, target: float | None) -> tuple[float, str, float | None]:
    """(the target, where it comes from, the target given or None) for `compare`."""
    if target is not None:
        return target, "given", target
    if baseline is None:
        raise ReplayRLError(
            "No on-policy lineage in this experiment, so there is no default target: run "
            "the on-policy arm (--arm on-policy) or pass --target ACC."
        )
    return quantile(baseline.final_pass1, 0.5), "on-policy final median pass@1", None


@dataclass(frozen=True)
class _Reach:
    """Where each arm's median curve first reaches the target, and the equal-compute budgets."""

    finals: dict[str, dict[str, float]]  # arm -> axis -> median final compute
    budgets: dict[str, float]  # axis -> the smallest arm's median final compute
    to_target: dict[str, dict[str, float | None]]  # arm -> axis -> median compute at first reach
    iterations: dict[str, int | None]  # arm -> the iteration of the first reach


def _reach(arms: Mapping[str, ArmCurve], axes: Sequence[str], target: float) -> _Reach:
    medians = {arm: (a.compute, a.pass1_median) for arm, a in arms.items()}
    finals = {arm: {axis: medians[arm][0][axis][-1] for axis in axes} for arm in arms}
    budgets = {axis: min(f[axis] for f in finals.values()) for axis in axes}
    reach_index = {arm: first_reach_index(pass1, target) for arm, (_, pass1) in medians.items()}
    to_target = {
        arm: {axis: None if i is None else medians[arm][0][axis][i] for axis in axes}
        for arm, i in reach_index.items()
    }
    iterations = {
        arm: None if i is None else arms[arm].iterations[i] for arm, i in reach_index.items()
    }
    return _Reach(finals, budgets, to_target, iterations)


def _per_seed(
    lineages: Sequence[LineageCurve],
    *,
    axes: Sequence[str],
    mus: Mapping[str, float],
    target: float,
) -> list[dict]:
    """One entry per lineage of an arm, in seed order: its final and best accuracy, μ, and
    its compute to the target by each crossing rule (first reach, sustained reach, its own
    98 % of best) on each axis."""
    out = []
    for c in sorted(lineages, key=lambda c: (c.seed, c.lineage)):
        x = {
            axis: c.wall_seconds if axis == WALL_AXIS else c.axis(axis, mu=mus.get(axis, 0.0))
            for axis in axes
        }
        best = max(range(len(c.pass1)), key=lambda i: (c.pass1[i], -i))
        out.append(
            {
                "seed": c.seed,
                "lineage": c.lineage,
                "final_iteration": c.iterations[-1],
                "final_pass1": c.pass1[-1],
                "best_pass1": c.pass1[best],
                "best_iteration": c.iterations[best],
                "measured_mu": measured_mu(c),
                "to_target": {a: first_reach(x[a], c.pass1, target) for a in axes},
                "to_target_sustained": {a: sustained_reach(x[a], c.pass1, target) for a in axes},
                "to_fraction_of_best": {
                    a: compute_to_fraction_of_best(x[a], c.pass1, FRACTION_OF_BEST) for a in axes
                },
            }
        )
    return out


def _arm_entry(
    arm: str,
    a: ArmCurve,
    per_seed: list[dict],
    *,
    axes: Sequence[str],
    target: float,
    reach: _Reach,
    ci: dict | None,
) -> dict:
    """One arm of the result: finals, compute to target, ratios to on-policy and their split
    and CI, accuracy at equal compute, and its seeds."""
    arm_mus = [s["measured_mu"] for s in per_seed if s["measured_mu"] is not None]
    to_target = reach.to_target[arm]
    base_to = reach.to_target.get(BASELINE_ARM, {})
    base_iters = reach.iterations.get(BASELINE_ARM)
    return {
        "seeds": list(a.seeds),
        "lineages": list(a.lineages),
        "final_iteration": a.iterations[-1],
        "final_pass1": summary(a.final_pass1),
        "final_pass_at_k": summary(a.final_pass_at_k),
        "k": a.k,
        "final_entropy": summary(a.final_entropy),
        "peak_pass1": summary([s["best_pass1"] for s in per_seed]),
        "peak_pass_at_k": summary(a.peak_pass_at_k),
        "final_compute": reach.finals[arm],
        "measured_mu": statistics.median(arm_mus) if arm_mus else None,
        "iterations_to_target": reach.iterations[arm],
        "to_target": to_target,
        "ratio_to_on_policy": {axis: _ratio(to_target[axis], base_to.get(axis)) for axis in axes},
        "ratio_split": {
            axis: split(to_target[axis], reach.iterations[arm], base_to.get(axis), base_iters)
            for axis in axes
        },
        "ratio_ci": ci,
        "rollouts_trained_to_target": first_reach(
            a.compute["rollouts_trained"], a.pass1_median, target
        ),
        "at_equal_compute": {
            axis: at_equal_compute(a.compute[axis], a.pass1_median, reach.budgets[axis])
            for axis in axes
        },
        "per_seed": per_seed,
    }


def _curve_entry(a: ArmCurve, axes: Sequence[str]) -> dict:
    """An arm's median curve with its IQR band, against each axis's median compute."""
    return {
        "iterations": list(a.iterations),
        **{axis: list(a.compute[axis]) for axis in axes},
        "pass1_median": list(a.pass1_median),
        "pass1_q25": list(a.pass1_q25),
        "pass1_q75": list(a.pass1_q75),
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


def at_equal_compute(
    compute: Sequence[float], pass1_median: Sequence[float], budget: float
) -> dict[str, float | None]:
    """The median curve read at `budget`: `pass1` on the lightly smoothed curve (centred
    moving average of 3 evaluations), so one noisy evaluation does not decide it, and
    `pass1_unsmoothed` interpolated between the raw evaluations beside it."""
    smooth = moving_average(pass1_median)
    return {
        "budget": budget,
        "pass1": _none_if_nan(value_at(compute, smooth, budget)),
        "pass1_unsmoothed": _none_if_nan(value_at(compute, pass1_median, budget)),
    }


def restate(result: dict) -> dict:
    """A comparison.json written before the paired tests and crossing rules, with what can be
    recomputed from the file itself: per-seed paired tests of the first crossing (from each
    seed's `to_target`), the median curves' first and sustained crossings, equal compute on
    the smoothed median curves, and no bootstrap interval below 8 seeds. Rules whose per-seed
    values the file lacks are left out (the report says so)."""
    out = dict(result)
    out["arms"] = {arm: dict(a) for arm, a in result["arms"].items()}
    out.setdefault("metric", {"name": "pass1", "label": METRICS["pass1"]})
    out.setdefault("accuracy_reported", "final")
    n = min(len(a["seeds"]) for a in out["arms"].values())
    if n < BOOTSTRAP_MIN_SEEDS:
        for a in out["arms"].values():
            a["ratio_ci"] = None
    out["statistics"] = {
        **_statistics_entry(None, n >= BOOTSTRAP_MIN_SEEDS, BOOTSTRAP_MIN_SEEDS),
        **({"ci": result["statistics"]["ci"]} if n >= BOOTSTRAP_MIN_SEEDS else {}),
        "restated_from_file": True,
    }
    for arm, a in out["arms"].items():
        c = out["curves"][arm]
        a["at_equal_compute"] = {
            axis: at_equal_compute(c[axis], c["pass1_median"], eq["budget"])
            for axis, eq in a["at_equal_compute"].items()
        }
    out["paired"] = paired_section(out["arms"], out["axes"])
    out["paired_accuracy"] = paired_accuracy_section(out["arms"])
    out["crossings"] = median_curve_crossings(out)
    return out


def _none_if_nan(v: float) -> float | None:
    return None if math.isnan(v) else v
