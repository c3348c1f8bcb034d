"""`replayrl compare`: read an experiment's lineages from MLflow, compare the arms, and write
the plot, `comparison.json` and `comparison.md`, also logged as artifacts of a comparison run.

The arithmetic lives in `replayrl.experiments.statistics` and `replayrl.experiments.arms`, the
Markdown in `replayrl.experiments.report`; this module is the edge around them: the MLflow
reads (one run per lineage, tagged `arm`, `seed`, `lineage`), the matplotlib figure (Agg
backend, no display needed) and the MLflow comparison run. The comparison run carries the
tag `kind=comparison` and no `arm`/`lineage` tag, so it is never read back as a lineage.
Files are written under a temporary name and renamed into place: a crash leaves no
half-written file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from replayrl import logs
from replayrl.engine.tracking import ACCELERATOR_TAG
from replayrl.errors import ReplayRLError
from replayrl.experiments import arms, report
from replayrl.experiments.statistics import (
    BASELINE_ARM,
    METRICS,
    PAPER_MU,
    LineageCurve,
    measured_mu,
)

log = logging.getLogger(__name__)
KIND_TAG = "kind"
COMPARISON_KIND = "comparison"
FILES = ("comparison.json", "comparison.md", "comparison.png")
_CUMULATIVE = (
    "generated_tokens",
    "seconds",
    "rollouts_generated",
    "rollouts_trained",
    "generation_seconds",
    "training_seconds",
)
# The process-CPU clock of the same parts (user + system, all threads; `replayrl.core.clock`),
# logged by lineages recorded since it exists. On a CPU machine it is the measured axis when
# every lineage has it: wall seconds move with whatever else shares the machine.
_CUMULATIVE_CPU = ("cpu_seconds", "generation_cpu_seconds", "training_cpu_seconds")
# The device clock of the same parts (CUDA events around generation and training), logged by
# lineages whose trainer ran on a GPU in the engine's process. It is the measured axis when
# every lineage has it: device seconds are what a GPU run costs, where the CPU clock sees
# only the host side.
_CUMULATIVE_DEVICE = ("device_seconds", "generation_device_seconds", "training_device_seconds")
DEVICE_SECONDS = "device seconds (CUDA events)"
CPU_SECONDS = "CPU seconds (process time)"


@dataclass(frozen=True)
class Lineages:
    curves: list[LineageCurve]
    params: dict[str, dict[str, str]]  # lineage -> its MLflow params (the flattened config)
    seconds_label: str  # what the measured `seconds` axis is: `measured_axis`
    experiment_id: str
    # lineage -> the accelerator model(s) it generated on (its `system.accelerator` tag), None
    # for a lineage recorded before the tag was
    accelerators: dict[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class CompareResult:
    result: dict
    paths: list[Path]
    mlflow_run_id: str | None


def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///") :])
        if not db.exists():  # MlflowClient would silently create an empty store
            raise ReplayRLError(
                f"No MLflow store at {db}: pass the --tracking-uri your lineages used, e.g. "
                f"sqlite:///$PWD/runs/mlflow.db (a lineage's run root holds mlflow.db)."
            )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=tracking_uri)


def _experiment_id(client, experiment: str) -> str:
    try:
        exp = client.get_experiment_by_name(experiment)
        names = [] if exp else [e.name for e in client.search_experiments()]
    except Exception as e:  # MLflow raises many types for an unreachable store
        raise ReplayRLError(
            f"Cannot read the MLflow tracking store: {e.__class__.__name__}: {e}. Check "
            f"--tracking-uri / MLFLOW_TRACKING_URI."
        ) from None
    if exp is None:
        raise ReplayRLError(
            f"No MLflow experiment '{experiment}' in this store; it has: "
            f"{', '.join(sorted(names)) or 'none'}. Pass --experiment with one of them."
        )
    return exp.experiment_id


def read_lineages(
    *,
    tracking_uri: str,
    experiment: str,
    metric: str = "pass1",
    lineages: Sequence[str] | None = None,
    allow_mixed_hardware: bool | None = False,
) -> Lineages:
    """Every lineage run of `experiment` as a `LineageCurve`, with its params; with
    `lineages`, only the runs of those lineage names (each must be there, evaluated: a
    pipeline compares the two its own run opened, not older lineages of the experiment).
    Lineages that generated on different accelerator models are refused unless
    `allow_mixed_hardware` (`check_hardware`); None = not checked, for a caller that reads
    only their params.
    `metric` (a key of METRICS) is the accuracy the curves' `pass1` holds: `pass1` the
    greedy eval/pass1, `pass1_sampled` eval/pass1_sampled (the paper's pass@1 at temperature
    0.1, logged when eval.pass1_temperature is set), `pass_at_k` eval/pass_at_<k>."""
    if metric not in METRICS:
        raise ReplayRLError(f"Unknown metric {metric!r}; choose one of {', '.join(METRICS)}.")
    client = _client(tracking_uri)
    experiment_id = _experiment_id(client, experiment)
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], max_results=500, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    curves, params, devices, accelerators = [], {}, set(), {}
    for run in runs:
        tags = run.data.tags
        if tags.get(KIND_TAG) == COMPARISON_KIND or "arm" not in tags or "lineage" not in tags:
            continue
        if lineages is not None and tags["lineage"] not in lineages:
            continue
        curve = _curve(client, run, metric=metric)
        if curve is None:
            log.warning("lineage %s has no evaluation yet; skipped", tags["lineage"])
            continue
        curves.append(curve)
        params[curve.lineage] = dict(run.data.params)
        devices.add(_device(tags, run.data.params))
        accelerators[curve.lineage] = tags.get(ACCELERATOR_TAG) or None
    if lineages is not None:
        missing = sorted(set(lineages) - {c.lineage for c in curves})
        if missing:
            raise ReplayRLError(
                f"Lineage(s) {', '.join(missing)} have no evaluated run in experiment "
                f"'{experiment}' of {logs.without_credentials(tracking_uri)}: nothing to "
                "compare them by. Check that their runs logged an evaluation there."
            )
    for arm, group in arms.group_by_arm(curves).items():
        differing = arms.config_differences([params[c.lineage] for c in group])
        if differing:
            raise ReplayRLError(
                f"The {arm} lineages of experiment '{experiment}' were run with different "
                f"configs (differing: {', '.join(differing[:5])}); seeds of one arm must share "
                f"a config. Put each variant in its own experiment (tracking.experiment=...)."
            )
    if allow_mixed_hardware is not None:
        check_hardware(accelerators, allow_mixed=allow_mixed_hardware)
    curves, label = measured_axis(curves, devices)
    return Lineages(curves, params, label, experiment_id, accelerators)


def check_hardware(accelerators: dict[str, str | None], *, allow_mixed: bool) -> None:
    """Refuse, in one line naming the models, lineages (lineage -> its accelerator tag) that
    generated on different accelerator models: generation seconds, and so the seconds axis
    and μ, are not comparable across them. With `allow_mixed` that is a warning. Lineages
    without the tag (recorded before it was) are compared, with a warning that says so."""
    by_model: dict[str, list[str]] = {}
    for lineage, model in sorted(accelerators.items()):
        if model:
            by_model.setdefault(model, []).append(lineage)
    untagged = sorted(lineage for lineage, model in accelerators.items() if not model)
    if untagged:
        log.warning(
            "%s record no accelerator model (tag %s, logged since replayrl records it): "
            "compared without checking that their hardware matches the others'.",
            _names(untagged, "Lineage"),
            ACCELERATOR_TAG,
        )
    if len(by_model) < 2:
        return
    seen = " and ".join(f"{model} ({_names(names)})" for model, names in sorted(by_model.items()))
    if allow_mixed:
        log.warning("Comparing lineages generated on different accelerators: %s.", seen)
        return
    raise ReplayRLError(
        f"These lineages generated on different accelerators: {seen}. Their generation "
        "seconds are not comparable across accelerator models; compare lineages of one model, "
        "or pass --allow-mixed-hardware to compare them anyway."
    )


def _names(lineages: list[str], what: str = "") -> str:
    """'a, b, c and 2 more', prefixed with `what` (Lineage a / Lineages a, b) when given."""
    shown = ", ".join(lineages[:3]) + (
        f" and {len(lineages) - 3} more" if len(lineages) > 3 else ""
    )
    if not what:
        return shown
    return f"{what}{'s' if len(lineages) > 1 else ''} {shown}"


def measured_axis(curves: list[LineageCurve], devices: set[str]) -> tuple[list[LineageCurve], str]:
    """The curves on the clock the comparison measures compute with, and its label (the
    report and the plot name it). Device seconds when every lineage logged them (GPU runs);
    else, where every lineage ran on the CPU and logged it, the process-CPU clock (wall
    seconds move with whatever else shares the machine); else wall seconds. One lineage
    without a clock puts the whole comparison on the next one: axes are never mixed."""
    if curves and all(c.device_clock is not None for c in curves):
        return [c.on_device_clock() for c in curves], DEVICE_SECONDS
    if devices == {"cpu"} and curves and all(c.cpu_clock is not None for c in curves):
        return [c.on_cpu_clock() for c in curves], CPU_SECONDS
    return curves, seconds_label(devices)


def _device(tags: dict[str, str], params: dict[str, str]) -> str:
    """Where a lineage's seconds were spent: its `device` tag if it has one, else what its
    generation backend implies (vLLM runs on a GPU; the transformers backend on CPU)."""
    if "device" in tags:
        return "gpu" if tags["device"].startswith(("cuda", "gpu")) else tags["device"]
    return "gpu" if params.get("rollout.backend") == "vllm" else "cpu"


def seconds_label(devices: set[str]) -> str:
    """What the `seconds` axis measures when it is wall-clock time."""
    if devices == {"gpu"}:
        return "GPU-seconds"
    if devices == {"cpu"}:
        return "CPU wall seconds"
    return "seconds (mixed devices)"


def _history(client, run_id: str, key: str) -> dict[int, float]:
    """step -> value; of repeated values at one step, the last logged."""
    metrics = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return {m.step: m.value for m in metrics}


def _curve(client, run, *, metric: str = "pass1") -> LineageCurve | None:
    run_id, tags = run.info.run_id, run.data.tags
    greedy = _history(client, run_id, "eval/pass1")
    if not greedy:
        return None
    k_keys = sorted(key for key in run.data.metrics if key.startswith("eval/pass_at_"))
    k = int(k_keys[0].rsplit("_", 1)[1]) if k_keys else int(run.data.params.get("eval.pass_k", 0))
    pass_k = _history(client, run_id, k_keys[0]) if k_keys else {}
    pass1 = {"pass1": greedy, "pass_at_k": pass_k}.get(metric)
    if pass1 is None:
        pass1 = _history(client, run_id, "eval/pass1_sampled")
    pass1 = {t: v for t, v in pass1.items() if t in greedy and math.isfinite(v)}
    if len(pass1) < len(greedy):
        key = f"eval/pass_at_{k}" if metric == "pass_at_k" else f"eval/{metric}"
        raise ReplayRLError(
            f"Lineage '{tags['lineage']}' has no finite {key} at every evaluation, so "
            f"--metric {metric} cannot be read"
            + (
                " (set eval.pass1_temperature, e.g. 0.1 as the paper, to log it)."
                if metric == "pass1_sampled"
                else " (it is logged with eval.pass_k and eval.num_samples >= eval.pass_k)."
            )
        )
    entropy = _history(client, run_id, "eval/entropy")
    wall = _history(client, run_id, "cumulative/wall_seconds")
    cumulative = {
        name: _history(client, run_id, f"cumulative/{name}")
        for name in (*_CUMULATIVE, *_CUMULATIVE_CPU, *_CUMULATIVE_DEVICE)
    }
    # MLflow steps are gradient steps (replayrl.engine.metric_schema), in either engine;
    # evaluations fall on whole iterations of S steps.
    steps = sorted(pass1)
    s = int(run.data.params.get("train.steps_per_iteration", 1))

    def at(name: str) -> tuple[float, ...]:
        values = cumulative[name]
        missing = [t for t in steps if t != 0 and t not in values]
        if missing:
            raise ReplayRLError(
                f"Lineage '{tags['lineage']}' has evaluations without its compute ledger "
                f"(cumulative/{name} missing at gradient steps {missing[:5]}); it was not logged "
                f"by replayrl's record path. Remove it from the experiment."
            )
        return tuple(0.0 if t == 0 else values[t] for t in steps)

    def total(name: str) -> float:
        values = cumulative[name]
        return values[max(values)] if values else 0.0

    def clock(names: tuple[str, str, str]) -> dict | None:
        """The seconds and totals on another clock, when logged at every evaluation."""
        if not all(t == 0 or t in cumulative[name] for name in names for t in steps):
            return None
        axis, generation, training = names
        return dict(
            seconds=at(axis),
            generation_seconds_total=total(generation),
            training_seconds_total=total(training),
        )

    return LineageCurve(
        lineage=tags["lineage"],
        arm=tags["arm"],
        seed=int(tags.get("seed", run.data.params.get("seed", 0))),
        iterations=tuple(t // s for t in steps),
        pass1=tuple(pass1[t] for t in steps),
        pass_at_k=tuple(pass_k.get(t, math.nan) for t in steps),
        entropy=tuple(entropy.get(t, math.nan) for t in steps),
        generated_tokens=at("generated_tokens"),
        seconds=at("seconds"),
        rollouts_generated=at("rollouts_generated"),
        rollouts_trained=at("rollouts_trained"),
        k=k,
        generation_seconds_total=total("generation_seconds"),
        training_seconds_total=total("training_seconds"),
        rollouts_generated_total=total("rollouts_generated"),
        rollouts_trained_total=total("rollouts_trained"),
        cpu_clock=clock(_CUMULATIVE_CPU),
        device_clock=clock(_CUMULATIVE_DEVICE),
        wall_seconds=tuple(0.0 if t == 0 else wall.get(t, math.nan) for t in steps),
        last=dict(run.data.metrics),
    )


def read_curve(*, tracking_uri: str, run_id: str) -> LineageCurve | None:
    """One lineage's curve from its MLflow run (either engine); None before its first
    evaluation."""
    client = _client(tracking_uri)
    return _curve(client, client.get_run(run_id))


# ---------------------------------------------------------------- the figure and the files

_AXIS_LABELS = {
    "generated_tokens": "cumulative generated tokens (measured)",
    "cost_units": "cumulative modelled cost, own μ = {mu:.2f} (measured; units: one rollout's "
    "training cost)",
    "cost_units_what_if": "cumulative modelled cost, what-if μ = {mu:g} (not measured)",
}
_COLORS = {"on-policy": "tab:blue", "replay": "tab:orange", "replay-plain": "tab:green"}


def plot(result: dict, path: Path, *, seconds_label: str, title: str = "") -> None:
    """pass@1 against each compute axis: the arm's median line, its seeds' inter-quartile
    band, and the target as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")  # no display; safe in pods and CI
    import matplotlib.pyplot as plt

    names = result["axes"]
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.2), sharey=True)
    for ax, axis in zip(axes, names, strict=True):
        for arm, c in result["curves"].items():
            color = _COLORS.get(arm)
            n = len(result["arms"][arm]["seeds"])
            ax.plot(
                c[axis],
                c["pass1_median"],
                marker="o",
                ms=3,
                color=color,
                label=f"{arm} ({n} seeds)",
            )
            if n > 1:
                ax.fill_between(
                    c[axis], c["pass1_q25"], c["pass1_q75"], color=color, alpha=0.2, lw=0
                )
        ax.axhline(result["target_pass1"], ls="--", color="grey", lw=1, label="target")
        if axis == "seconds":
            label = f"cumulative {seconds_label}, generation + training (measured)"
        else:
            mu = result["mu_what_if"] if axis == "cost_units_what_if" else result["mu_own"]
            label = _AXIS_LABELS[axis].format(mu=mu)
        ax.set_xlabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    metric = (result.get("metric") or {}).get("label", "greedy pass@1")
    axes[0].set_ylabel(f"held-out {metric}: median, band: IQR over seeds")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    _atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_files(
    result: dict, out_dir: Path, *, seconds_label: str, title: str, note: str = ""
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (out_dir / name for name in FILES)
    _atomic(json_path, lambda t: t.write_text(json.dumps(result, indent=2, sort_keys=True)))
    text = f"## {title}\n\n" + report.markdown(result, seconds_label=seconds_label, note=note)
    _atomic(md_path, lambda t: t.write_text(text))
    plot(result, png_path, seconds_label=seconds_label, title=title)
    return [json_path, md_path, png_path]


def log_comparison(
    *, tracking_uri: str, experiment_id: str, result: dict, paths: list[Path], key: str | None
) -> str:
    """A run tagged kind=comparison holding the files and the headline numbers. With `key`
    (e.g. a KFP run id) a retried comparison reuses its run instead of adding one."""
    from mlflow.entities import Metric, Param

    client = _client(tracking_uri)
    run_id = None
    if key:
        found = client.search_runs(
            [experiment_id],
            filter_string=f"tags.{KIND_TAG} = '{COMPARISON_KIND}' and tags.comparison_key = '{key}'",
            max_results=1,
        )
        run_id = found[0].info.run_id if found else None
    if run_id is None:
        tags = {KIND_TAG: COMPARISON_KIND, **({"comparison_key": key} if key else {})}
        run_id = client.create_run(
            experiment_id, run_name=f"comparison-{time.strftime('%Y%m%d-%H%M%S')}", tags=tags
        ).info.run_id
    now = int(time.time() * 1000)
    metrics = [Metric("target_pass1", result["target_pass1"], now, 0)]
    for arm, a in result["arms"].items():
        ci = a["ratio_ci"] or {}
        for axis in result["axes"]:
            for name, value in (
                (f"{arm}/to_target/{axis}", a["to_target"][axis]),
                (f"{arm}/ratio_to_on_policy/{axis}", a["ratio_to_on_policy"][axis]),
                (f"{arm}/ratio_ci_low/{axis}", (ci.get(axis) or {}).get("low")),
                (f"{arm}/ratio_ci_high/{axis}", (ci.get(axis) or {}).get("high")),
                (f"{arm}/pass1_at_equal/{axis}", a["at_equal_compute"][axis]["pass1"]),
            ):
                if value is not None:
                    metrics.append(Metric(name, float(value), now, 0))
        if a["final_pass1"]["median"] is not None:
            metrics.append(Metric(f"{arm}/final_pass1", a["final_pass1"]["median"], now, 0))
        for axis, t in ((result.get("paired") or {}).get(arm, {}).get("first") or {}).items():
            if t["median"] is not None:
                metrics.append(Metric(f"{arm}/paired_median_ratio/{axis}", t["median"], now, 0))
            metrics.append(Metric(f"{arm}/sign_test_p/{axis}", t["sign"]["p"], now, 0))
    metrics.append(Metric("mu_own", result["mu_own"], now, 0))
    params = [
        Param("mu_what_if", str(result["mu_what_if"])),
        Param("target_source", result["target_source"]),
        Param("metric", result["metric"]["name"]),
        Param("accuracy_reported", result["accuracy_reported"]),
    ]
    client.log_batch(run_id, metrics=metrics, params=params)
    for path in paths:
        client.log_artifact(run_id, str(path))
    client.set_terminated(run_id)
    return run_id


def run_compare(
    *,
    tracking_uri: str,
    experiment: str,
    out_dir: str | os.PathLike[str],
    target: float | None = None,
    what_if_mu: float | None = PAPER_MU,
    log_to_mlflow: bool = True,
    key: str | None = None,
    note: str = "",
    metric: str = "pass1",
    peak: bool = False,
    lineages: Sequence[str] | None = None,
    allow_mixed_hardware: bool = False,
) -> CompareResult:
    """Read, compare, write the three files to `out_dir`, and log them to MLflow. Cost
    units use the lineages' own measured μ; `what_if_mu` adds a labelled what-if axis beside
    it (None: none). `note`: a line for the report, e.g. how the lineages were run.
    `metric`: the accuracy compared (a key of METRICS); `peak`: the report's accuracy table
    shows each seed's best over the run, as the paper reports (§5.1), not the final value.
    `lineages`: compare only these lineage names; `allow_mixed_hardware`: compare lineages
    that generated on different accelerator models (`read_lineages`)."""
    found = read_lineages(
        tracking_uri=tracking_uri,
        experiment=experiment,
        metric=metric,
        lineages=lineages,
        allow_mixed_hardware=allow_mixed_hardware,
    )
    result = arms.compare(
        found.curves,
        target=target,
        what_if_mu=what_if_mu,
        params=found.params,
        metric=metric,
        peak=peak,
    )
    result["experiment"] = experiment
    result["seconds_label"] = found.seconds_label
    result["accelerators"] = found.accelerators
    if note:
        result["note"] = note
    title = f"{experiment}: replay vs on-policy"
    paths = write_files(
        result, Path(out_dir), seconds_label=found.seconds_label, title=title, note=note
    )
    run_id = None
    if log_to_mlflow:
        run_id = log_comparison(
            tracking_uri=tracking_uri,
            experiment_id=found.experiment_id,
            result=result,
            paths=paths,
            key=key,
        )
    return CompareResult(result, paths, run_id)


def restate_file(json_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Re-render a committed comparison.json with the current statistics
    (`replayrl.experiments.arms.restate`): writes comparison.json and comparison.md into
    `out_dir` (the plot is left as it is: the median curves did not change). Reads no
    MLflow store, so a result whose store is gone can still be restated."""
    try:
        old = json.loads(Path(json_path).read_text())
    except (OSError, ValueError) as e:
        raise ReplayRLError(f"Cannot read {json_path} as a comparison.json: {e}") from None
    if not {"arms", "curves", "axes", "target_pass1"} <= set(old) or "mu_own" not in old:
        raise ReplayRLError(
            f"{json_path} is not a comparison.json of this version's format (median curves, "
            f"own μ, per-seed first reaches); an older mean ± std result cannot be restated."
        )
    result = arms.restate(old)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    label = result.get("seconds_label", "seconds")
    title = f"{result.get('experiment', 'comparison')}: replay vs on-policy"
    text = f"## {title}\n\n" + report.markdown(
        result, seconds_label=label, note=result.get("note", "")
    )
    paths = [out / "comparison.json", out / "comparison.md"]
    _atomic(paths[0], lambda t: t.write_text(json.dumps(result, indent=2, sort_keys=True)))
    _atomic(paths[1], lambda t: t.write_text(text))
    return paths


def experiment_mu(*, tracking_uri: str, experiment: str) -> tuple[float, str, dict[str, int]]:
    """For `replayrl advise`: the measured μ of an experiment's lineages (the median over
    them), where it came from, and their shape {batch_size, steps_per_iteration,
    samples_per_prompt} (B, S, G; the lineages of one experiment share them). Lineages of
    different accelerator models are read with a warning: μ is each lineage's own ratio."""
    lineages = read_lineages(
        tracking_uri=tracking_uri, experiment=experiment, allow_mixed_hardware=True
    )
    mus = [m for m in map(measured_mu, lineages.curves) if m is not None]
    if not mus:
        raise ReplayRLError(
            f"No lineage of experiment '{experiment}' has a compute ledger with generation and "
            f"training seconds yet; run at least one iteration first, or pass --mu."
        )
    p = next(iter(lineages.params.values()))
    shape = dict(
        batch_size=int(p["train.batch_size"]),
        steps_per_iteration=int(p["train.steps_per_iteration"]),
        samples_per_prompt=int(p["rollout.samples_per_prompt"]),
    )
    source = f"experiment '{experiment}', median of {len(mus)} lineage(s), {lineages.seconds_label}"
    return statistics.median(mus), source, shape


def ui_reports(done: CompareResult, *, tracking_uri: str) -> tuple[str, str]:
    """(Markdown, HTML) for a pipeline UI. The Markdown is the table and a link to the
    comparison's MLflow run: the KFP 2.15 and 2.16 UIs' Markdown viewer strips `data:`
    images, so the plot is not embedded there. The HTML page (the step's `plot` artifact)
    embeds it as a data URI (a UI shows an artifact's text, not files beside it)."""
    import base64
    import html

    from replayrl.engine.tracking import experiment_of_run, ui_link

    md_path, png_path = done.paths[1], done.paths[2]
    table = md_path.read_text()
    image = "data:image/png;base64," + base64.b64encode(png_path.read_bytes()).decode()
    markdown = f"{table}\nThe plot (pass@1 against compute) is this step's `plot` artifact.\n"
    if done.mlflow_run_id:
        experiment_id = experiment_of_run(tracking_uri, done.mlflow_run_id)
        link = ui_link(tracking_uri, experiment_id, done.mlflow_run_id)
        markdown += f"The comparison's files and numbers in MLflow: [{link}]({link})\n"
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>replay vs on-policy</title>"
        "</head><body style='font-family:sans-serif'>"
        f"<img alt='pass@1 against compute' style='max-width:100%' src='{image}'>"
        f"<pre>{html.escape(table)}</pre></body></html>"
    )
    return markdown, page


def headline_metrics(result: dict) -> dict[str, float]:
    """Flat numbers for a metrics panel: target, ratios, median final pass@1 per arm."""
    out = {"target_pass1": result["target_pass1"]}
    for arm, a in result["arms"].items():
        if a["final_pass1"]["median"] is not None:
            out[f"{arm}_final_pass1"] = a["final_pass1"]["median"]
        for axis in result["axes"]:
            ratio = a["ratio_to_on_policy"][axis]
            if ratio is not None and arm != BASELINE_ARM:
                out[f"{arm}_ratio_{axis}"] = ratio
    return out
