"""The comparison as a Markdown report, evidence first: the target and the statistics used;
the per-seed paired ratios with their exact sign and Wilcoxon tests; the crossing rules side
by side (first, sustained, 98 % of each seed's best); compute for the median curve to reach
the target, with a bootstrap CI only from 8 seeds; the split of each ratio; accuracy (final
or peak); the config keys that differ between arms. Renders the result dict of
`replayrl.experiments.arms.compare` into text; `replayrl.experiments.compare` writes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from replayrl.experiments.statistics import BASELINE_ARM, FRACTION_OF_BEST, PAPER_MIN_SEEDS

NR = "not reached"
RULE_LABELS = {
    "first": "first crossing",
    "sustained": "sustained crossing (stays at or above)",
    "fraction_of_best": f"{FRACTION_OF_BEST:.0%} of each seed's own best",
}


def _fmt(v: float | None, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def axis_label(axis: str, result: dict, seconds_label: str) -> str:
    if axis == "generated_tokens":
        return "tokens"
    if axis == "seconds":
        return seconds_label
    if axis == "cost_units":
        return f"cost units (own μ = {result['mu_own']:.2f})"
    if axis == "wall_seconds":
        return "wall seconds"
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
    paired = result.get("paired") or {}
    seed_axes = _paired_axes(paired) or list(axes)
    labels.update({axis: axis_label(axis, result, seconds_label) for axis in seed_axes})
    lines = _preamble(result)
    if note:
        lines += ["", note]
    lines += _paired_table(paired, seed_axes, labels)
    lines += _paired_accuracy_table(result)
    lines += _rules_table(result, paired, axes, labels)
    lines += _to_target_table(arms, axes, labels)
    lines += _split_table(arms, axes, labels)
    peak = result.get("accuracy_reported") == "peak"
    lines += _accuracy_table(arms, axes, labels, metric=_metric_label(result), peak=peak)
    lines += _config_table(arms, result.get("config_differences") or {})
    return "\n".join(lines) + "\n"


def _metric_label(result: dict) -> str:
    return (result.get("metric") or {}).get("label", "greedy pass@1")


def _paired_axes(paired: Mapping[str, dict]) -> list[str]:
    for by_rule in paired.values():
        if "first" in by_rule:
            return list(by_rule["first"])
    return []


def _preamble(result: dict) -> list[str]:
    """The target, the metric, the statistics (paired tests, IQR, smoothing, the CI or why
    there is none) and the cost units."""
    target, arms = result["target_pass1"], result["arms"]
    metric = _metric_label(result)
    n_seeds = sorted({len(a["seeds"]) for a in arms.values()})
    stats = result["statistics"]
    ci = stats.get("ci")
    target_how = (
        f"the on-policy arm's final median {metric} over its seeds"
        if result["target_source"] != "given"
        else "given"
    )
    if ci:
        ci_text = (
            f" Median-curve ratio CI: {ci['level']:.0%} percentile bootstrap over seeds, "
            f"{ci['resamples']} resamples, RNG seed {ci['seed']}, "
            + ("paired by seed (all arms ran the same seeds)" if ci["paired"] else "per arm")
            + ", recomputing the target and each first reach per resample; a resample whose "
            "arm median misses the target counts as an infinite ratio (an upper bound of ∞)."
        )
    else:
        ci_text = (
            " **No bootstrap interval:** fewer than 8 seeds per arm. With n = 5 seeds a "
            "percentile bootstrap has at most 126 distinct resamples of a first crossing that "
            "jumps from one evaluation to the next, too few atoms for a 95 % interval; the "
            "exact paired tests below are valid at any n."
        )
    restated = (
        [
            "",
            "**Restated** from a comparison.json written before the paired tests and crossing "
            "rules: what the file holds is recomputed (per-seed first crossings, the median "
            "curves); what it lacks (per-seed curves for the sustained and 98 %-of-best rules) "
            "is marked `-`.",
        ]
        if stats.get("restated_from_file")
        else []
    )
    return [
        f"**Target:** held-out {metric} = {target:.3f} ({target_how}).",
        "",
        f"**Statistics:** {'/'.join(map(str, n_seeds))} seed(s) per arm. Evidence first: per "
        f"seed, the arm's compute to the target over on-policy's for the same seed (a seed "
        f"fixes the warm start and data order both arms share), with an exact two-sided sign "
        f"test and an exact Wilcoxon signed-rank test on the log ratios. Curves and finals are "
        f"medians over seeds with the inter-quartile range [25th, 75th percentile]; values at "
        f"equal compute are read on the median curve smoothed by a centred moving average of "
        f"3 evaluations."
        + ci_text
        + (
            f" **Fewer than {PAPER_MIN_SEEDS} seeds:** the IQR is coarse and no test can be "
            f"significant."
            if n_seeds[0] < PAPER_MIN_SEEDS
            else ""
        ),
        *restated,
        "",
        f"**Cost units** = μ·(rollouts generated) + (rollouts trained on), in units of one "
        f"rollout's training cost, at this experiment's own μ = {result['mu_own']:.2f} "
        f"(median over its lineages of generation seconds per rollout / training seconds per "
        f"rollout, from their ledgers)"
        + (
            f"; beside it, what-if μ = {result['mu_what_if']:g}, a hypothetical price (the "
            f"paper measured 5.28 for Qwen2.5-7B and 6.84 for Qwen3-0.6B on long math "
            f"solutions, §3.2), not measured here."
            if result["mu_what_if"] is not None
            else "."
        ),
        *(
            [
                "",
                f"**Measured seconds** (the `seconds` axis and own μ): {result['seconds_label']}, "
                "generation + training.",
            ]
            if result.get("seconds_label")
            else []
        ),
    ]


def _ratio_text(r: float | None) -> str:
    return "∞" if r is None else f"{r:.2f}"


def _paired_table(
    paired: Mapping[str, dict], axes: Sequence[str], labels: Mapping[str, str]
) -> list[str]:
    """Per-seed paired ratios of the first crossing, with the sign and Wilcoxon tests."""
    rows = [(arm, by_rule["first"]) for arm, by_rule in paired.items() if "first" in by_rule]
    if not rows:
        return []
    lines = [
        "",
        "**Per-seed paired ratios** (shown first: the evidence). Per seed, compute for the "
        "arm's lineage to first reach the target over on-policy's with the same seed; ∞ = the "
        "arm's seed never reached it (a seed where neither did is left out). Below 1: the arm "
        'needed less. p: exact two-sided tests of "as likely above 1 as below".',
        "",
        "| arm | axis | ratio per seed (seed order) | median | below 1 | sign test p | "
        "Wilcoxon p |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for arm, by_axis in rows:
        for axis in axes:
            t = by_axis.get(axis)
            if t is None:
                continue
            per_seed = ", ".join(
                f"s{seed}: {_ratio_text(r)}"
                for seed, r in zip(t["seeds"], t["ratios"], strict=True)
            )
            sign = t["sign"]
            lines.append(
                f"| {arm} | {labels[axis]} | {per_seed} | {_fmt(t['median'], '.2f', '∞')} | "
                f"{sign['below']} of {len(t['ratios'])} | {sign['p']:.3f} | "
                f"{t['wilcoxon']['p']:.3f} |"
            )
    return lines


def _paired_accuracy_table(result: dict) -> list[str]:
    """Per seed, the arm's final (and peak) accuracy over on-policy's, with the tests."""
    paired = result.get("paired_accuracy") or {}
    if not paired:
        return []
    metric = _metric_label(result)
    lines = [
        "",
        f"Per seed, the arm's {metric} over on-policy's with the same seed: final (last "
        f"evaluation) and peak (best evaluation); above 1: the arm's seed ended (peaked) higher.",
        "",
        "| arm | value | ratio per seed (seed order) | median | above 1 | sign test p | "
        "Wilcoxon p |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for arm, by_what in paired.items():
        for what, t in by_what.items():
            per_seed = ", ".join(
                f"s{seed}: {_ratio_text(r)}"
                for seed, r in zip(t["seeds"], t["ratios"], strict=True)
            )
            lines.append(
                f"| {arm} | {what} | {per_seed} | {_fmt(t['median'], '.2f', '∞')} | "
                f"{t['sign']['above']} of {len(t['ratios'])} | {t['sign']['p']:.3f} | "
                f"{t['wilcoxon']['p']:.3f} |"
            )
    return lines


def _rules_table(
    result: dict, paired: Mapping[str, dict], axes: Sequence[str], labels: Mapping[str, str]
) -> list[str]:
    """The crossing rules side by side: per rule, the per-seed paired median ratio (seeds
    below 1, sign test p) and, for first and sustained, the median curve's ratio."""
    crossings = result.get("crossings") or {}
    others = [arm for arm in result["arms"] if arm != BASELINE_ARM]
    if BASELINE_ARM not in result["arms"] or not others:
        return []
    lines = [
        "",
        "**Crossing rules** (sensitivity): ratio arm / on-policy of the compute to reach the "
        "target by each rule. Per seed: the median of the paired ratios, seeds below 1, sign "
        "test p. Median curve: the rule applied to the median curve over seeds (the 98 % rule "
        "is per seed only: each seed's own best is its target).",
        "",
        "| arm | rule | "
        + " | ".join(f"{labels[a]}: per seed | median curve" for a in axes)
        + " |",
        "|---|---|" + "---:|---:|" * len(axes),
    ]
    for arm in others:
        for rule, rule_label in RULE_LABELS.items():
            cells = []
            for axis in axes:
                t = (paired.get(arm) or {}).get(rule, {}).get(axis)
                seeds = (
                    "-"
                    if t is None
                    else f"{_fmt(t['median'], '.2f', '∞')} ({t['sign']['below']}/"
                    f"{len(t['ratios'])} below 1, p = {t['sign']['p']:.2f})"
                )
                c = (crossings.get(arm) or {}).get(axis) or {}
                curve = "-" if rule == "fraction_of_best" else _curve_ratio(c, rule)
                cells.append(f"{seeds} | {curve}")
            lines.append(f"| {arm} | {rule_label} | " + " | ".join(cells) + " |")
    return lines


def _curve_ratio(c: Mapping, rule: str) -> str:
    if not c:
        return "-"
    if c.get(rule) is None:
        return NR
    return _fmt(c.get(f"{rule}_ratio"), ".2f")


def _to_target_table(
    arms: Mapping[str, dict], axes: Sequence[str], labels: Mapping[str, str]
) -> list[str]:
    """Compute for the median curve to first reach the target per arm and axis, with the
    ratio and, from 8 seeds, its CI."""
    has_ci = any(a["ratio_ci"] for a in arms.values())
    lines = [
        "",
        "Median curve, first crossing: compute (median over seeds) at the first evaluation "
        "where the arm's median curve is at or above the target; ratio = arm / on-policy "
        "(below 1: less compute than on-policy)" + (" and its CI:" if has_ci else ":"),
        "",
        "| arm | seeds | iterations | "
        + " | ".join(f"{labels[a]} | ratio{' [CI]' if has_ci else ''}" for a in axes)
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
    """Each median-curve ratio split into per-iteration × iterations (with the bootstrap's
    P(ratio < 1) and reach fractions when there is a bootstrap); no lines without on-policy
    and another arm."""
    others = [arm for arm in arms if arm != BASELINE_ARM]
    if BASELINE_ARM not in arms or not others:
        return []
    has_ci = any(arms[arm]["ratio_ci"] for arm in others)
    lines = [
        "",
        "The median-curve ratio split: ratio = (cost per iteration ratio) × (iterations-to-"
        "target ratio)"
        + (
            "; P(ratio < 1) and how often each median reaches the target, over the bootstrap "
            "resamples:"
            if has_ci
            else ":"
        ),
        "",
        "| arm | axis | ratio | = per iteration | × iterations |"
        + (" P(ratio < 1) | arm reaches | on-policy reaches |" if has_ci else ""),
        "|---|---|---:|---:|---:|" + ("---:|---:|---:|" if has_ci else ""),
    ]
    for arm in others:
        a = arms[arm]
        ci_arm = a["ratio_ci"] or {}
        for axis in axes:
            sp = a["ratio_split"][axis] or {}
            c = ci_arm.get(axis) or {}
            line = (
                f"| {arm} | {labels[axis]} | {_fmt(a['ratio_to_on_policy'][axis], '.3f')} | "
                f"{_fmt(sp.get('per_iteration'), '.3f')} | {_fmt(sp.get('iterations'), '.3f')} |"
            )
            if has_ci:
                line += (
                    f" {_fmt(c.get('fraction_below_1'), '.0%')} | "
                    f"{_fmt(ci_arm.get('arm_reached_fraction'), '.0%')} | "
                    f"{_fmt(ci_arm.get('on_policy_reached_fraction'), '.0%')} |"
                )
            lines.append(line)
    return lines


def _accuracy_table(
    arms: Mapping[str, dict],
    axes: Sequence[str],
    labels: Mapping[str, str],
    *,
    metric: str,
    peak: bool = False,
) -> list[str]:
    """Final (or, with `peak`, best over the run) accuracy, pass@k and entropy (median [IQR]
    over seeds), the metric at equal compute on the smoothed median curve, and μ."""
    first = next(iter(arms.values()))
    eq = first["at_equal_compute"]
    budgets = ", ".join(
        f"{eq[axis]['budget']:,.{1 if axis == 'seconds' else 0}f} {labels[axis]}" for axis in axes
    )
    when = "peak (each seed's best evaluation over the run)" if peak else "final"
    k = first["k"]
    lines = [
        "",
        f"Accuracy: {when} values (median [IQR] over seeds"
        + ("" if peak else ", at the last common evaluation")
        + f"), and the median {metric} at equal compute — {budgets} (the smaller arm's "
        f"total), read on the median curve smoothed over 3 evaluations (unsmoothed in "
        f"brackets).",
        "",
        f"| arm | {when.split(' ')[0]} {metric} | {when.split(' ')[0]} pass@{k} | "
        + ("" if peak else "final entropy | ")
        + " | ".join(f"at equal {labels[a]}" for a in axes)
        + " | measured μ |",
        "|---|---:|---:|" + ("" if peak else "---:|") + "---:|" * len(axes) + "---:|",
    ]
    for arm, a in arms.items():
        eqa = a["at_equal_compute"]
        if peak:
            acc = f"{_iqr(a['peak_pass1'])} | {_iqr(a['peak_pass_at_k'])} | "
        else:
            acc = f"{_iqr(a['final_pass1'])} | {_iqr(a['final_pass_at_k'])} | "
            acc += f"{_iqr(a['final_entropy'])} | "
        lines.append(
            f"| {arm} | {acc}"
            + " | ".join(
                f"{_fmt(eqa[axis]['pass1'], '.3f')} ({_fmt(eqa[axis].get('pass1_unsmoothed'), '.3f')})"
                for axis in axes
            )
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
