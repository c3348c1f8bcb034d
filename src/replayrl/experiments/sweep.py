"""`replayrl sweep`: one lineage per point of a grid over config keys, run here one after the
other (resumable) or submitted to Kubeflow as one run per point; `sweep_report` reports it.

A grid is a list of axes, each a config key (dotted, e.g. `buffer.capacity`) with a list of
values; the points are every combination. Short names stand for the paper's symbols:

- `N` = `buffer.capacity`, `lr` = `train.lr`, `W` = `asynchronous.workers`,
  `T` = `asynchronous.trainers`, `seed` = `seed`;
- `x` and `y` (also `replay.x`, `replay.y`): Theorem 4.5's staleness horizon and replay ratio
  per gradient step. A loop that generates R_iter = G·p rollouts per iteration and takes S
  steps of B has x = S·N / R_iter and y = S·B / R_iter, so a point's y sets
  `rollout.prompts_per_iteration` p = S·B / (y·G) and its x sets `buffer.capacity`
  N = x·R_iter / S (the same mapping as `replayrl advise`). Both must come out whole numbers
  (within 1 %, then rounded): a y or x this loop cannot realise is refused, naming the
  nearest that it can.
- Several keys varied together are one axis: `W:T=6:2,5:3,4:4`.

Seeds: `seeds` K adds an axis `seed` = the config's seed, seed + 1, …, unless the grid has one.
A *cell* is a point without its seed (the seeds of a cell are its repeats).

Every point is a lineage named `<task>-<arm>-<label>` with a label made of its values in grid
order (`N512-y2-s0`), so a re-run finds the same lineages: a finished lineage (its state says
it reached `iterations`) is skipped and an interrupted one resumes. All lineages go to one
MLflow experiment (default `<config file name>-sweep`), with one run per lineage; the
manifest `sweep.json` in the output folder lists the points for `replayrl sweep report`.

The paper's named grids (`named_grid`, `--named`): `seeds-n` (N), `wt-n` ((W, T) × N, Figs. 3,
13, 14), `lr-n` (learning rate × N, Fig. 4) and `xy` (an (x, y) grid to test the advisor),
with values derived from the config's loop.

Knows nothing about how a lineage trains: it calls the inline or asynchronous engine
(`replayrl.kfp.sweep` submits the same points to Kubeflow).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from replayrl.config import RunConfig, load_config, parse_overrides
from replayrl.errors import ReplayRLError
from replayrl.experiments.seeds import DEFAULT_EXPERIMENT, finished, run_lineage

if TYPE_CHECKING:
    from replayrl.engine.stopping import StopSignals

ALIASES = {
    "N": "buffer.capacity",
    "lr": "train.lr",
    "W": "asynchronous.workers",
    "T": "asynchronous.trainers",
    "replay.x": "x",
    "replay.y": "y",
}
DERIVED = ("x", "y")  # Theorem 4.5's x and y, realised through p and N
MANIFEST = "sweep.json"
NAMED_GRIDS = ("seeds-n", "wt-n", "lr-n", "xy")


def named_grid(name: str, cfg: RunConfig) -> list[str]:
    """The paper's grids (§5, App. 10) for `cfg`'s loop, as `--grid` specs. Buffer sizes are
    whole multiples k of the fresh rows per iteration, N = k·R_iter, k = 1, 2, 4, 8, 16, 32
    (this loop needs N >= R_iter; the paper's Qwen3-0.6B sizes 64 … 20736 were per
    asynchronous gradient step, not per iteration):

    - `seeds-n`: N (with --seeds K: seeds × N, Fig. 3 left);
    - `wt-n`: (W, T) in (7, 1), (6, 2), (5, 3), (4, 4) × N (Figs. 3 right, 13, 14; needs
      `asynchronous.enabled: true`);
    - `lr-n`: train.lr × 1/3, 1, 3 × N (Fig. 4);
    - `xy`: the y this loop realises nearest 1, 2, 4, 8 (whole prompts per iteration) × x =
      x0·1, 2, 4, 8 gradient steps, x0 the smallest multiple of S >= the largest y (so that
      N >= B), to test the advisor.
    """
    s, b, g = cfg.train.steps_per_iteration, cfg.train.batch_size, cfg.rollout.samples_per_prompt
    n = "N=" + ",".join(str(k * cfg.rollouts_per_iteration) for k in (1, 2, 4, 8, 16, 32))
    if name == "seeds-n":
        return [n]
    if name == "wt-n":
        return ["W:T=7:1,6:2,5:3,4:4", n]
    if name == "lr-n":
        return ["lr=" + ",".join(f"{cfg.train.lr * f:.3g}" for f in (1 / 3, 1, 3)), n]
    if name == "xy":
        top = max(1, s * b // g)  # prompts for y = 1
        ys = [s * b / (g * min(top, max(1, round(s * b / (g * t))))) for t in (1, 2, 4, 8)]
        # x >= y keeps N >= B (a batch fits the buffer); a multiple of S keeps N whole.
        x0 = s * math.ceil(max(ys) / s - 1e-9)
        return [
            "x=" + ",".join(str(x0 * k) for k in (1, 2, 4, 8)),
            "y=" + ",".join(dict.fromkeys(f"{y:.6g}" for y in ys)),
        ]
    raise ReplayRLError(f"Unknown named grid '{name}'; choose one of: {', '.join(NAMED_GRIDS)}.")


@dataclass(frozen=True)
class Axis:
    """Config keys varied together, and their values (one tuple per point, one per key)."""

    name: str  # as given, e.g. "N" or "W:T"
    keys: tuple[str, ...]  # resolved: "buffer.capacity", "x", ...
    values: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Point:
    """One lineage of the sweep."""

    lineage: str
    values: dict[str, str]  # axis name -> value as given ("6:2" for W:T)
    overrides: list[str]  # the --set overrides that make it, seed included
    config: RunConfig

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def cell(self) -> str:
        """The point without its seed, e.g. "N=512, y=2" ("all" for a seeds-only grid)."""
        return ", ".join(f"{k}={v}" for k, v in self.values.items() if k != "seed") or "all"


# ---------------------------------------------------------------- the grid


def parse_axis(spec: str) -> Axis:
    """`KEY=V1,V2` or `K1:K2=a1:a2,b1:b2` as an Axis.

    >>> parse_axis("W:T=6:2,4:4").keys
    ('asynchronous.workers', 'asynchronous.trainers')
    """
    if "=" not in spec:
        raise ReplayRLError(f"--grid expects KEY=V1,V2,..., got '{spec}'.")
    name, raw = (s.strip() for s in spec.split("=", 1))
    keys = tuple(ALIASES.get(k.strip(), k.strip()) for k in name.split(":"))
    if not all(keys) or len(set(keys)) != len(keys):
        raise ReplayRLError(f"--grid {spec}: the keys must be distinct and non-empty.")
    if {"storage.lineage", "storage.run_root", "arm"} & set(keys):
        raise ReplayRLError(
            f"--grid {name}: a sweep names its lineages and run root itself; grid over "
            f"training keys (arm: run one sweep per arm)."
        )
    values = []
    for item in (v.strip() for v in raw.split(",")):
        parts = tuple(p.strip() for p in item.split(":")) if len(keys) > 1 else (item,)
        if len(parts) != len(keys) or not all(parts):
            raise ReplayRLError(
                f"--grid {spec}: value '{item}' needs {len(keys)} part(s) separated by ':'."
            )
        values.append(parts)
    if len(set(values)) != len(values):
        raise ReplayRLError(f"--grid {spec}: a value is repeated.")
    return Axis(name, keys, tuple(values))


def read_sweep_file(path: str | Path) -> dict:
    """A sweep YAML file: `config` (path, relative to the file), `grid` ({key: [values]} or a
    list of `KEY=V1,V2` strings), optional `named`, `seeds`, `set` (list of KEY=VALUE),
    `experiment`."""
    p = Path(path)
    try:
        tree = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ReplayRLError(f"Cannot read sweep file '{path}': {e}.") from None
    if not isinstance(tree, dict):
        raise ReplayRLError(f"Sweep file '{path}' must be a mapping (config, grid, seeds, set).")
    unknown = set(tree) - {"config", "grid", "named", "seeds", "set", "experiment"}
    if unknown:
        raise ReplayRLError(
            f"Sweep file '{path}': unknown key(s) {', '.join(sorted(unknown))}; use config, "
            f"grid, named, seeds, set, experiment."
        )
    grid = tree.get("grid") or []
    if isinstance(grid, dict):
        grid = [
            f"{k}={','.join(str(x) for x in (v if isinstance(v, list) else [v]))}"
            for k, v in grid.items()
        ]
    out = dict(tree, grid=[str(g) for g in grid])
    if "config" in tree:
        out["config"] = str((p.parent / str(tree["config"])).resolve())
    return out


def grid_axes(grid: list[str], *, named: list[str] = ()) -> list[Axis]:
    """The axes of a named grid's specs (if any), then of each `--grid`; a key may appear
    only once."""
    axes = [parse_axis(s) for s in [*named, *grid]]
    keys = [k for a in axes for k in a.keys]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ReplayRLError(f"The grid varies {', '.join(repeated)} twice; give each key once.")
    return axes


def _label(axis: Axis, value: tuple[str, ...]) -> str:
    """A lineage-name part for one axis value: "N512", "W6-T2", "capacity512"."""
    names = axis.name.split(":") if len(axis.keys) > 1 else [axis.name]
    parts = []
    for name, key, v in zip(names, axis.keys, value, strict=True):
        short = name if name in ALIASES or name in DERIVED else key.rsplit(".", 1)[-1]
        short = {"seed": "s", "replay.x": "x", "replay.y": "y"}.get(short, short)
        parts.append(re.sub(r"[^A-Za-z0-9._-]", "_", f"{short}{v}"))
    return "-".join(parts)


def realise_xy(cfg: RunConfig, *, x: float | None, y: float | None) -> list[str]:
    """The overrides (`rollout.prompts_per_iteration`, `buffer.capacity`) that give `cfg`'s
    loop the replay ratio y and staleness horizon x of Theorem 4.5 (see the module
    docstring), and `buffer.sample_with_replacement=true` when y > S makes a batch larger
    than one iteration's fresh rows; one that the loop cannot realise in whole prompts and
    rows is refused."""
    s, b, g = cfg.train.steps_per_iteration, cfg.train.batch_size, cfg.rollout.samples_per_prompt
    out = []
    p = cfg.rollout.prompts_per_iteration
    if y is not None:
        if not y > 0:
            raise ReplayRLError(f"y must be > 0, got {y}.")
        exact = s * b / (y * g)
        p = max(1, round(exact))
        if abs(p - exact) > 0.01 * exact:
            raise ReplayRLError(
                f"y = {y:g} needs {exact:.3g} prompts per iteration (S·B / (y·G) with S = {s}, "
                f"B = {b}, G = {g}); the nearest whole number gives y = {s * b / (g * p):.3g}."
            )
        out.append(f"rollout.prompts_per_iteration={p}")
        if b > g * p and not cfg.buffer.sample_with_replacement:
            # y > S: a batch is larger than one iteration's fresh rows, which is all the
            # first iteration's buffer holds (as `replayrl advise` sets it too).
            out.append("buffer.sample_with_replacement=true")
    if x is not None:
        if not x > 0:
            raise ReplayRLError(f"x must be > 0, got {x}.")
        exact = x * g * p / s
        n = max(1, round(exact))
        if abs(n - exact) > 0.01 * exact:
            raise ReplayRLError(
                f"x = {x:g} needs a buffer of {exact:.3g} rows (x·R_iter / S with R_iter = "
                f"{g * p}, S = {s}); the nearest whole number gives x = {s * n / (g * p):.3g}."
            )
        out.append(f"buffer.capacity={n}")
    return out


@dataclass(frozen=True)
class Sweep:
    config_path: str
    points: list[Point]
    axes: list[Axis]
    experiment: str
    run_root: str
    out_dir: Path


def sweep_points(
    *,
    config_path: str | Path,
    grid: list[str],
    out_dir: str | Path,
    named: str | None = None,
    seeds: int = 1,
    overrides: list[str] | tuple[str, ...] = (),
    experiment: str | None = None,
    run_root: str | None = None,
) -> Sweep:
    """Every point of the grid (seed axis last, so the seeds of a cell run one after the
    other), each config loaded and checked before anything runs."""
    if seeds < 1:
        raise ReplayRLError(f"--seeds must be >= 1, got {seeds}.")
    keys = {key for key, _ in parse_overrides(list(overrides))}
    if {"storage.lineage", "storage.run_root"} & keys:
        raise ReplayRLError(
            "A sweep names its lineages and run root itself; drop --set storage.lineage / "
            "storage.run_root (use --run-root)."
        )
    extra = list(overrides)
    root = run_root or str(Path(out_dir).resolve() / "runs")
    extra.append(f"storage.run_root={root}")
    base = load_config(config_path, overrides=extra)
    axes = grid_axes(list(grid), named=named_grid(named, base) if named else [])
    if not axes and seeds == 1:
        raise ReplayRLError("A sweep needs a grid: --grid KEY=V1,V2, --named NAME or --seeds K.")
    wt = {"asynchronous.workers", "asynchronous.trainers"} & {k for a in axes for k in a.keys}
    if wt and not base.asynchronous.enabled:
        raise ReplayRLError(
            f"The grid varies {', '.join(sorted(wt))}, which only the asynchronous engine uses: "
            f"--set asynchronous.enabled=true (or a config with it)."
        )
    if not any("seed" in a.keys for a in axes) and seeds > 1:
        axes.append(Axis("seed", ("seed",), tuple((str(base.seed + i),) for i in range(seeds))))
    if experiment is None and "tracking.experiment" not in keys:
        experiment = (
            base.tracking.experiment
            if base.tracking.experiment != DEFAULT_EXPERIMENT
            else f"{Path(config_path).stem}-sweep"
        )
    if experiment is not None:
        extra.append(f"tracking.experiment={experiment}")
    points = []
    for combo in itertools.product(*(a.values for a in axes)):
        plain: list[str] = []
        derived: dict[str, float] = {}
        for axis, value in zip(axes, combo, strict=True):
            for key, v in zip(axis.keys, value, strict=True):
                if key in DERIVED:
                    try:
                        derived[key] = float(v)
                    except ValueError:
                        raise ReplayRLError(f"--grid {key}: '{v}' is not a number.") from None
                else:
                    plain.append(f"{key}={v}")
        label = "-".join(_label(a, v) for a, v in zip(axes, combo, strict=True))
        sets = [*extra, *plain]
        try:
            if derived:
                sets += realise_xy(
                    load_config(config_path, overrides=sets),
                    x=derived.get("x"),
                    y=derived.get("y"),
                )
            first = load_config(config_path, overrides=sets)
        except ReplayRLError as e:
            raise ReplayRLError(f"Grid point {label}: {e}") from None
        name = (
            f"{first.task.name}-{'async-' if first.asynchronous.enabled else ''}{first.arm}-{label}"
        )
        sets.append(f"storage.lineage={name}")
        cfg = load_config(config_path, overrides=sets)
        values = {a.name: ":".join(v) for a, v in zip(axes, combo, strict=True)}
        points.append(Point(name, values, sets, cfg))
    return Sweep(
        config_path=str(config_path),
        points=points,
        axes=axes,
        experiment=points[0].config.tracking.experiment,
        run_root=root,
        out_dir=Path(out_dir),
    )


def write_manifest(sweep: Sweep) -> Path:
    """`sweep.json`: what `replayrl sweep report` reads (the points and their configs)."""
    doc = {
        "config": sweep.config_path,
        "experiment": sweep.experiment,
        "run_root": sweep.run_root,
        "axes": [{"name": a.name, "keys": list(a.keys)} for a in sweep.axes],
        "points": [
            {
                "lineage": p.lineage,
                "cell": p.cell,
                "values": p.values,
                "seed": p.seed,
                "arm": p.config.arm,
                "asynchronous": p.config.asynchronous.enabled,
                "iterations": p.config.iterations,
                "x": p.config.staleness_horizon,
                "y": p.config.replay_ratio,
                "buffer_capacity": p.config.buffer.capacity,
                "prompts_per_iteration": p.config.rollout.prompts_per_iteration,
                "batch_size": p.config.train.batch_size,
                "steps_per_iteration": p.config.train.steps_per_iteration,
                "samples_per_prompt": p.config.rollout.samples_per_prompt,
                "overrides": p.overrides,
            }
            for p in sweep.points
        ],
    }
    sweep.out_dir.mkdir(parents=True, exist_ok=True)
    path = sweep.out_dir / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)
    return path


# ---------------------------------------------------------------- running here


def say(text: str) -> None:
    print(f"replayrl sweep: {text}", file=sys.stderr, flush=True)


def run_local(sweep: Sweep, *, signals: StopSignals | None = None) -> dict[str, str]:
    """Run (or resume) every point's lineage, one after the other, then write its histograms
    (`sweep_report.write_distributions`); lineage -> "skipped" | "ran". A lineage that fails
    stops the sweep (re-run to resume it); so does a signal, between iterations
    (`seeds.run_lineage`)."""
    write_manifest(sweep)
    done: dict[str, str] = {}
    n = len(sweep.points)
    say(f"{n} lineages, run root {sweep.run_root}, experiment '{sweep.experiment}'")
    for i, p in enumerate(sweep.points, 1):
        cfg = p.config
        where = f"[{i}/{n}] {p.lineage} (x = {cfg.staleness_horizon:g}, y = {cfg.replay_ratio:g})"
        if finished(cfg):
            say(f"{where}: finished earlier, skipped")
            done[p.lineage] = "skipped"
            continue
        t0 = time.perf_counter()
        say(f"{where}: running")
        run_lineage(cfg, signals=signals)
        say(f"{where}: done in {time.perf_counter() - t0:.0f} s")
        done[p.lineage] = "ran"
        # Its Fig. 2 histograms, as files and artifacts of its MLflow run.
        from replayrl.experiments.sweep_report import write_distributions

        write_distributions(sweep.run_root, p.lineage, sweep.out_dir / "distributions")
    return done
