"""`replayrl experiment`: the arms for K seeds with the inline engine, into one MLflow
experiment, then the comparison.

The arms are on-policy and the config's replay settings; with `plain_replay` also
`replay-plain`, the same replay settings with positive bias δ = 0, which separates replay's
effect from positive-bias retention's. Seeds are the config's `seed`, `seed + 1`, …; each
(arm, seed) is one lineage named `<task>-<arm>-s<seed>` under `<out>/runs` (unless
`storage.run_root` is set). The lineages run one after the other, interleaved seed by seed
(on-policy, replay[, replay-plain] for the first seed, then the next), so a partial
experiment already holds matched sets and slow drift of the machine affects the arms alike. Re-running the same command skips finished lineages and resumes an
interrupted one after its last recorded iteration (the inline engine resumes by itself);
raising `iterations` extends them all. Progress goes to stderr.

Knows nothing about how a lineage trains or how arms are compared: it calls
`replayrl.engine.inline.run_inline` and `replayrl.experiments.compare.run_compare`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from replayrl import storage
from replayrl.config import RunConfig, load_config, parse_overrides
from replayrl.errors import ReplayRLError
from replayrl.experiments.statistics import PAPER_MU

if TYPE_CHECKING:
    from replayrl.engine.stopping import StopSignals

DEFAULT_EXPERIMENT = "replayrl"  # TrackingConfig's default: replaced by the config's name


@dataclass(frozen=True)
class ExperimentResult:
    experiment: str
    tracking_uri: str
    run_root: str
    lineages: list[str]
    wall_seconds: float
    comparison: object  # replayrl.experiments.compare.CompareResult


def lineage_configs(
    *,
    config_path: str | Path,
    seeds: int,
    out_dir: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    experiment: str | None = None,
    plain_replay: bool = False,
) -> list[RunConfig]:
    """The configs of every (seed, arm) lineage, in the order they run."""
    if seeds < 1:
        raise ReplayRLError(f"--seeds must be >= 1, got {seeds}.")
    keys = {key for key, _ in parse_overrides(list(overrides))}
    if "storage.lineage" in keys:
        raise ReplayRLError(
            "An experiment names its lineages <task>-<arm>-s<seed>; drop --set storage.lineage."
        )
    if {"seed", "arm"} & keys:
        raise ReplayRLError(
            "An experiment runs both arms over --seeds seeds from the config's seed; set the "
            "first seed in the config file, not with --set seed/arm."
        )
    extra = list(overrides)
    if "storage.run_root" not in keys:
        extra.append(f"storage.run_root={Path(out_dir).resolve() / 'runs'}")
    base = load_config(config_path, overrides=extra)
    if experiment is None and "tracking.experiment" not in keys:
        experiment = (
            base.tracking.experiment
            if base.tracking.experiment != DEFAULT_EXPERIMENT
            else Path(config_path).stem
        )
    if experiment is not None:
        extra.append(f"tracking.experiment={experiment}")
    if plain_replay and base.buffer.positive_bias == 0:
        raise ReplayRLError(
            "--plain-replay adds a replay arm with buffer.positive_bias = 0, but this config's "
            "replay arm already has 0: drop --plain-replay, or set buffer.positive_bias > 0."
        )
    return [
        load_config(config_path, overrides=[*extra, f"seed={base.seed + i}"], arm=arm)
        for i in range(seeds)
        for arm in arms(plain_replay)
    ]


def arms(plain_replay: bool) -> tuple[str, ...]:
    """The arms an experiment runs for each seed, in order."""
    return ("on-policy", "replay", "replay-plain") if plain_replay else ("on-policy", "replay")


def finished(cfg: RunConfig) -> bool:
    """The lineage reached its configured end, either engine: an inline lineage's state is
    past its last iteration; an asynchronous one published its last gradient step and its
    segment is done."""
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    if cfg.asynchronous.enabled:
        from replayrl.engine.asynchronous import board as async_board

        pointer = async_board.latest(paths) if storage.exists(paths.state) else None
        segment = async_board.read_segment(paths) if pointer else None
        return bool(
            pointer
            and pointer.version >= cfg.total_gradient_steps
            and segment is not None
            and segment.done
        )
    state = storage.read_state(paths)
    return state is not None and state.next_iteration > cfg.iterations


def say(text: str) -> None:
    print(f"replayrl experiment: {text}", file=sys.stderr, flush=True)


def run_lineage(cfg: RunConfig, *, signals: StopSignals | None = None):
    """Run (or resume) one lineage of an experiment or sweep on its engine: inline, or the
    asynchronous split when `cfg.asynchronous.enabled`. With `signals` (one `StopSignals`
    for the whole command) a SIGTERM or SIGINT stops it at the engine's next safe point, or
    before it starts, with `Stopped`; its lease is released and re-running the command
    resumes it."""
    if signals is not None:
        signals.check(f"before lineage {cfg.lineage} started")
    if cfg.asynchronous.enabled:
        from replayrl.engine.asynchronous.supervisor import run_async

        return run_async(cfg, signals=signals)
    from replayrl.engine.inline import run_inline

    return run_inline(cfg, signals=signals)


def run_experiment(
    *,
    config_path: str | Path,
    seeds: int,
    out_dir: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    experiment: str | None = None,
    target: float | None = None,
    what_if_mu: float | None = PAPER_MU,
    plain_replay: bool = False,
    metric: str = "pass1",
    peak: bool = False,
    signals: StopSignals | None = None,
) -> ExperimentResult:
    """Run (or resume) every lineage, then write the comparison files to `out_dir` and log
    them to MLflow (`metric` and `peak` as `run_compare`'s). A lineage that fails stops the
    experiment (re-run to resume); so does a signal, between iterations (`run_lineage`)."""
    from replayrl.engine.stores import tracking_uri
    from replayrl.experiments.compare import run_compare

    configs = lineage_configs(
        config_path=config_path,
        seeds=seeds,
        out_dir=out_dir,
        overrides=overrides,
        experiment=experiment,
        plain_replay=plain_replay,
    )
    first = configs[0]
    names = arms(plain_replay)
    uri = tracking_uri(first)
    start = time.perf_counter()
    say(
        f"{len(configs)} lineages ({seeds} seed(s) × {', '.join(names)}), {first.iterations} "
        f"iterations each; run root {first.storage.run_root}; MLflow {uri}, experiment "
        f"'{first.tracking.experiment}'"
    )
    for i, cfg in enumerate(configs, 1):
        where = f"[{i}/{len(configs)}] {cfg.lineage} (y = {cfg.replay_ratio:g}, N = {cfg.buffer.capacity})"
        if finished(cfg):
            say(f"{where}: finished earlier, skipped")
            continue
        t0 = time.perf_counter()
        say(f"{where}: running")
        summary = run_lineage(cfg, signals=signals)
        rows = getattr(summary, "rows", None)  # an asynchronous summary has none
        final = rows[-1].pass1 if rows else getattr(summary, "initial_pass1", None)
        say(
            f"{where}: done in {time.perf_counter() - t0:.0f} s"
            + (f", final pass@1 {final:.3f}" if final is not None else "")
        )
    say(f"comparing the arms into {out_dir}")
    result = run_compare(
        tracking_uri=uri,
        experiment=first.tracking.experiment,
        out_dir=out_dir,
        target=target,
        what_if_mu=what_if_mu,
        metric=metric,
        peak=peak,
        note=(
            f"**Run order:** `replayrl experiment` ran the lineages one after another on one "
            f"machine, interleaved seed by seed ({', '.join(names)} for seed {first.seed}, "
            f"then the next seed), so drift of the machine affects the arms alike."
        ),
    )
    return ExperimentResult(
        experiment=first.tracking.experiment,
        tracking_uri=uri,
        run_root=first.storage.run_root,
        lineages=[c.lineage for c in configs],
        wall_seconds=time.perf_counter() - start,
        comparison=result,
    )
