"""`replayrl sweep report`: what a sweep (`replayrl.experiments.sweep`) measured, as
`sweep_report.json`, `sweep_report.md`, `heatmap.png`, `pareto.png` and one histogram figure
per lineage (`distributions/<lineage>.{json,png}`, also logged to the lineage's MLflow run
under `distributions/`).

Per cell (a grid point without its seed), over its seeds:

- best accuracy: each seed's best held-out pass@1 over all its evaluations (the warm start
  included), median over seeds (Figs. 3, 13, 14 left);
- compute to 98 % of best: each seed's compute at its first evaluation reaching 0.98 × its
  own best (`statistics.compute_to_fraction_of_best`), median over seeds (Figs. 13, 14 right);
- compute on three axes: `cost_units` = μ·(rollouts generated) + (rollouts trained on) with
  the sweep's own measured μ (the paper's compute model; the heatmap's axis),
  `generated_tokens` and measured `seconds`.

The Pareto frontier (Fig. 4): every cell's median pass@1 curve against its median compute;
the frontier is the best accuracy any cell reached at or below each compute, kept per arm
(buffered replay vs on-policy) when both ran. The advisor (`replayrl advise`, Theorem 4.5)
with the sweep's μ and the given ρ, α (not measured: assumptions, stated in the report) is
shown beside the measured optimum: the cell that needs the least compute to reach 98 % of
the sweep's best cell accuracy, and the cell with the best accuracy.

Paired effects of each axis (the evidence, as in `replayrl compare`): for every two values
a, b of one axis, the lineages that differ only in that value (same seed, same values of the
other axes) are paired, and each pair's best pass@1 ratio a / b goes into an exact two-sided
sign test (`statistics.sign_test`). Pairs that share a seed share its warm start and data
order, so where the other axes have several values the pairs are not independent seeds: the
report says so, and gives the per-seed count (seeds where a beat b in every pair) beside it.

The histograms (Fig. 2) come from the lineage's usage log (one row per use of a rollout in a
gradient step): staleness of each use (gradient step of the use minus the step its rollout
was created at, `replayrl.core.staleness`), replay ratio of each rollout (gradient steps it
took part in; rollouts never used count as 0, from the ledger's rollouts generated), and
steps since the previous use of each repeated use.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from replayrl import storage
from replayrl.errors import ReplayRLError
from replayrl.experiments.statistics import (
    LineageCurve,
    arm_curve,
    compute_to_fraction_of_best,
    own_mu,
    sign_test,
)
from replayrl.experiments.sweep import MANIFEST

FRACTION = 0.98
AXES = ("cost_units", "generated_tokens", "seconds")
FILES = ("sweep_report.json", "sweep_report.md", "heatmap.png", "pareto.png")


# ---------------------------------------------------------------- distributions (Fig. 2)


def distributions(
    usage_table, *, steps_per_iteration: int, asynchronous: bool, rollouts_generated: int | None
) -> dict[str, dict[str, list[int]]]:
    """Histograms {name: {"values": [...], "counts": [...]}} of staleness (per use), replay
    ratio (per rollout) and steps since last use (per repeated use) from usage rows
    (`USAGE_SCHEMA`). The asynchronous engine versions its policy by gradient step (S = 1)."""
    from replayrl.core.staleness import sample_ages, steps_since_last_use

    s = 1 if asynchronous else steps_per_iteration
    cols = usage_table.to_pydict()
    ids = np.asarray(cols["rollout_id"], dtype=object)
    v_use = np.asarray(cols["policy_version_at_use"], dtype=np.int64)
    k = np.asarray(cols["train_step"], dtype=np.int64)
    v_row = np.asarray(cols["rollout_policy_version"], dtype=np.int64)
    ages = sample_ages(
        row_policy_version=v_row, policy_version_at_use=v_use, train_step=k, steps_per_iteration=s
    )
    steps = v_use * s + k
    # Replay ratio: distinct gradient steps per rollout.
    pairs = {(r, int(g)) for r, g in zip(ids, steps, strict=True)}
    per_rollout: dict[str, int] = {}
    for r, _ in pairs:
        per_rollout[r] = per_rollout.get(r, 0) + 1
    ratios = list(per_rollout.values())
    if rollouts_generated is not None:
        ratios += [0] * max(0, int(rollouts_generated) - len(per_rollout))
    order = np.argsort(steps, kind="stable")
    gaps = steps_since_last_use(
        rollout_id=ids[order],
        step=steps[order],
        history_id=np.zeros(0, dtype=object),
        history_step=np.zeros(0, dtype=np.int64),
    )
    return {
        "staleness": _counts(ages),
        "replay_ratio": _counts(np.asarray(ratios, dtype=np.int64)),
        "steps_since_last_use": _counts(gaps[gaps >= 0]),
    }


def _counts(values: np.ndarray) -> dict[str, list[int]]:
    v, c = np.unique(np.asarray(values, dtype=np.int64), return_counts=True)
    return {"values": [int(x) for x in v], "counts": [int(x) for x in c]}


def lineage_distributions(run_root: str, lineage: str) -> dict | None:
    """The histograms of any lineage from its Delta usage log (S and the engine from its
    stored config.yaml); None when it has not trained yet."""
    import yaml

    from replayrl.buffer.table import ReplayBuffer
    from replayrl.config import config_from_dict

    paths = storage.lineage_paths(run_root, lineage)
    state = storage.read_state(paths)
    if state is None:
        return None
    cfg = config_from_dict(yaml.safe_load(storage.read_bytes(paths.config)))
    buf = ReplayBuffer(paths.buffer, storage_options=storage.delta_storage_options(paths.buffer))
    usage = buf.read_usage()
    if not usage.num_rows:
        return None
    generated = (state.ledger or {}).get("rollouts_generated")
    return distributions(
        usage,
        steps_per_iteration=cfg.train.steps_per_iteration,
        asynchronous=cfg.asynchronous.enabled,
        rollouts_generated=int(generated) if generated is not None else None,
    )


def write_distributions(
    run_root: str, lineage: str, out_dir: Path, *, log_to_mlflow: bool = True
) -> list[Path]:
    """`<out_dir>/<lineage>.{json,png}`, also logged to the lineage's MLflow run under
    `distributions/`; [] when the lineage has not trained yet."""
    hists = lineage_distributions(run_root, lineage)
    if hists is None:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / f"{lineage}.json", out_dir / f"{lineage}.png"]
    files[0].write_text(json.dumps(hists, indent=2))
    plot_distributions(hists, files[1], title=lineage)
    state = storage.read_state(storage.lineage_paths(run_root, lineage))
    if log_to_mlflow and state and state.mlflow_run_id and state.tracking_uri:
        log_artifacts(state.tracking_uri, state.mlflow_run_id, files)
    return files


def plot_distributions(hists: dict, path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "staleness": "staleness (gradient steps)",
        "replay_ratio": "replay ratio (uses per rollout)",
        "steps_since_last_use": "steps since last use",
    }
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for ax, (name, label) in zip(axes, labels.items(), strict=True):
        h = hists[name]
        ax.bar(h["values"], h["counts"], width=0.9)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- reading the sweep


@dataclass(frozen=True)
class Measured:
    point: dict
    curve: LineageCurve | None
    run_id: str | None
    tracking_uri: str | None


def read_manifest(out_dir: str | Path) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise ReplayRLError(
            f"No {MANIFEST} in {out_dir}: pass the --out folder of a `replayrl sweep run`."
        )
    return json.loads(path.read_text())


def read_points(manifest: dict) -> list[Measured]:
    from replayrl.experiments.compare import read_curve

    out = []
    for p in manifest["points"]:
        state = storage.read_state(storage.lineage_paths(manifest["run_root"], p["lineage"]))
        if state is None or not state.mlflow_run_id or not state.tracking_uri:
            out.append(Measured(p, None, None, None))
            continue
        curve = read_curve(tracking_uri=state.tracking_uri, run_id=state.mlflow_run_id)
        out.append(Measured(p, curve, state.mlflow_run_id, state.tracking_uri))
    return out


# ---------------------------------------------------------------- the numbers


def _median(values: Sequence[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def report(
    measured: list[Measured],
    *,
    manifest: dict,
    rho: float,
    alpha: float,
    mu: float | None = None,
) -> dict:
    """The report as a JSON-ready dict (see the module docstring)."""
    from replayrl.experiments.advisor import advise

    curves = [m.curve for m in measured if m.curve is not None]
    if not curves:
        raise ReplayRLError(
            "No lineage of this sweep has an evaluation yet: run it first (`replayrl sweep run`)."
        )
    mu_own = own_mu(curves)
    mu_used = mu if mu is not None else mu_own
    mus = {"cost_units": mu_used or 0.0}
    cells: dict[str, dict] = {}
    for m in measured:
        cell = cells.setdefault(
            m.point["cell"],
            {
                "values": {k: v for k, v in m.point["values"].items() if k != "seed"},
                "arm": m.point["arm"],
                "x": m.point["x"],
                "y": m.point["y"],
                "buffer_capacity": m.point["buffer_capacity"],
                "prompts_per_iteration": m.point["prompts_per_iteration"],
                "lineages": [],
                "_curves": [],
            },
        )
        entry: dict = {"lineage": m.point["lineage"], "seed": m.point["seed"]}
        if m.curve is not None:
            c = m.curve
            entry.update(
                mlflow_run_id=m.run_id,
                final_iteration=c.iterations[-1],
                finished=c.iterations[-1] >= m.point["iterations"],
                best_pass1=max(c.pass1),
                evaluations=len(c.pass1),
                to_fraction_of_best={
                    axis: compute_to_fraction_of_best(
                        c.axis(axis, mu=mus["cost_units"]), c.pass1, FRACTION
                    )
                    for axis in AXES
                },
                final_compute={axis: c.axis(axis, mu=mus["cost_units"])[-1] for axis in AXES},
            )
            cell["_curves"].append(c)
        cell["lineages"].append(entry)
    for cell in cells.values():
        seeds = [e for e in cell["lineages"] if "best_pass1" in e]
        cell["seeds_measured"] = len(seeds)
        cell["best_pass1"] = _median([e["best_pass1"] for e in seeds])
        cell["to_fraction_of_best"] = {
            axis: _median([e["to_fraction_of_best"][axis] for e in seeds]) for axis in AXES
        }
        cell["final_compute"] = {
            axis: _median([e["final_compute"][axis] for e in seeds]) for axis in AXES
        }
    best_cell = max(
        (k for k in cells if cells[k]["best_pass1"] is not None),
        key=lambda k: cells[k]["best_pass1"],
    )
    target = FRACTION * cells[best_cell]["best_pass1"]
    _common_target(cells, target, mus)
    reached = [k for k in cells if cells[k]["to_common_target"] is not None]
    efficient = min(reached, key=lambda k: cells[k]["to_common_target"]) if reached else None
    frontier = _frontiers(cells, mus)
    first = manifest["points"][0]
    advisor, a = None, None
    if mu_used:
        try:
            a = advise(
                mu=mu_used,
                rho=rho,
                alpha=alpha,
                batch_size=first["batch_size"],
                steps_per_iteration=first["steps_per_iteration"],
                samples_per_prompt=first["samples_per_prompt"],
            )
        except ReplayRLError as e:  # e.g. ρ out of range: the measured part still stands
            advisor = {"mu": mu_used, "rho": rho, "alpha": alpha, "error": str(e)}
    if a is not None:
        nearest = min(
            cells,
            key=lambda k: math.hypot(
                math.log(max(cells[k]["x"], 1e-9) / max(a.x, 1e-9)),
                math.log(max(cells[k]["y"], 1e-9) / max(a.y, 1e-9)),
            ),
        )
        advisor = {
            "mu": mu_used,
            "mu_source": "given" if mu is not None else "measured (median over the lineages)",
            "rho": rho,
            "alpha": alpha,
            "assumed": "ρ and α are not measured by replayrl: they are the values given",
            "x_star": a.x_star,
            "y_star": a.y_star,
            "x": a.x,
            "y": a.y,
            "on_policy": a.on_policy,
            "settings": a.settings,
            "nearest_cell": nearest,
        }
    for cell in cells.values():
        del cell["_curves"]
    return {
        "axis_effects": axis_effects(cells),
        "experiment": manifest["experiment"],
        "run_root": manifest["run_root"],
        "axes": manifest["axes"],
        "fraction": FRACTION,
        "mu_own": mu_own,
        "compute_axis": "cost_units",
        "cells": cells,
        "best_accuracy_cell": best_cell,
        "common_target_pass1": target,
        "most_efficient_cell": efficient,
        "pareto": frontier,
        "advisor": advisor,
    }


def axis_effects(cells: dict) -> list[dict]:
    """For every two values a, b of each axis: best pass@1 of a over b, paired by seed and by
    the other axes' values (see the module docstring), with the exact sign test over the
    pairs and the seeds where a was higher in every pair (or lower in every pair)."""
    if not cells:
        return []
    best: dict[tuple, float] = {}  # (sorted axis values, seed) -> the seed's best pass@1
    for cell in cells.values():
        for e in cell["lineages"]:
            if e.get("best_pass1") is not None:
                best[(tuple(sorted(cell["values"].items())), e["seed"])] = e["best_pass1"]
    out = []
    for name in next(iter(cells.values()))["values"]:
        values = list(dict.fromkeys(c["values"][name] for c in cells.values()))
        for i, a in enumerate(values):
            for b in values[i + 1 :]:
                pairs = _pairs(best, name, a, b)
                if pairs:
                    out.append({"axis": name, "a": a, "b": b, **_paired_entry(pairs)})
    return out


def _pairs(best: dict[tuple, float], name: str, a: str, b: str) -> list[tuple[int, float]]:
    """(seed, best pass@1 ratio a / b) for every lineage with `name` = a whose twin (the same
    seed and other values, `name` = b) has a best too."""
    pairs = []
    for (key, seed), va in best.items():
        point = dict(key)
        if point[name] != a:
            continue
        vb = best.get((tuple(sorted({**point, name: b}.items())), seed))
        if vb is not None:
            pairs.append((seed, va / vb if vb > 0 else (math.inf if va > 0 else 1.0)))
    return pairs


def _paired_entry(pairs: list[tuple[int, float]]) -> dict:
    test = sign_test([r for _, r in pairs])
    seeds = sorted({seed for seed, _ in pairs})

    def every_pair(higher) -> int:  # seeds whose every pair has `higher(ratio)`
        return sum(all(higher(r) for s, r in pairs if s == seed) for seed in seeds)

    return {
        "pairs": len(pairs),
        "a_higher": test["above"],
        "b_higher": test["below"],
        "ties": test["ties"],
        "sign_p": test["p"],
        "median_ratio": statistics.median(r for _, r in pairs),
        "seeds": len(seeds),
        "seeds_a_higher_in_every_pair": every_pair(lambda r: r > 1),
        "seeds_b_higher_in_every_pair": every_pair(lambda r: r < 1),
        "independent": len(pairs) == len(seeds),
    }


def _common_target(cells: dict, target: float, mus: dict) -> None:
    """Each cell's median compute (cost units) to first reach `target` per seed; a seed that
    never reaches it makes the cell's entry None when it is the median's majority."""
    for cell in cells.values():
        per_seed = []
        for c in cell["_curves"]:
            cost = c.axis("cost_units", mu=mus["cost_units"])
            hit = next((x for x, a in zip(cost, c.pass1, strict=True) if a >= target - 1e-12), None)
            per_seed.append(math.inf if hit is None else hit)
        med = statistics.median(per_seed) if per_seed else math.inf
        cell["to_common_target"] = None if math.isinf(med) else med


def _frontiers(cells: dict, mus: dict) -> dict:
    """Per arm (and "all"): the Pareto frontier of (median compute, median pass@1) over every
    evaluated point of every cell's median curve: the points no other point beats with at
    most its compute. Also each cell's median curve."""
    curves = {}
    for name, cell in cells.items():
        if not cell["_curves"]:
            continue
        try:
            a = arm_curve(cell["_curves"], mus=mus)
        except (ValueError, ReplayRLError):
            continue  # seeds evaluated at different iterations: no median curve
        curves[name] = {
            "arm": cell["arm"],
            "cost_units": list(a.compute["cost_units"]),
            "pass1_median": list(a.pass1_median),
        }
    groups = {"all": list(curves)}
    arms = {c["arm"] for c in curves.values()}
    if len(arms) > 1:
        groups.update({arm: [k for k, c in curves.items() if c["arm"] == arm] for arm in arms})
    frontier = {}
    for group, names in groups.items():
        pts = sorted(
            (x, p, n)
            for n in names
            for x, p in zip(curves[n]["cost_units"], curves[n]["pass1_median"], strict=True)
        )
        best, front = -math.inf, []
        for x, p, n in pts:
            if p > best:
                best = p
                front.append({"cost_units": x, "pass1": p, "cell": n})
        frontier[group] = front
    return {"curves": curves, "frontier": frontier}


# ---------------------------------------------------------------- files


def _grid(cells: dict, axes: list[dict]) -> tuple[list[str], list[str], dict]:
    """(row labels, column labels, {(row, col): cell name}): rows are the first non-seed
    axis, columns the rest joined."""
    names = [a["name"] for a in axes if a["name"] != "seed"]
    rows, cols, where = [], [], {}
    for name, cell in cells.items():
        vals = cell["values"]
        r = f"{names[0]}={vals[names[0]]}" if names else "all"
        c = ", ".join(f"{n}={vals[n]}" for n in names[1:]) or "-"
        rows += [r] if r not in rows else []
        cols += [c] if c not in cols else []
        where[(r, c)] = name
    return rows, cols, where


def plot_heatmaps(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    rows, cols, where = _grid(cells, result["axes"])
    panels = (
        ("best pass@1 (median over seeds)", lambda c: c["best_pass1"]),
        (
            f"cost units to {FRACTION:.0%} of best (median)",
            lambda c: c["to_fraction_of_best"]["cost_units"],
        ),
    )
    fig, axes = plt.subplots(1, 2, figsize=(6 + 1.2 * len(cols) * 2, 2 + 0.6 * len(rows)))
    for ax, (title, value) in zip(axes, panels, strict=True):
        m = np.full((len(rows), len(cols)), np.nan)
        for (r, c), name in where.items():
            v = value(cells[name])
            m[rows.index(r), cols.index(c)] = np.nan if v is None else v
        im = ax.imshow(m, aspect="auto", cmap="viridis")
        for i in range(len(rows)):
            for j in range(len(cols)):
                if np.isfinite(m[i, j]):
                    ax.text(j, i, f"{m[i, j]:.3g}", ha="center", va="center", color="w")
        ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right")
        ax.set_yticks(range(len(rows)), rows)
        ax.set_title(title)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_pareto(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    pareto = result["pareto"]
    for name, c in pareto["curves"].items():
        ax.plot(c["cost_units"], c["pass1_median"], lw=0.8, alpha=0.5, label=name)
    for group, front in pareto["frontier"].items():
        if front:
            ax.step(
                [p["cost_units"] for p in front],
                [p["pass1"] for p in front],
                where="post",
                lw=2.5,
                label=f"frontier: {group}",
            )
    ax.set_xlabel("cost units (μ·generated + trained rollouts)")
    ax.set_ylabel("median held-out pass@1")
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(v: float | None, spec: str = ".3g") -> str:
    return "—" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    lines = [
        f"## Sweep `{result['experiment']}`",
        "",
        f"Compute: cost units = μ·(rollouts generated) + (rollouts trained on), μ = "
        f"{_fmt(result['advisor']['mu'] if result['advisor'] else result['mu_own'])} "
        f"(own measured μ {_fmt(result['mu_own'])}). Per cell, the median over its seeds of each "
        f"seed's best pass@1 and of its compute at the first evaluation reaching "
        f"{result['fraction']:.0%} of its own best.",
        "",
        "| cell | x | y | seeds | best pass@1 | cost to 98 % of best | tokens to 98 % of best "
        "| cost to common target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c in result["cells"].items():
        t = c["to_fraction_of_best"]
        lines.append(
            f"| {name} | {c['x']:.3g} | {c['y']:.3g} | {c['seeds_measured']} | "
            f"{_fmt(c['best_pass1'])} | {_fmt(t['cost_units'])} | {_fmt(t['generated_tokens'])} "
            f"| {_fmt(c['to_common_target'])} |"
        )
    lines += [
        "",
        f"Best accuracy: **{result['best_accuracy_cell']}**. Least compute to "
        f"{result['fraction']:.0%} of that ({_fmt(result['common_target_pass1'])} pass@1): "
        f"**{result['most_efficient_cell'] or 'no cell reached it'}**.",
    ]
    a = result["advisor"]
    if a and "error" in a:
        lines += ["", f"Advisor (Theorem 4.5): no prediction: {a['error']}"]
    elif a:
        lines += [
            "",
            f"Advisor (Theorem 4.5) at μ = {a['mu']:.3g} ({a['mu_source']}), ρ = {a['rho']:g}, "
            f"α = {a['alpha']:g} (assumed, not measured): x* = {a['x_star']:.3g}, y* = "
            f"{a['y_star']:.3g}; this loop realises x = {a['x']:.3g}, y = {a['y']:.3g} "
            f"({'strict on-policy' if a['on_policy'] else 'replay'}: "
            + ", ".join(f"{k}={v}" for k, v in a["settings"].items())
            + f"). Nearest grid cell: **{a['nearest_cell']}**; measured optimum: "
            f"**{result['most_efficient_cell'] or '—'}**.",
        ]
    effects = result.get("axis_effects") or []
    if effects:
        lines += [
            "",
            "Paired by seed (and by the other axes' values): each seed's best pass@1 with a "
            "over the same lineage with b; exact two-sided sign test over the pairs. Pairs that "
            "share a seed share its warm start and data order: where there are more pairs than "
            "seeds, the pairs are not independent and p is descriptive; the last column counts "
            "the seeds where a (or b) was higher in every one of that seed's pairs.",
            "",
            "| axis | a vs b | pairs | a higher | b higher | ties | median ratio a / b "
            "| sign test p | seeds where a / b higher in every pair |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for e in effects:
            lines.append(
                f"| {e['axis']} | {e['a']} vs {e['b']} | {e['pairs']} | {e['a_higher']} | "
                f"{e['b_higher']} | {e['ties']} | {e['median_ratio']:.3f} | "
                f"{e['sign_p']:.3g}{'' if e['independent'] else ' (not independent)'} | "
                f"{e['seeds_a_higher_in_every_pair']} / {e['seeds_b_higher_in_every_pair']} "
                f"of {e['seeds']} |"
            )
    for group, front in result["pareto"]["frontier"].items():
        cells = list(dict.fromkeys(p["cell"] for p in front))
        lines += ["", f"Pareto frontier ({group}): " + " → ".join(cells)]
    lines += ["", "Figures: heatmap.png, pareto.png; per lineage: distributions/<lineage>.png."]
    return "\n".join(lines) + "\n"


def write_report(
    out_dir: str | Path,
    *,
    rho: float,
    alpha: float,
    mu: float | None = None,
    log_to_mlflow: bool = True,
) -> tuple[dict, list[Path]]:
    """Read the sweep under `out_dir`, write the report files there, and each lineage's
    histograms (files, and artifacts of its MLflow run unless `log_to_mlflow` is False)."""
    out = Path(out_dir)
    manifest = read_manifest(out)
    measured = read_points(manifest)
    result = report(measured, manifest=manifest, rho=rho, alpha=alpha, mu=mu)
    written = []
    for m in measured:
        written += write_distributions(
            manifest["run_root"],
            m.point["lineage"],
            out / "distributions",
            log_to_mlflow=log_to_mlflow,
        )
    paths = [out / f for f in FILES]
    paths[0].write_text(json.dumps(result, indent=2, sort_keys=True))
    paths[1].write_text(markdown(result))
    plot_heatmaps(result, paths[2])
    plot_pareto(result, paths[3])
    return result, [*paths, *written]


def log_artifacts(tracking_uri: str, run_id: str, files: list[Path]) -> None:
    """Log the files into the lineage's run under `distributions/` (replacing earlier ones)."""
    from mlflow.tracking import MlflowClient

    from replayrl.engine.tracking import connect_uri

    client = MlflowClient(tracking_uri=connect_uri(tracking_uri))
    for f in files:
        client.log_artifact(run_id, str(f), artifact_path="distributions")
