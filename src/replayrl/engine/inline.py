"""The loop: iterations of one lineage with long-lived resources, in one process.

`run_task` is the whole of it, and both engines use it: the inline engine (`run_inline`)
runs every remaining iteration of a lineage as one task; a Kubeflow "task" pod runs
`kubernetes.iterations_per_task` of them. One iteration reads top to bottom in
`_iteration`:

    generate  -> compact -> train (checkpoint when due) -> evaluate (when due) -> record

The resources (`replayrl.engine.resources`: the trainer with its optimizer, one generation engine,
the buffer's in-memory mirror) are started once per task. A full checkpoint is written
every `train.checkpoint_every` iterations and at the end of the task; a run that dies in
between is rewound to the last one when the lineage is next opened (`lineage.rewind`) and
redoes the iterations after it, ending exactly where an uninterrupted run ends.

The wall clock of each iteration is split into the ledger's named parts (see
`replayrl.core.ledger`): the task's start-up (process start, imports, opening the lineage,
loading the trainer, starting the engine) is spread evenly over its iterations, and the
commit of one iteration (state swap, MLflow, pruning, vacuum, lease renewal) is counted in
the next one's `commit` part. Every part is read on both clocks of `replayrl.core.clock`, wall and
this process's CPU seconds; the start-up's CPU seconds are those since the process started
(its first task) or since `task_start_time` was called (later tasks).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from replayrl import storage
from replayrl.config import RunConfig
from replayrl.core import clock
from replayrl.engine import steps
from replayrl.engine.iteration import IterationClock, finish_lineage, record_iteration
from replayrl.engine.lineage import open_lineage
from replayrl.engine.resources import TaskResources
from replayrl.engine.stopping import LeaseLost, StopSignals
from replayrl.engine.tracking import Tracker
from replayrl.progress import progress
from replayrl.storage import LineagePaths, LineageState, lease

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IterationSummary:
    iteration: int
    pass1: float | None
    cumulative_generated_tokens: float
    cumulative_seconds: float
    # The same axis on the CPU clock (`cumulative/cpu_seconds`); NaN when not measured.
    cumulative_cpu_seconds: float = math.nan


@dataclass(frozen=True)
class RunSummary:
    lineage: str
    arm: str
    run_root: str
    mlflow_run_id: str
    tracking_uri: str
    initial_pass1: float | None
    rows: list[IterationSummary]
    wall_seconds: float
    resumed_from: int


def process_start_time() -> float:
    """Unix seconds when this process started (from /proc on Linux; elsewhere the time the
    loop was imported, which misses the interpreter's own start)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22, counted after the command name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()
_FIRST_TASK_STARTED = False
# The CPU clock (replayrl.core.clock) when the latest task's start-up began: 0 for the first
# task of a process (the clock counts from the process start).
_TASK_STARTED_CPU = 0.0


def task_start_time() -> float:
    """When this task's start-up began: the process start for the first task of a process
    (so interpreter start and imports count), the call itself for later ones (a process
    that runs several lineages, like `replayrl experiment` or a test, starts each task on
    top of the last). Also notes the CPU clock then, for the start-up's CPU seconds."""
    global _FIRST_TASK_STARTED, _TASK_STARTED_CPU
    if _FIRST_TASK_STARTED:
        _TASK_STARTED_CPU = clock.cpu_seconds()
        return time.time()
    _FIRST_TASK_STARTED = True
    _TASK_STARTED_CPU = 0.0
    return process_start_time()


def startup_counts_from_now() -> None:
    """The next task's start-up begins at its own call, not at the process start: for a
    process that does shared work before its first task (`replayrl experiment --async-split`
    makes every seed's warm start first), which belongs to no lineage's clock."""
    global _FIRST_TASK_STARTED
    _FIRST_TASK_STARTED = True


def run_inline(cfg: RunConfig, *, signals: StopSignals | None = None) -> RunSummary:
    """Run the lineage to `cfg.iterations` in this process, as one task. Between iterations
    it stops (`stopping.Stopped`, `stopping.LeaseLost`; the lease released) when `signals`
    received SIGTERM or SIGINT, or when the heartbeat found the lease taken by another run."""
    started_at = task_start_time()
    start = time.perf_counter()
    paths = storage.paths_of(cfg)
    resources = TaskResources(cfg, paths)
    try:
        with lease.held(
            paths, owner=lease.inline_owner(), ttl_s=storage.cli_lease_ttl_s()
        ) as holder:
            # One writer per lineage: a second run stops when opening takes the lease,
            # before it writes a row (or rewinds the lineage under the first one).
            paths, state, tracker = open_lineage(cfg, resources=resources, hold=holder.hold)
            resumed_from = state.next_iteration
            history = tracker.client.get_metric_history(state.mlflow_run_id, "eval/pass1")
            initial = next((m.value for m in history if m.step == 0), None)
            with tracker.system_metrics(
                state.mlflow_run_id,
                enabled=cfg.tracking.system_metrics,
                interval_s=cfg.tracking.system_metrics_interval_s,
            ):
                state, rows = run_task(
                    cfg,
                    resources,
                    paths,
                    state,
                    tracker,
                    owner=holder.owner,
                    lease_ttl_s=storage.cli_lease_ttl_s(),
                    last_iteration=cfg.iterations,
                    started_at=started_at,
                    initial_pass1=initial,
                    stop=_stop_check(paths, holder, signals),
                )
    finally:
        resources.close()
    return RunSummary(
        lineage=cfg.lineage,
        arm=cfg.arm,
        run_root=paths.root,
        mlflow_run_id=state.mlflow_run_id,
        tracking_uri=tracker.uri,
        initial_pass1=initial,
        rows=rows,
        wall_seconds=time.perf_counter() - start,
        resumed_from=resumed_from,
    )


def _stop_check(paths: LineagePaths, holder: lease.Holder, signals: StopSignals | None):
    """Raises before iteration t when the run must stop there (see `run_inline`)."""

    def check(t: int) -> None:
        where = f"before iteration {t}"
        if holder.lost:
            raise LeaseLost(paths.root, holder.lost, where)
        if signals is not None:
            signals.check(where)

    return check


def checkpoint_due(cfg: RunConfig, iteration: int, *, last_of_task: int) -> bool:
    """A full checkpoint after every k-th iteration and the task's last one."""
    return iteration % cfg.train.checkpoint_every == 0 or iteration == last_of_task


def run_task(
    cfg: RunConfig,
    resources: TaskResources,
    paths: LineagePaths,
    state: LineageState,
    tracker: Tracker,
    *,
    owner: str,
    lease_ttl_s: float,
    last_iteration: int,
    started_at: float,
    initial_pass1: float | None = None,
    stop: Callable[[int], None] | None = None,
) -> tuple[LineageState, list[IterationSummary]]:
    """Iterations `state.next_iteration` .. `last_iteration` with `resources`, the last one
    ending in a full checkpoint; the lineage must be open (rewound) and its lease held by
    `owner`. `started_at` (unix seconds) is when the task's process started: everything
    until the first iteration is the task's start-up. `stop(t)`, called before each
    iteration t (after the previous one's commit: the safe point), raises to end the task
    there. Returns the final state and the evaluated iterations."""
    first = state.next_iteration
    count = last_iteration - first + 1
    rows: list[IterationSummary] = []
    if count <= 0:
        return state, rows
    startup = _start_resources(cfg, resources, state, count=count, started_at=started_at)
    logged = tracker.logged_steps(state.mlflow_run_id)
    bar = progress(total=cfg.iterations, desc=cfg.lineage, initial=first - 1)
    last_pass1 = initial_pass1
    previous_end = clock.now()
    for t in range(first, last_iteration + 1):
        if stop is not None:
            stop(t)
        lease.hold(paths, owner=owner, ttl_s=lease_ttl_s)  # renew
        commit = clock.since(previous_end)
        state, metrics, ev, end = _iteration(
            cfg,
            resources,
            paths,
            state,
            tracker,
            iteration=t,
            checkpoint=checkpoint_due(cfg, t, last_of_task=last_iteration),
            logged=logged,
            timing=dict(**startup, commit=commit, started=previous_end),
        )
        previous_end = end
        if ev is not None:
            last_pass1 = ev.pass1
            rows.append(
                IterationSummary(
                    t,
                    ev.pass1,
                    metrics["cumulative/generated_tokens"],
                    metrics["cumulative/seconds"],
                    metrics.get("cumulative/cpu_seconds", math.nan),
                )
            )
        bar.update(1)
        bar.set_postfix(
            pass1=f"{last_pass1:.3f}" if last_pass1 is not None else "-",
            reward=f"{metrics['rollout/mean_reward']:.2f}",
        )
    bar.close()
    if state.next_iteration > cfg.iterations:
        finish_lineage(cfg, paths, tracker, state)
    return state, rows


def _start_resources(
    cfg: RunConfig, resources: TaskResources, state: LineageState, *, count: int, started_at: float
) -> dict:
    """Start the long-lived resources before the first iteration, so their start is start-up,
    not generation or training; returns each iteration's share of the start-up (wall and
    CPU seconds, and the engine-start / trainer-load detail)."""
    # vLLM first: it reserves its share of the free GPU memory when it starts, so the
    # trainer's model and optimizer must not be there yet.
    if cfg.rollout.backend == "vllm":
        resources.forget_weights_copy()  # the engine holds the policy; a copy would only take memory
        resources.backend_at(state.policy_version)
    if cfg.train.distributed == "none":
        resources.trainer_at(state.policy_version, steps.step_settings(cfg))
    resources.backend_at(state.policy_version)
    return dict(
        startup_seconds=max(time.time() - started_at, 0.0) / count,
        startup_cpu_seconds=max(clock.cpu_seconds() - _TASK_STARTED_CPU, 0.0) / count,
        startup_detail={
            "engine_start": resources.startup.engine_start / count,
            "trainer_load": resources.startup.trainer_load / count,
        },
    )


def _iteration(
    cfg: RunConfig,
    resources: TaskResources,
    paths: LineagePaths,
    state: LineageState,
    tracker: Tracker,
    *,
    iteration: int,
    checkpoint: bool,
    logged: set[int],
    timing: dict,
):
    """One iteration, top to bottom; (new state, metrics, eval result or None, the
    `clock.now()` reading where its wall and CPU clocks end)."""
    t, v = iteration, state.policy_version
    gpu = GpuPeaks()
    with gpu.phase("generate"):
        gen = steps.generate(cfg, paths, iteration=t, policy_version=v, resources=resources)
    comp = steps.compact(cfg, paths, iteration=t, current_policy_version=v, resources=resources)
    with gpu.phase("train"):
        tr = steps.train(
            cfg,
            paths,
            iteration=t,
            policy_version=v,
            buffer_version=comp.buffer_version,
            resources=resources,
            checkpoint=checkpoint,
        )
    ev = None
    if steps.eval_due(cfg, t):
        with gpu.phase("evaluate"):
            ev = steps.evaluate(cfg, paths, policy_version=tr.policy_version, resources=resources)
    end = clock.now()
    engine_sync = resources.pop_engine_sync()
    new_state, metrics = record_iteration(
        cfg,
        paths,
        state,
        tracker,
        gen=gen,
        comp=comp,
        tr=tr,
        ev=ev,
        logged_steps=logged,
        clock=IterationClock(
            wall_seconds=end.wall - timing["started"].wall + timing["startup_seconds"],
            overheads={
                "startup": timing["startup_seconds"],
                "commit": timing["commit"].wall,
                "engine_sync": engine_sync.wall,
            },
            cpu_seconds=end.cpu - timing["started"].cpu + timing["startup_cpu_seconds"],
            cpu_overheads={
                "startup": timing["startup_cpu_seconds"],
                "commit": timing["commit"].cpu,
                "engine_sync": engine_sync.cpu,
            },
            startup_detail=timing["startup_detail"],
        ),
        extra_metrics=gpu.metrics(),
        resources=resources,
    )
    return new_state, metrics, ev, end


class GpuPeaks:
    """Peak GPU memory of each phase of an iteration (GiB), when there is a GPU."""

    def __init__(self):
        self.enabled = torch.cuda.is_available()
        self.peaks: dict[str, float] = {}

    def phase(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def measured():
            if self.enabled:
                torch.cuda.reset_peak_memory_stats()
            yield
            if self.enabled:
                self.peaks[name] = torch.cuda.max_memory_allocated() / 2**30

        return measured()

    def metrics(self) -> dict[str, float]:
        return {f"gpu/peak_gib_{name}": gib for name, gib in self.peaks.items()}
