"""`replayrl experiment --async-split`: the asynchronous split against the synchronous engine,
for K seeds, on wall-clock time.

Three arms per seed, run one after another (interleaved seed by seed, so drift of the
machine affects them alike), each its own lineage under `<out>/runs`, into one MLflow
experiment (`<config name>-split` unless given):

- `sync on-policy`: the inline engine's strict on-policy arm (generate -> train -> generate);
- `async on-policy`: the asynchronous engine's queue, each row used once (W/T as configured);
- `async replay`: the asynchronous engine with the config's replay buffer.

Every seed's v0 (the tiny model's warm start) is made first, so no arm's wall clock includes
it (each lineage's clock starts at its own start, not the process's). The report
(`split.json`, `split.md`) gives, per arm, the median and inter-quartile range over seeds of:
the final held-out pass@1; the wall-clock seconds until the first evaluation at or above the
target (by default the median final pass@1 of the on-policy lineages of both engines), counted
from each lineage's start and read at the publication (async) or end of iteration (sync) of
the evaluated weights; the wall seconds of the whole run; and, for async arms,
γ = (1 + W/T) / (1 + μ) as measured at the end, with μ from the counts and from busy seconds.
A lineage that never reaches the target counts as +∞ in its arm's median. The headline is async replay's median time to target over sync on-policy's.

Knows nothing about how lineages train beyond calling `run_inline` / `run_async`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from replayrl import storage
from replayrl.config import RunConfig, load_config, parse_overrides
from replayrl.errors import ReplayRLError
from replayrl.experiments.compare import read_curve
from replayrl.experiments.seeds import finished, run_lineage, say
from replayrl.experiments.statistics import censored_summary, first_reach, quantile

if TYPE_CHECKING:
    from replayrl.engine.stopping import StopSignals

# (arm label, config arm, asynchronous engine?)
SPLIT_ARMS = (
    ("sync on-policy", "on-policy", False),
    ("async on-policy", "on-policy", True),
    ("async replay", "replay", True),
)


@dataclass(frozen=True)
class SplitLineage:
    """What the report needs of one lineage, read from MLflow."""

    arm: str
    seed: int
    # Evaluations in order: (pass@1, cumulative wall seconds when those weights were made).
    evaluations: list[tuple[float, float]]
    gamma: float | None = None  # from the counts: async/gamma_counts = (1 + W/T) / (1 + async/mu)
    gamma_busy: float | None = None  # the paper's γ, async/gamma: (1 + W/T) / (1 + async/mu_busy)


def split_configs(
    *, config_path: str | Path, seeds: int, out_dir: str | Path, overrides=(), experiment=None
) -> list[tuple[str, RunConfig]]:
    """(arm label, config) of every lineage, in the order they run."""
    if seeds < 1:
        raise ReplayRLError(f"--seeds must be >= 1, got {seeds}.")
    keys = {key for key, _ in parse_overrides(list(overrides))}
    if {"seed", "arm", "storage.lineage", "asynchronous.enabled"} & keys:
        raise ReplayRLError(
            "The split experiment sets seed, arm, lineage and asynchronous.enabled itself; "
            "drop them from --set."
        )
    extra = list(overrides)
    if "storage.run_root" not in keys:
        extra.append(f"storage.run_root={Path(out_dir).resolve() / 'runs'}")
    if "tracking.experiment" not in keys:
        extra.append(f"tracking.experiment={experiment or Path(config_path).stem + '-split'}")
    base = load_config(config_path, overrides=extra)
    out = []
    for i in range(seeds):
        for label, arm, asynchronous in SPLIT_ARMS:
            more = [f"seed={base.seed + i}", f"asynchronous.enabled={str(asynchronous).lower()}"]
            out.append((label, load_config(config_path, overrides=[*extra, *more], arm=arm)))
    return out


def run_split_experiment(
    *,
    config_path: str | Path,
    seeds: int,
    out_dir: str | Path,
    overrides=(),
    experiment: str | None = None,
    target: float | None = None,
    signals: StopSignals | None = None,
) -> dict:
    """Run (or resume) every lineage, then write `split.json` and `split.md` to `out_dir`.
    A signal stops it between iterations (`seeds.run_lineage`); re-run to resume."""
    from replayrl.engine.inline import startup_counts_from_now
    from replayrl.engine.stores import tracking_uri

    configs = split_configs(
        config_path=config_path,
        seeds=seeds,
        out_dir=out_dir,
        overrides=overrides,
        experiment=experiment,
    )
    start = time.perf_counter()
    say(f"{len(configs)} lineages ({seeds} seed(s) x {', '.join(a for a, _, _ in SPLIT_ARMS)})")
    # Every seed's v0 (the tiny model's warm start) before any lineage runs: a lineage's wall
    # clock counts from its start, and the arms must not differ by who paid the warm start.
    from replayrl.engine.inputs import initial_policy

    for label, cfg in configs:
        if label == SPLIT_ARMS[0][0] and not finished(cfg):
            say(f"v0 of seed {cfg.seed} (warm start, cached across runs)")
            initial_policy(cfg)
    startup_counts_from_now()  # so the first lineage's clock does not include the above
    for i, (label, cfg) in enumerate(configs, 1):
        where = f"[{i}/{len(configs)}] {cfg.lineage} ({label})"
        if finished(cfg):
            say(f"{where}: finished earlier, skipped")
            continue
        t0 = time.perf_counter()
        say(f"{where}: running")
        run_lineage(cfg, signals=signals)
        say(f"{where}: done in {time.perf_counter() - t0:.0f} s")
    uri = tracking_uri(configs[0][1])
    lineages = read_split_lineages(uri, configs)
    report = split_report(lineages, target=target)
    report["wall_seconds"] = time.perf_counter() - start
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "split.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    (out / "split.md").write_text(split_markdown(report))
    return report


def read_split_lineages(uri: str, configs: list[tuple[str, RunConfig]]) -> list[SplitLineage]:
    """Each lineage's evaluations (pass@1 with the wall seconds of its weights) and γ, read
    with the comparison's reader (`replayrl.experiments.compare.read_curve`): both engines
    log the same metrics at the same steps."""
    out = []
    for label, cfg in configs:
        state = storage.read_state(storage.lineage_paths(cfg.storage.run_root, cfg.lineage))
        if state is None:
            continue
        curve = read_curve(tracking_uri=uri, run_id=state.mlflow_run_id)
        if curve is None:
            continue
        gamma = gamma_busy = None
        if cfg.asynchronous.enabled:
            gamma = curve.last.get("async/gamma_counts")
            gamma_busy = curve.last.get("async/gamma")  # from async/mu_busy
        evaluations = [
            (p, s) for p, s in zip(curve.pass1, curve.wall_seconds, strict=True) if math.isfinite(s)
        ]
        out.append(SplitLineage(label, cfg.seed, evaluations, gamma, gamma_busy))
    return out


def time_to(evaluations: list[tuple[float, float]], target: float) -> float:
    """Wall seconds of the first evaluation at or above `target`; +inf when none is."""
    seconds = [s for _, s in evaluations]
    reached = first_reach(seconds, [p for p, _ in evaluations], target)
    return math.inf if reached is None else reached


def split_report(lineages: list[SplitLineage], *, target: float | None = None) -> dict:
    """Per arm: final pass@1, seconds to target, γ (median and IQR over seeds), and the
    headline ratio async replay / sync on-policy of the median seconds to target."""
    finals = {lin.arm: [] for lin in lineages}
    for lin in lineages:
        if lin.evaluations:
            finals[lin.arm].append(lin.evaluations[-1][0])
    on_policy = [f for arm, fs in finals.items() if "on-policy" in arm for f in fs]
    if target is None:
        if not on_policy:
            raise ReplayRLError("no on-policy lineage has an evaluation: nothing to target")
        target = quantile(on_policy, 0.5)
    arms = {}
    for label, _, _ in SPLIT_ARMS:
        mine = [lin for lin in lineages if lin.arm == label and lin.evaluations]
        times = [time_to(lin.evaluations, target) for lin in mine]
        gammas = [lin.gamma for lin in mine if lin.gamma is not None]
        gammas_busy = [lin.gamma_busy for lin in mine if lin.gamma_busy is not None]
        arms[label] = {
            "seeds": [lin.seed for lin in mine],
            "final_pass1": censored_summary(finals.get(label, [])),
            "seconds_to_target": censored_summary(times),
            "reached": sum(math.isfinite(t) for t in times),
            "gamma": censored_summary(gammas) if gammas else None,
            "gamma_busy": censored_summary(gammas_busy) if gammas_busy else None,
            "final_wall_seconds": censored_summary([lin.evaluations[-1][1] for lin in mine]),
            "per_seed": [
                {
                    "seed": lin.seed,
                    "final_pass1": lin.evaluations[-1][0],
                    "final_wall_seconds": lin.evaluations[-1][1],
                    "seconds_to_target": None if math.isinf(t) else t,
                    "gamma": lin.gamma,
                    "gamma_busy": lin.gamma_busy,
                }
                for lin, t in zip(mine, times, strict=True)
            ],
        }
    base = arms["sync on-policy"]["seconds_to_target"]["median"]
    replay = arms["async replay"]["seconds_to_target"]["median"]
    ratio = None
    if base and replay is not None:
        ratio = replay / base
    elif base and replay is None:
        ratio = math.inf
    return {
        "target_pass1": target,
        "arms": arms,
        "ratio_async_replay_over_sync_on_policy": ratio,
        "goal_ratio": 0.7,
    }


def _iqr(s: dict | None, spec: str) -> str:
    if not s or s.get("median") is None:
        return "not reached" if s and s.get("n") else "-"

    def f(v):
        return "∞" if v is None else format(v, spec)

    return f"{f(s['median'])} [{f(s['q25'])}, {f(s['q75'])}]"


def split_markdown(report: dict) -> str:
    lines = [
        f"Target pass@1: **{report['target_pass1']:.3f}** (median final pass@1 of the "
        "on-policy lineages, both engines). Median [IQR] over seeds.",
        "",
        "| arm | seeds | final pass@1 | wall seconds to target | reached | γ (counts) "
        "| γ (busy seconds) | wall seconds, whole run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, a in report["arms"].items():
        lines.append(
            f"| {label} | {len(a['seeds'])} | {_iqr(a['final_pass1'], '.3f')} | "
            f"{_iqr(a['seconds_to_target'], '.0f')} | {a['reached']}/{len(a['seeds'])} | "
            f"{_iqr(a['gamma'], '.2f')} | {_iqr(a['gamma_busy'], '.2f')} | "
            f"{_iqr(a['final_wall_seconds'], '.0f')} |"
        )
    ratio = report["ratio_async_replay_over_sync_on_policy"]
    shown = "-" if ratio is None else ("∞" if math.isinf(ratio) else f"{ratio:.2f}x")
    lines += [
        "",
        "γ = (1 + W/T) / (1 + μ), the paper's compute ratio with a buffer over without: "
        "μ from the counts, (rows trained per trainer) / (rows generated per worker), as "
        "logged in `async/gamma_counts`, which tracks the replay ratio rather than the cost "
        "ratio while a role waits; and from busy device-seconds (`async/mu_busy`), logged "
        "as `async/gamma`.",
        "",
        f"Async replay's median wall-clock time to target over sync on-policy's: **{shown}** "
        f"(goal ≤ {report['goal_ratio']}x).",
    ]
    return "\n".join(lines) + "\n"
