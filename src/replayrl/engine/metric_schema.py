"""Every metric a lineage logs to MLflow, declared once: name, unit, step axis, which engines
log it, and what it means. Both engines build their metrics with the functions below and log
them through `replayrl.engine.tracking.log_groups`, which refuses a name not declared here.

The step convention, for every engine: **an MLflow step is a gradient step**. The inline and
Kubeflow engines log iteration t's metrics at step t·S (S = `train.steps_per_iteration`), the
gradient step the iteration ends on, and log `iteration` as a metric so MLflow can plot
against iterations; the asynchronous engine logs at each publication's gradient step. Step 0
is the warm-start evaluation. Metrics whose section ends in `_by_ktokens` are logged a second
time at step = thousands of generated tokens (the paper's compute axis).

A metric whose value is not finite is not logged (NaN means "no value": e.g. the sample ages
of a step that drew no row, or steps since last use when no drawn row was used before): both
engines follow that rule, so the same inputs give the same logged set.

This module knows names and arithmetic on numbers; it knows nothing about MLflow, the buffer
or the engines' processes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from replayrl.core.ledger import CUMULATIVE_KEYS, DEVICE_PARTS, WALL_PARTS
from replayrl.core.metrics import percentile
from replayrl.core.staleness import summarize_ages, summarize_since_last_use

INLINE = "inline"  # the inline loop and every Kubeflow layout (the same record path)
ASYNC = "async"
BOTH = frozenset({INLINE, ASYNC})

GRADIENT_STEP = "gradient step"
KTOKENS = "thousands of generated tokens"


@dataclass(frozen=True)
class Metric:
    name: str  # may hold one `{placeholder}` (a family: one metric per value)
    unit: str
    help: str
    engines: frozenset[str] = BOTH
    axis: str = GRADIENT_STEP
    # When it is logged, if not at every record: None = always (given its engine).
    when: str | None = None

    def pattern(self) -> re.Pattern:
        return re.compile(re.sub(r"\\\{\w+\\\}", r"[a-z0-9_]+", re.escape(self.name)) + "$")


def _m(name, unit, help, engines=BOTH, when=None, axis=GRADIENT_STEP) -> Metric:
    return Metric(name, unit, help, frozenset(engines), axis, when)


_CPU = "the process-CPU clock was read (every record since it exists)"
_DEVICE = "the part ran on a CUDA device (absent on the CPU)"
_DEVICE_AXIS = (
    "generation and training ran on a CUDA device in this process (absent on the CPU and "
    "under train.distributed)"
)
_EVAL = "an evaluation is due (v0, every eval.every iterations, the last)"
_SAMPLED = "eval.pass1_temperature is set"

EVAL_FIELDS = {
    "pass1": ("fraction", "held-out greedy pass@1"),
    "pass_at_{k}": ("fraction", "held-out pass@k from eval.num_samples sampled completions"),
    "sample_accuracy": ("fraction", "mean accuracy of the sampled completions"),
    "entropy": ("nats", "mean token entropy of the sampling distribution"),
    "response_length": ("tokens", "mean sampled completion length"),
    "unparsed": ("fraction", "sampled completions whose answer could not be parsed"),
    "pass1_sampled": ("fraction", "pass@1 at the paper's low temperature (eval.pass1_*)"),
}
REPLAY_SHARED = {
    "sample_age_mean": "mean age of the rows a step drew, in gradient steps",
    "sample_age_p50": "median age of the rows drawn, in gradient steps",
    "sample_age_p95": "95th percentile of the ages of the rows drawn",
    "sample_age_max": "oldest row drawn, in gradient steps",
    "steps_since_last_use_mean": "mean gradient steps since a drawn row's previous use",
    "frac_first_use": "share of uses whose row was never used before",
}


def _shared() -> list[Metric]:
    """What both engines log, with the same meaning."""
    out = [
        _m(
            "iteration",
            "iterations",
            "the other axis: the iteration a record closes (asynchronous: gradient step / S)",
        ),
        _m("train/loss", "-", "mean policy loss over the record's gradient steps"),
        _m("train/clip_fraction", "fraction", "tokens whose ratio was clipped"),
        _m("train/mean_ratio", "-", "mean ratio π_θ / π_behaviour"),
        _m("train/grad_norm", "-", "mean gradient norm before clipping"),
        _m("train/sample_reward", "-", "mean reward of the rows trained on"),
        _m("cumulative/generated_tokens", "tokens", "completion tokens generated so far"),
        _m("cumulative/rollouts_generated", "rollouts", "rows generated so far"),
        _m("cumulative/rollouts_trained", "row uses", "row uses by gradient steps so far"),
        _m("cumulative/wall_seconds", "s", "wall clock of the lineage so far"),
        _m(
            "cumulative/generation_seconds",
            "s",
            "generation seconds so far (async: the W workers' busy seconds, summed)",
        ),
        _m(
            "cumulative/training_seconds",
            "s",
            "training seconds so far (async: busy device-seconds, T x rank 0's busy seconds)",
        ),
        _m(
            "cumulative/seconds",
            "s",
            "generation + training seconds: the comparison's compute axis",
        ),
        _m(
            "accuracy/pass1",
            "fraction",
            "copy of eval/pass1, in the section MLflow shows first",
            when=_EVAL,
        ),
        _m(
            "accuracy/pass1_by_ktokens",
            "fraction",
            "copy of eval_by_ktokens/pass1",
            when=_EVAL,
            axis=KTOKENS,
        ),
    ]
    for key, (unit, help) in EVAL_FIELDS.items():
        when = _SAMPLED if key == "pass1_sampled" else _EVAL
        out.append(_m(f"eval/{key}", unit, help, when=when))
        out.append(_m(f"eval_by_ktokens/{key}", unit, help, when=when, axis=KTOKENS))
    for key, help in REPLAY_SHARED.items():
        out.append(_m(f"replay/{key}", "gradient steps" if "frac" not in key else "fraction", help))
    return out


def _inline() -> list[Metric]:
    """The inline record: one iteration = generate, compact, S steps, evaluate."""
    out: list[Metric] = []
    shared = {m.name for m in _shared()}
    inline = [
        ("replay/ratio", "-", "row uses per row generated this iteration (y)"),
        ("replay/unique_rollouts", "rows", "distinct rows the iteration drew"),
        ("replay/steps_since_last_use_p50", "gradient steps", "median steps since last use"),
        ("rollout/mean_reward", "-", "mean reward of the rows generated"),
        ("rollout/frac_correct", "fraction", "rows generated that were correct"),
        ("rollout/frac_unparsed", "fraction", "rows generated whose answer could not be parsed"),
        ("rollout/frac_truncated", "fraction", "rows generated that hit max_new_tokens"),
        ("rollout/mean_completion_tokens", "tokens", "mean completion length generated"),
        ("buffer/rows", "rows", "rows in the buffer after retention"),
        ("buffer/files", "files", "data files of the buffer's version"),
        ("buffer/bytes", "bytes", "bytes of the buffer's data files"),
        ("buffer/rows_deleted", "rows", "rows retention deleted this iteration"),
        ("buffer/version", "version", "the Delta version training pinned"),
        ("buffer/bias_rows", "rows", "rows kept only for the positive bias δ"),
        ("buffer/bias_age_mean", "gradient steps", "mean age of those rows"),
        ("buffer/bias_age_max", "gradient steps", "oldest of those rows"),
        ("train/checkpoint_written", "0/1", "1 when the iteration wrote a full checkpoint"),
        ("ledger/mu", "-", "μ: generation over training seconds per rollout"),
        ("ledger/generation_seconds_per_rollout", "s", "generation seconds per row"),
        ("ledger/training_seconds_per_rollout", "s", "training seconds per row use"),
        ("ledger/flops", "FLOPs", "estimated FLOPs of the iteration"),
        ("ledger/coverage", "fraction", "share of the wall clock the named parts explain"),
        ("ledger/mu_effective", "-", "μ with every overhead charged"),
        ("cumulative/flops", "FLOPs", "estimated FLOPs so far"),
    ]
    out += [_m(n, u, h, {INLINE}) for n, u, h in inline]
    cpu_totals = ("generation_cpu_seconds", "training_cpu_seconds", "total_cpu_seconds")
    device_totals = ("generation_device_seconds", "training_device_seconds")
    for key in CUMULATIVE_KEYS:
        if key in device_totals:
            continue  # declared below, with their meaning
        when = _CPU if key in cpu_totals else None
        out.append(_m(f"ledger/{key}", "-", f"this iteration's {key}", {INLINE}, when))
        name = f"cumulative/{key}"
        if name not in shared:  # cumulative/ totals both engines log are declared there
            out.append(_m(name, "-", f"{key} so far", {INLINE}, when))
    out.append(
        _m("cumulative/cpu_seconds", "CPU s", "generation + training CPU seconds", {INLINE}, _CPU)
    )
    device = (
        "device seconds of {part}: a pair of CUDA events on this process's current stream around "
        "it, waited for at its end only; the time the part held the stream (its kernels and "
        "any gap the host left), an upper bound on device-busy time"
    )
    for part in DEVICE_PARTS:
        out.append(
            _m(
                f"ledger/{part}_device_seconds",
                "device s",
                device.format(part=part),
                {INLINE},
                _DEVICE_AXIS if part in ("generation", "training") else _DEVICE,
            )
        )
    for key in device_totals:
        part = key.removesuffix("_device_seconds")
        out.append(
            _m(
                f"cumulative/{key}",
                "device s",
                f"{part} device seconds so far",
                {INLINE},
                _DEVICE_AXIS,
            )
        )
    out.append(
        _m(
            "cumulative/device_seconds",
            "device s",
            "generation + training device seconds: the comparison's compute axis on a GPU",
            {INLINE},
            _DEVICE_AXIS,
        )
    )
    for part in WALL_PARTS:
        if part in ("generation", "training"):
            continue
        out.append(_m(f"ledger/{part}_seconds", "s", f"wall seconds of {part}", {INLINE}))
        out.append(
            _m(f"ledger/{part}_cpu_seconds", "CPU s", f"CPU seconds of {part}", {INLINE}, _CPU)
        )
    out.append(
        _m(
            "gpu/peak_gib_{phase}",
            "GiB",
            "peak GPU memory of a phase",
            {INLINE},
            "a GPU is present",
        )
    )
    return out


def _asynchronous() -> list[Metric]:
    """The asynchronous record: one publication of the trainer."""
    out: list[Metric] = []
    asynchronous = {
        "published_version": ("version", "the gradient step just published"),
        "rows_generated": ("rows", "rows the workers generated so far"),
        "row_uses": ("row uses", "row uses by the trainer so far"),
        "unused_rows": ("rows", "rows of the buffer no step has used"),
        "mu": ("-", "μ by counts, the paper's estimate: (row uses / T) / (rows / W)"),
        "mu_busy": (
            "-",
            "μ by busy seconds per row: (workers' busy s / rows) / (T × trainer busy s / row "
            "uses); the cost ratio even while roles wait. Busy seconds are wall seconds with "
            "the GPU held, not the device's busy time (a worker's include scoring, appends and "
            "host-side scheduling around the blocking generate)",
        ),
        "gamma": (
            "-",
            "the paper's compute ratio γ = (1 + W/T) / (1 + μ) with μ = async/mu_busy: "
            "buffered cost of an update over unbuffered (§3.2), from wall seconds of busy "
            "roles, not device time",
        ),
        "gamma_counts": (
            "-",
            "(1 + W/T) / (1 + async/mu): γ only when no role waits; while one waits, μ by "
            "counts is (W/T) × the replay ratio, so this tracks the replay ratio, not cost",
        ),
        "trainer_busy_seconds": (
            "s",
            "trainer busy seconds so far (rank 0's wall clock of its gradient steps; "
            "publishing is async/trainer_publish_seconds)",
        ),
        "trainer_idle_seconds": ("s", "trainer seconds waiting for rows"),
        "workers_busy_seconds": (
            "s",
            "workers' generation seconds so far (wall clock of each batch: generating, "
            "scoring, appending; loading weights is async/workers_apply_seconds)",
        ),
        "workers_idle_seconds": ("s", "workers' seconds paused by back-pressure"),
        "trainer_send_seconds": (
            "s",
            "trainer seconds broadcasting weights to the workers (asynchronous.weight_transfer: "
            "broadcast), not counted as busy",
        ),
        "trainer_publish_seconds": (
            "s",
            "trainer seconds publishing, the send aside: the usage commit, the weights-only "
            "copy's host snapshot, a full checkpoint when due, the MLflow logs; not counted "
            "as busy",
        ),
        "weight_send_failures": (
            "sends",
            "weight broadcasts that timed out or failed (the group was re-formed; the workers "
            "that missed the version loaded the files)",
        ),
        "workers_apply_seconds": (
            "s",
            "workers' seconds putting a new version into their engine between batches (a staged "
            "broadcast, or the files: download and load), summed, not counted as busy",
        ),
        "workers_receive_seconds": (
            "s",
            "workers' seconds receiving broadcast weights in the background, beside "
            "generation, summed",
        ),
        "versions_by_broadcast": (
            "versions",
            "versions the workers applied from a broadcast, summed over workers",
        ),
        "versions_from_files": (
            "versions",
            "versions the workers loaded from the published files, summed over workers "
            "(each worker's first, and every one it missed by broadcast)",
        ),
        "evaluator_busy_seconds": ("s", "evaluator busy seconds"),
        "evaluator_idle_seconds": ("s", "evaluator seconds waiting"),
        "oldest_worker_version": ("version", "oldest weights a worker generates with"),
    }
    for key, (unit, help) in asynchronous.items():
        out.append(_m(f"async/{key}", unit, help, {ASYNC}))
        out.append(_m(f"async_by_ktokens/{key}", unit, help, {ASYNC}, axis=KTOKENS))
    for key, help in {
        **REPLAY_SHARED,
        "uses_per_row_mean": "mean uses of the rows drawn",
        "uses_per_row_max": "most uses of a row drawn",
    }.items():
        if key.startswith("uses_per_row"):
            out.append(_m(f"replay/{key}", "uses", help, {ASYNC}))
        out.append(_m(f"replay_by_ktokens/{key}", "-", help, {ASYNC}, axis=KTOKENS))
    out.append(
        _m(
            "eval/cumulative_wall_seconds",
            "s",
            "wall clock when the evaluated version was published",
            {ASYNC},
            _EVAL,
        )
    )
    return out


SYSTEM_SAMPLE = "system-metrics sample (every tracking.system_metrics_interval_s)"
_SYSTEM = "tracking.system_metrics is on"


def _system() -> list[Metric]:
    """MLflow's own system metrics (`replayrl.engine.tracking.Tracker.system_metrics`): named
    by MLflow, e.g. cpu_utilization_percentage, system_memory_usage_megabytes,
    gpu_0_utilization_percentage (GPU ones where NVML is present). Their step is the
    sample's index, not a gradient step."""
    return [
        _m(
            "system/{metric}",
            "MLflow's",
            "a system metric of the inline task's machine (CPU, memory, disk, network, GPU)",
            when=_SYSTEM,
            axis=SYSTEM_SAMPLE,
        ),
        _m(
            "system/{node}/{metric}",
            "MLflow's",
            "a system metric of one role's or Kubeflow task's machine ({node}: trainer, "
            "worker_0, evaluator, or the task)",
            when=_SYSTEM,
            axis=SYSTEM_SAMPLE,
        ),
    ]


def _declare() -> list[Metric]:
    return [*_shared(), *_inline(), *_asynchronous(), *_system()]


# Metrics that are NaN (so not logged) for some data, and when they are logged.
_REUSED = "a drawn row was used before"
_CONDITIONAL = {
    "replay/steps_since_last_use_mean": _REUSED,
    "replay/steps_since_last_use_p50": _REUSED,
    "buffer/bias_age_mean": "positive bias kept rows beyond the FIFO part",
    "buffer/bias_age_max": "positive bias kept rows beyond the FIFO part",
    "async/oldest_worker_version": "a worker has generated a batch",
    "async/mu": "rows were generated",
    "async/gamma_counts": "rows were generated",
    "async/mu_busy": "rows were generated and trained on",
    "async/gamma": "rows were generated and trained on",
}


def _with_conditions(metrics: list[Metric]) -> tuple[Metric, ...]:
    out = []
    for m in metrics:
        base = m.name.replace("_by_ktokens/", "/", 1)
        when = _CONDITIONAL.get(base, m.when)
        out.append(Metric(m.name, m.unit, m.help, m.engines, m.axis, when))
    return tuple(out)


METRICS: tuple[Metric, ...] = _with_conditions(_declare())


def declared(engine: str) -> list[Metric]:
    return [m for m in METRICS if engine in m.engines]


def find(name: str, engine: str | None = None) -> Metric | None:
    """The declaration `name` falls under (for `engine`, when given), or None."""
    for m in METRICS:
        if (engine is None or engine in m.engines) and m.pattern().match(name):
            return m
    return None


def undeclared(names: Iterable[str], engine: str) -> list[str]:
    return sorted(n for n in names if find(n, engine) is None)


# ---------------------------------------------------------------- shared builders


def finite(metrics: Mapping[str, float]) -> dict[str, float]:
    """JSON-safe and loggable: MLflow and state.json get finite floats only."""
    return {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}


def replay_metrics(*, ages: np.ndarray, gaps: np.ndarray) -> dict[str, float]:
    """replay/* both engines log from the same inputs: `ages` (uses,) in gradient steps and
    `gaps` (uses,) steps since each use's row was last used, -1 where it never was
    (`replayrl.core.staleness` summarises them). Empty inputs give NaN (not logged)."""
    age = summarize_ages(ages)
    since = summarize_since_last_use(gaps)
    return {
        "replay/sample_age_mean": age["mean"],
        "replay/sample_age_p50": percentile(ages, 50),
        "replay/sample_age_p95": percentile(ages, 95),
        "replay/sample_age_max": age["max"],
        "replay/steps_since_last_use_mean": since["mean"],
        "replay/frac_first_use": since["frac_first_use"],
    }


def async_cost_metrics(
    *,
    workers: int,
    trainers: int,
    rows_generated: float,
    row_uses: float,
    workers_busy_seconds: float,
    trainer_busy_seconds: float,
) -> dict[str, float]:
    """async/mu, mu_busy, gamma, gamma_counts of an asynchronous lineage with W workers and T
    trainers (one GPU each), every side in seconds of a GPU held busy. `workers_busy_seconds`
    is summed over the W workers; `trainer_busy_seconds` is rank 0's wall clock, and each of
    the T data-parallel ranks is busy for as long, so the trainers spent T times it.

    Both are wall clocks (`time.perf_counter` around each role's busy phase), not the
    devices' busy time: vLLM's `generate` blocks the host until its batch is done, so even a
    device timer around it (`core.clock.DeviceTimer`) reads its wall time, host-side
    scheduling and output processing included, and a worker's busy seconds add scoring and
    buffer appends. μ_busy and γ are thus ratios of GPU time *held*, which is what a GPU is
    billed for; they overstate the device's own share of generation where the host is slow.

    μ by counts is the paper's estimate (K_train / T) / (K_inf / W) (App. 10.3), which is the
    cost ratio only when no role waits; μ by busy seconds divides the generation cost per row
    by the training cost per row use, whatever waits. γ = (1 + W/T) / (1 + μ) (§3.2) is
    logged from μ_busy; the count-based value as gamma_counts. Example: W = 6, T = 2, 600
    rows in 300 worker-seconds, 1200 uses in 60 s of rank 0: μ_busy = 0.5 / (120/1200) = 5,
    γ = 4 / 6 = 0.667; μ by counts = 600 / 100 = 6, gamma_counts = 4 / 7. NaN where a count
    or a clock is still 0."""
    w, t = workers, trainers
    mu = (row_uses / t) / (rows_generated / w) if rows_generated else math.nan
    mu_busy = (
        (workers_busy_seconds / rows_generated) / (t * trainer_busy_seconds / row_uses)
        if rows_generated and row_uses and trainer_busy_seconds > 0
        else math.nan
    )
    return {
        "mu": mu,
        "mu_busy": mu_busy,
        "gamma": (1 + w / t) / (1 + mu_busy) if math.isfinite(mu_busy) else math.nan,
        "gamma_counts": (1 + w / t) / (1 + mu) if math.isfinite(mu) else math.nan,
    }


def eval_metrics(result: Mapping[str, float], *, k: int, prefix: str) -> dict[str, float]:
    """eval/* (prefix "eval/") or eval_by_ktokens/* from an evaluation's `as_dict()`, plus
    the headline copy under accuracy/."""
    values = {
        "pass1": result["pass1"],
        f"pass_at_{k}": result["pass_at_k"],
        "sample_accuracy": result["mean_sample_correct"],
        "entropy": result["entropy"],
        "response_length": result["response_length"],
        "unparsed": result["unparsed"],
        # nan (so not logged) unless eval.pass1_temperature is set
        "pass1_sampled": result.get("pass1_sampled", math.nan),
    }
    headline = "accuracy/pass1" if prefix == "eval/" else "accuracy/pass1_by_ktokens"
    return {f"{prefix}{key}": float(v) for key, v in values.items()} | {
        headline: float(result["pass1"])
    }


def train_metrics(stats: list) -> dict[str, float]:
    """train/* as the mean over gradient steps' statistics (`StepStats`); {} without steps."""
    if not stats:
        return {}
    return {
        "train/loss": float(np.mean([x.loss for x in stats])),
        "train/clip_fraction": float(np.mean([x.clip_fraction for x in stats])),
        "train/mean_ratio": float(np.mean([x.mean_ratio for x in stats])),
        "train/grad_norm": float(np.mean([x.grad_norm for x in stats])),
        "train/sample_reward": float(np.mean([x.mean_reward for x in stats])),
    }


def markdown() -> str:
    """docs/metrics.md: every declared metric by section (generated; a test keeps it fresh)."""
    lines = [
        "# Metrics",
        "",
        "Generated from `src/replayrl/engine/metric_schema.py` by "
        "`python -m replayrl.engine.metric_schema > docs/metrics.md`; do not edit by hand.",
        "",
        "**The step axis.** Every engine logs to MLflow at **step = gradient step**: the inline",
        "and Kubeflow engines log iteration t at step t·S (S = `train.steps_per_iteration`) and",
        "log `iteration` as a metric, so MLflow can plot against either; the asynchronous engine",
        "logs at each publication's gradient step. Step 0 is the warm-start evaluation. Sections",
        "ending in `_by_ktokens` repeat their metrics at step = thousands of generated tokens.",
        "A value that is not finite is not logged (NaN means no value).",
        "",
    ]
    sections: dict[str, list[Metric]] = {}
    for m in METRICS:
        sections.setdefault(m.name.split("/", 1)[0] if "/" in m.name else "(top)", []).append(m)
    for section, metrics in sections.items():
        lines += [f"## {section}", "", "| name | unit | engines | logged | meaning |"]
        lines += ["|---|---|---|---|---|"]
        for m in metrics:
            engines = ", ".join(sorted(m.engines))
            when = m.when or "always"
            lines.append(f"| `{m.name}` | {m.unit} | {engines} | {when} | {m.help} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
