"""What the Kubeflow components do inside their pods, around `replayrl.engine.steps`.

A component receives strings and numbers from KFP; this module turns them into a
`RunConfig` and the lineage's paths, holds the lineage's lease before any write and keeps it
alive with a heartbeat while the step works (`lease.heartbeat`), turns a step's result into
JSON for the next component (and numbers for the KFP UI), and records an iteration with the
same `iteration.record_iteration` as the inline engine. Every pipeline ends in an exit task
(`release_run`) that drops the run's leases whatever happened. User errors leave a pod as
one line (`replayrl: error: ...`), without a traceback. Every component body enters
`user_errors_as_exit` first, and there a pod that asked for GPUs checks that CUDA can serve
them (`replayrl.policy.gpu.check_pod`) before it reads or downloads anything; a task in a KFP pod
refuses a run root that is not on S3 (`check_run_root`) before it does any work.

Knows nothing about pipelines, pods or the KFP client; imports no `kfp` module (components
pass their KFP artifacts in, and only `log_metric` and `path` are used).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import yaml

from replayrl import logs, storage
from replayrl.config import RunConfig, load_config
from replayrl.errors import ReplayRLError
from replayrl.policy import gpu
from replayrl.storage import LineagePaths, lease

# ---------------------------------------------------------------- config


def config_text(config: str) -> str:
    """The YAML text a pipeline's `config` parameter means: the text itself, or the file
    at a URI (`s3://…`, `file://…`, or a path ending in .yaml/.yml). "" = the defaults."""
    source = config.strip()
    looks_like_uri = "\n" not in source and (
        source.startswith(("s3://", "file://")) or source.endswith((".yaml", ".yml"))
    )
    if not looks_like_uri:
        return config
    try:
        return storage.read_bytes(source).decode()
    except ReplayRLError as e:
        raise ReplayRLError(
            f"Cannot read the config '{source}': {e} Pass YAML text or a readable URI."
        ) from None


def resolve(
    config: str,
    *,
    arm: str = "",
    lineage: str = "",
    run_root: str = "",
    model_id: str = "",
    dataset_id: str = "",
) -> RunConfig:
    """The RunConfig of a pipeline run: the config (text or URI) with the run's parameters
    applied ("" keeps the config's): `arm`, `lineage` (storage.lineage), `run_root`
    (storage.run_root), `model_id` (model.source, clearing model.revision, which names a
    commit of the config's model) and `dataset_id` (task.path, clearing task.revision);
    the run root made absolute (pods do not share a working directory)."""
    text = config_text(config)
    try:
        tree = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError:
        tree = None  # load_config says where the YAML is malformed
    else:
        check_config_tree(tree)
    overrides = {
        ("storage", "run_root"): run_root,
        ("storage", "lineage"): lineage,
        ("model", "source"): model_id,
        ("task", "path"): dataset_id,
    }
    if isinstance(tree, dict) and any(overrides.values()):
        for (name, key), value in overrides.items():
            if not value:
                continue
            section = tree.get(name)
            section = dict(section) if isinstance(section, dict) else {}
            section[key] = value
            if key in ("source", "path"):
                section.pop("revision", None)
            tree[name] = section
        text = yaml.safe_dump(tree, sort_keys=False)
    cfg = load_config(text=text, arm=arm or None)
    check_run_root(cfg)
    root = storage.normalize_root(cfg.storage.run_root)
    return dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, run_root=root))


PASTE_HINT = (
    "Paste one line: the JSON `replayrl config json FILE` prints (it loads to the same "
    "config), or an s3:// URI of the YAML file; leave it empty for the built-in demo."
)


def check_config_tree(tree: object) -> None:
    """Refuse a `config` parameter that holds no settings or is not a mapping of sections.
    The KFP UI's run form has one-line fields: a pasted YAML preset loses its line breaks, and
    as its first line is a `#` comment the whole text becomes one comment, which parses to
    nothing and would silently load the defaults (the tiny demo) under the given lineage."""
    if tree is None:
        raise ReplayRLError(
            "The config parameter holds no settings: only comments or blank text (a YAML "
            "file pasted into a one-line field loses its line breaks, and its first '#' "
            f"comment swallows the rest). Nothing was written. {PASTE_HINT}"
        )
    if not isinstance(tree, dict):
        raise ReplayRLError(
            f"The config parameter is a {type(tree).__name__}, not a mapping of sections "
            f"(storage:, rollout:, train: ...); a YAML file pasted into a one-line field "
            f"loses its line breaks. Nothing was written. {PASTE_HINT}"
        )


# Set by the KFP driver in every pipeline pod (the pod's name, from the downward API).
POD_ENV = "KFP_POD_NAME"


def check_run_root(cfg: RunConfig) -> None:
    """Refuse, inside a KFP pod, a run root that is not on S3: it would be a folder in this
    container, gone with the pod, and the next task (another pod) would not find what this
    one wrote. Outside a pod (inline, kfp-local) any run root is fine. Every component calls
    it once its config is loaded, so it also makes the config's MLflow settings the pod's
    and prints which tracking URI the step uses (`replayrl.kfp.tracking_env`)."""
    from replayrl.kfp import tracking_env

    pod = os.environ.get(POD_ENV)
    if pod and not storage.is_s3(cfg.storage.run_root):
        raise ReplayRLError(
            f"The run root '{cfg.storage.run_root}' is a path inside this pod ({pod}): the "
            f"lineage would vanish with the pod and the next task would not find it. Nothing "
            f"was written. Pass the run_root parameter as s3://bucket/prefix, or set "
            f"storage.run_root in the config."
        )
    print(tracking_env.settle(cfg, os.environ, in_pod=bool(pod)), flush=True)


def lease_ttl_s(cfg: RunConfig) -> float:
    """How long the lease outlives its last renewal (`kubernetes.lease_ttl_s`): a running
    step renews it every third of that, so a killed run frees its lineage within one TTL."""
    return float(cfg.kubernetes.lease_ttl_s)


@contextlib.contextmanager
def user_errors_as_exit() -> Iterator[None]:
    """A ReplayRLError leaves the pod as one line on stderr and a failed task. Entered first
    in every component body: a pod that asked for GPUs (`REPLAYRL_REQUIRE_GPU`) stops here,
    with that one line, when CUDA cannot serve them."""
    # Whatever a library logs in the pod (botocore, urllib3, MLflow) is redacted.
    logs.install(os.environ)
    # A task of `replayrl run --engine kfp-local` ends with the run that started it.
    from replayrl.engine import children

    children.exit_with_starter()
    try:
        gpu.check_pod()
        yield
    except ReplayRLError as e:
        raise SystemExit(
            f"replayrl: error: {logs.redact(str(e), secrets=logs.known_secrets(os.environ))}"
        ) from None


@contextlib.contextmanager
def step(
    config: str, owner: str, *, release: bool = False, node: str | None = None
) -> Iterator[tuple[RunConfig, LineagePaths]]:
    """Inside a step: the resolved config and paths, with the lineage's lease held and kept
    alive by a heartbeat; `release` drops it when the step succeeds (the run's last step).
    `node`: log the pod's system metrics to the lineage's run as `system/<node>/...`."""
    from replayrl.engine.lineage import system_metrics_of

    with user_errors_as_exit():
        cfg = load_config(text=config)
        check_run_root(cfg)
        paths = storage.paths_of(cfg)
        with lease.heartbeat(paths, owner=owner, ttl_s=lease_ttl_s(cfg)):
            metrics = (
                system_metrics_of(cfg, paths, node_id=node) if node else contextlib.nullcontext()
            )
            with metrics:
                yield cfg, paths
        if release:
            lease.release(paths, owner=owner)


def continue_at(paths: LineagePaths, iteration: int, policy_version: int) -> tuple[int, int]:
    """(iteration, policy version) a step starts from: the ones given, or with `iteration`
    0 the lineage's next iteration and current policy version from its state (the caller
    holds the lease, so no other run moves them)."""
    if iteration:
        return iteration, policy_version
    state = storage.read_state(paths)
    if state is None:
        raise ReplayRLError(f"Lineage state '{paths.state}' does not exist: open it first.")
    return state.next_iteration, state.policy_version


# ---------------------------------------------------------------- results as JSON and metrics


def to_json(result: Any) -> str:
    return json.dumps(asdict(result), sort_keys=True)


def from_json(cls: type, text: str) -> Any:
    return cls(**json.loads(text))


def log_metrics(artifact: Any, values: dict[str, Any]) -> None:
    """Numbers of a step's result on a KFP `Metrics` artifact (shown in the run's UI)."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            artifact.log_metric(key, float(value))


def write_markdown(artifact: Any, text: str) -> None:
    with open(artifact.path, "w") as f:
        f.write(text)


# ---------------------------------------------------------------- open and record


def open_run(
    *,
    config: str,
    arm: str,
    lineage: str,
    run_root: str,
    owner: str,
    required_iterations: int,
    max_iterations: int = 0,
    model_id: str = "",
    dataset_id: str = "",
) -> tuple[RunConfig, int, int, int, bool]:
    """Open (or resume) the lineage for run `owner`: (config, next iteration, policy version,
    iterations left, whether v0's evaluation is still to be logged). Fails, releasing the
    lease, when fewer than `required_iterations` are left; with 0 required a finished
    lineage returns 0 left and no lease is kept. `max_iterations` (> 0): the most this
    pipeline was compiled to run (its `iterations` run parameter is refused above it or below
    1, before anything is written). Runs on a CPU pod: v0 is evaluated by a GPU task of its
    own (`evaluate_initial`)."""
    from replayrl.engine.lineage import initial_evaluation_due, open_lineage

    if max_iterations and not 1 <= required_iterations <= max_iterations:
        raise ReplayRLError(
            f"The iterations parameter is {required_iterations}; this pipeline was compiled to "
            f"run 1 to {max_iterations} (`replayrl compile --iterations N` raises the most). "
            f"Nothing was written."
        )
    cfg = resolve(
        config,
        arm=arm,
        lineage=lineage,
        run_root=run_root,
        model_id=model_id,
        dataset_id=dataset_id,
    )
    paths = storage.paths_of(cfg)
    # The store is checked before the lease is written: a run root that is not writable, or
    # an S3 store without conditional writes, is refused with nothing written.
    storage.ensure_writable(cfg.storage.run_root)
    try:
        with lease.heartbeat(paths, owner=owner, ttl_s=lease_ttl_s(cfg)):
            _, state, tracker = open_lineage(cfg, evaluate_initial=False)
            due = initial_evaluation_due(tracker, state.mlflow_run_id)
    except BaseException:
        lease.release(paths, owner=owner)  # a no-op when another run holds it
        raise
    remaining = cfg.iterations - state.next_iteration + 1
    if remaining < required_iterations:
        lease.release(paths, owner=owner)
        raise ReplayRLError(
            f"Lineage '{cfg.lineage}' has {max(remaining, 0)} iteration(s) left before "
            f"iterations={cfg.iterations}, but this run asks for {required_iterations}. Raise "
            f"`iterations` in the config, or set the run's iterations parameter to "
            f"{max(remaining, 1)}."
        )
    if remaining <= 0:
        lease.release(paths, owner=owner)
    return cfg, state.next_iteration, state.policy_version, max(remaining, 0), due


def evaluate_initial(cfg: RunConfig, paths: LineagePaths) -> Any:
    """Evaluate v0 and log it at step 0 of the lineage's MLflow run, unless a retry or an
    earlier run already did (the lease is held by the caller). Returns the EvalResult, or
    None when there was nothing to do."""
    from replayrl.engine.lineage import initial_evaluation_due, log_initial_evaluation
    from replayrl.engine.stores import make_tracker, tracking_uri

    state = storage.read_state(paths)
    if state is None:
        raise ReplayRLError(f"Lineage state '{paths.state}' does not exist: open it first.")
    tracker = make_tracker(cfg, state.tracking_uri or tracking_uri(cfg))
    if not initial_evaluation_due(tracker, state.mlflow_run_id):
        return None
    return log_initial_evaluation(cfg, paths, tracker, state.mlflow_run_id)


def release_run(
    *,
    config: str,
    run_root: str,
    owner: str,
    arms: list[str],
    lineages: list[str],
    model_id: str = "",
    dataset_id: str = "",
) -> list[str]:
    """The exit task of every pipeline: drop the leases run `owner` holds on its lineages
    (one per arm), whatever happened to the run. A lineage whose config does not resolve was
    never opened, so it holds no lease of this run; it is skipped with a line saying why.
    Returns one line per lineage, for the log."""
    said = []
    for arm, name in zip(arms, lineages, strict=True):
        try:
            cfg = resolve(
                config,
                arm=arm,
                lineage=name,
                run_root=run_root,
                model_id=model_id,
                dataset_id=dataset_id,
            )
        except ReplayRLError as e:
            said.append(f"nothing to release for arm '{arm or 'of the config'}': {e}")
            continue
        paths = storage.paths_of(cfg)
        if cfg.asynchronous.enabled and cfg.asynchronous.trainer_nodes > 1:
            from replayrl.kfp import async_runtime, trainjob

            # The segment's TrainJob, if it outlived its launcher (best effort, never raises).
            if trainjob.delete_for(async_runtime.segment_id_for(owner)):
                said.append(
                    f"deleted the TrainJob of segment {async_runtime.segment_id_for(owner)}"
                )
        if lease.release(paths, owner=owner):
            said.append(f"released the lease of {paths.root}")
        else:
            said.append(f"{paths.root}: no lease of run {owner} to release")
    return said


def record(
    cfg: RunConfig,
    paths: LineagePaths,
    *,
    owner: str,
    generated: str,
    compacted: str,
    trained: str,
    evaluated: str,
) -> tuple[Any, dict[str, float]]:
    """Log the iteration once and advance state.json (the commit point), as the inline
    engine does (the caller holds the lease, and releases it after the run's last one)."""
    from replayrl.engine.iteration import finish_lineage, record_iteration
    from replayrl.engine.steps import CompactResult, GenerateResult, TrainResult
    from replayrl.engine.stores import tracking_uri
    from replayrl.engine.tracking import Tracker
    from replayrl.policy.evaluation import EvalResult

    gen = from_json(GenerateResult, generated)
    state = storage.read_state(paths)
    if state is None or state.next_iteration != gen.iteration:
        found = None if state is None else state.next_iteration
        raise ReplayRLError(
            f"Lineage state '{paths.state}' says next iteration {found}, but this run did "
            f"iteration {gen.iteration}: another run advanced the lineage. Nothing was recorded."
        )
    tracker = Tracker(state.tracking_uri or tracking_uri(cfg), cfg.tracking.experiment)
    new_state, metrics = record_iteration(
        cfg,
        paths,
        state,
        tracker,
        gen=gen,
        comp=from_json(CompactResult, compacted),
        tr=from_json(TrainResult, trained),
        ev=from_json(EvalResult, evaluated) if evaluated else None,
    )
    if new_state.next_iteration > cfg.iterations:
        finish_lineage(cfg, paths, tracker, new_state)
    return new_state, metrics


def run_task(*, config: str, owner: str, iteration: int, count: int, release: bool, until: int = 0):
    """Iterations `iteration` .. `iteration + count - 1` (at most to `iterations`, and with
    `until` > 0 at most to iteration `until`: the run's last) of the lineage in this pod, with long-lived resources, ending in a full checkpoint; the inline
    engine's own loop. A retried pod first rewinds the lineage to its last full checkpoint
    (never before this task's first iteration: the task before ended with one) and redoes
    what follows it; a retry of a task that already committed its last iteration does
    nothing. Returns (final state, the last iteration's metrics or {})."""
    from replayrl.engine.inline import run_task as run_iterations
    from replayrl.engine.inline import task_start_time
    from replayrl.engine.iteration import flush_metrics
    from replayrl.engine.lineage import rewind
    from replayrl.engine.resources import TaskResources
    from replayrl.engine.stores import make_tracker, tracking_uri

    started_at = task_start_time()
    cfg = load_config(text=config)
    check_run_root(cfg)
    paths = storage.paths_of(cfg)
    ttl_s = lease_ttl_s(cfg)
    with lease.heartbeat(paths, owner=owner, ttl_s=ttl_s):
        last = min(iteration + count - 1, cfg.iterations, until or cfg.iterations)
        state = storage.read_state(paths)
        if state is None:
            raise ReplayRLError(
                f"Lineage state '{paths.state}' does not exist: open the lineage first."
            )
        tracker = make_tracker(cfg, state.tracking_uri or tracking_uri(cfg))
        flush_metrics(tracker, state)
        resources = TaskResources(cfg, paths)
        try:
            state = rewind(cfg, paths, state, resources=resources)
            if state.next_iteration < iteration:
                raise ReplayRLError(
                    f"Lineage '{cfg.lineage}' is at iteration {state.next_iteration}, before "
                    f"this task's first iteration {iteration}: another run rewound it. Nothing "
                    f"was run."
                )
            # One series per role: the pods of the task layout run one after another.
            with tracker.system_metrics(
                state.mlflow_run_id,
                enabled=cfg.tracking.system_metrics,
                interval_s=cfg.tracking.system_metrics_interval_s,
                node_id="iterations",
            ):
                state, _ = run_iterations(
                    cfg,
                    resources,
                    paths,
                    state,
                    tracker,
                    owner=owner,
                    lease_ttl_s=ttl_s,
                    last_iteration=last,
                    started_at=started_at,
                )
        finally:
            resources.close()
    if release or (until and state.next_iteration > until):
        lease.release(paths, owner=owner)
    pending = state.last_metrics or {}
    groups = pending.get("groups") or [[0, {}]]
    return state, dict(groups[0][1])


# The lineage so far, for KFP's compare-runs view: name -> the last iteration's metric.
SUMMARY_METRICS = {
    "generated_tokens": "cumulative/generated_tokens",
    "seconds": "cumulative/seconds",
    "cpu_seconds": "cumulative/cpu_seconds",
    "device_seconds": "cumulative/device_seconds",
    "mu": "ledger/mu",
}


def run_summary(state, metrics: dict[str, float]) -> dict[str, float]:
    """Numbers of the lineage so far, for a task's `Metrics` output (the KFP UI compares runs
    by these): `final_pass1` and `best_pass1` over every evaluation of the lineage (its MLflow
    run's eval/pass1 history), and the last iteration's cumulative generated tokens and
    seconds (wall; CPU or device seconds where logged) and μ."""
    from replayrl.engine.tracking import metric_history

    out = {name: metrics[key] for name, key in SUMMARY_METRICS.items() if key in metrics}
    if state.mlflow_run_id and state.tracking_uri:
        history = metric_history(state.tracking_uri, state.mlflow_run_id, "eval/pass1")
        if history:
            out["final_pass1"] = history[-1][1]
            out["best_pass1"] = max(value for _, value in history)
    out["iterations_done"] = float(state.next_iteration - 1)
    return out


def report(cfg: RunConfig, iteration: int, metrics: dict[str, float], tracking: str) -> str:
    """A short Markdown summary of a recorded iteration, for the KFP UI."""
    keys = [
        "eval/pass1",
        "rollout/mean_reward",
        "train/loss",
        "buffer/rows",
        "replay/ratio",
        "cumulative/generated_tokens",
        "cumulative/seconds",
    ]
    rows = "\n".join(f"| `{k}` | {metrics[k]:.4g} |" for k in keys if k in metrics)
    return (
        f"### {cfg.lineage}: iteration {iteration} of {cfg.iterations} ({cfg.arm})\n\n"
        f"| metric | value |\n|---|---|\n{rows}\n\n"
        f"All metrics: MLflow `{tracking}`, experiment `{cfg.tracking.experiment}`, "
        f"run `{cfg.lineage}`.\n"
    )
