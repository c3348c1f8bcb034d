"""The comparison as a Markdown report: the target and the statistics used, compute to reach
the target with ratios and their bootstrap CI, the split of each ratio, accuracy, and the
config keys that differ between arms. Renders the result dict of
`replayrl.experiments.arms.compare` into text; `replayrl.experiments.compare` writes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from replayrl.experiments.statistics import BASELINE_ARM, PAPER_MIN_SEEDS

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
    axes, arms = result["axes"], result["arms"]
    labels = {axis: axis_label(axis, result, seconds_label) for axis in axes}
    lines = _preamble(result)
    if note:
        lines += ["", note]
    lines += _to_target_table(arms, axes, labels)
    lines += _split_table(arms, axes, labels)
    lines += _accuracy_table(arms, axes, labels)
    lines += _config_table(arms, result.get("config_differences") or {})
    return "\n".join(lines) + "\n"


def _preamble(result: dict) -> list[str]:
    """The target, the statistics (seeds, IQR, the CI's bootstrap) and the cost units."""
    target, arms = result["target_pass1"], result["arms"]
    n_seeds = sorted({len(a["seeds"]) for a in arms.values()})
    ci = result["statistics"]["ci"]
    target_how = (
        "the on-policy arm's final median pass@1 over its seeds"
        if result["target_source"] != "given"
        else "given"
    )
    return [
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


def _to_target_table(
    arms: Mapping[str, dict], axes: Sequence[str], labels: Mapping[str, str]
) -> list[str]:
    """Compute to first reach the target per arm and axis, with the ratio and its CI."""
    lines = [
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
    return lines


def _split_table(
    arms: Mapping[str, dict], axes: Sequence[str], labels: Mapping[str, str]
) -> list[str]:
    """Each ratio split into per-iteration × iterations, with the bootstrap's P(ratio < 1) and
    reach fractions; no lines without on-policy and another arm."""
    others = [arm for arm in arms if arm != BASELINE_ARM]
    if BASELINE_ARM not in arms or not others:
        return []
    lines = [
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
    return lines


def _accuracy_table(
    arms: Mapping[str, dict], axes: Sequence[str], labels: Mapping[str, str]
) -> list[str]:
    """Final pass@1, pass@k and entropy (median [IQR]), pass@1 at equal compute and μ."""
    first = next(iter(arms.values()))
    eq = first["at_equal_compute"]
    budgets = ", ".join(
        f"{eq[axis]['budget']:,.{1 if axis == 'seconds' else 0}f} {labels[axis]}" for axis in axes
    )
    lines = [
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
    return lines


def _config_table(arms: Mapping[str, dict], diffs: Mapping[str, Mapping[str, str]]) -> list[str]:
    """The config keys that differ between arms, one row each; no lines when none do."""
    if not diffs:
        return []
    lines = [
        "",
        "Config keys that differ between arms (all of them):",
        "",
        "| key | " + " | ".join(arms) + " |",
        "|---|" + "---|" * len(arms),
    ]
    for key, by_arm in diffs.items():
        lines.append(f"| {key} | " + " | ".join(by_arm.get(arm, "-") for arm in arms) + " |")
    return lines
