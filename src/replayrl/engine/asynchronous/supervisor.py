"""The asynchronous engine on one machine: W generation workers, one trainer and one evaluator
as separate processes over the lineage's durable buffer (`replayrl run --engine async`).

One call runs one *segment*: from the newest published weights to `asynchronous.segment_steps`
more gradient steps, `asynchronous.segment_seconds`, or the lineage's last step
(iterations x S), whichever comes first. Reading it top to bottom:

    open the lineage (create it, or resume it: no rewind, the buffer stays as it is)
    hold its lease for the whole segment (a heartbeat renews it)
    begin the segment: v0 published if nothing is, segment.json written
    start the roles (`replayrl.engine.asynchronous.roles`) as spawn processes (delta-rs is
        not fork-safe); each dies with this process (`replayrl.engine.children`)
    supervise them: a role that dies (a crash, SIGKILL) or stalls (no progress report within
        the watchdog's limit, `replayrl.engine.asynchronous.watchdog`: stopped with SIGTERM,
        then SIGKILL) is started again, up to MAX_RESTARTS times each; it resumes from the
        published weights and the buffer. Past that, the run ends with an error.
    when the trainer has marked the segment done, wait for the workers and the evaluator
    at the end, on an error, on SIGTERM/SIGINT (`replayrl.engine.stopping`) or when the
        lease is lost: SIGTERM to every role left, SIGKILL after asynchronous.stop_grace_s

Roles coordinate only through storage (`replayrl.engine.asynchronous.board`), exactly as the parallel tasks
of the Kubeflow async_segment pipeline do; this module only starts and watches processes.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from replayrl import logs, storage
from replayrl.config import RunConfig, config_from_dict
from replayrl.engine import children
from replayrl.engine.asynchronous import board, devices, watchdog
from replayrl.engine.stopping import LeaseLost
from replayrl.errors import ReplayRLError
from replayrl.storage import LineagePaths, lease

log = logging.getLogger(__name__)

# How often one role is started again after it died or stalled, per segment.
MAX_RESTARTS = 3
# How often the supervisor looks at its roles (seconds).
POLL_S = 0.2
# How long workers and the evaluator get to finish their batch or evaluation once the
# trainer is done, before they are stopped (nothing committed is lost either way).
DRAIN_S = 600.0


@dataclass(frozen=True)
class AsyncSummary:
    lineage: str
    arm: str
    run_root: str
    mlflow_run_id: str
    tracking_uri: str
    first_step: int
    final_step: int
    wall_seconds: float
    # (gradient step, held-out greedy pass@1, cumulative wall seconds at its publication)
    evaluations: list[tuple[int, float, float]]
    restarts: dict[str, int]


def begin_segment(
    cfg: RunConfig,
    paths: LineagePaths,
    *,
    started_at: float,
    segment_id: str | None = None,
    max_seconds: float | None = None,
) -> board.Segment:
    """Publish v0 when nothing is published yet, then write the segment that starts at the
    newest published version (a crashed segment's record is replaced). Its deadline is
    `asynchronous.segment_seconds` from now, cut to `max_seconds` (what the pods that run it
    allow, on Kubeflow) when that is shorter; None: the config's alone."""
    pointer = board.latest(paths)
    if pointer is None:
        pointer = board.Published(
            version=0,
            published_at=time.time(),
            cumulative_seconds=0.0,
            cumulative_generated_tokens=0,
        )
        board.point_to(paths, pointer)
    a = cfg.asynchronous
    end = cfg.total_gradient_steps
    if a.segment_steps is not None:
        end = min(end, pointer.version + a.segment_steps)
    seconds = a.segment_seconds
    if max_seconds is not None and (seconds is None or seconds > max_seconds):
        seconds = max_seconds
    segment = board.Segment(
        id=segment_id or uuid.uuid4().hex[:12],
        first_step=pointer.version,
        end_step=end,
        started_at=started_at,
        deadline=None if seconds is None else time.time() + seconds,
        cumulative_seconds_at_start=pointer.cumulative_seconds,
    )
    board.write_segment(paths, segment)
    return segment


def run_role(
    cfg_data: dict,
    role: str,
    index: int,
    segment_id: str,
    threads: int | None,
    parent_pid: int,
    pulse,
    epoch: int | None,
    placement: devices.Placement | None = None,
) -> None:
    """A role process's entry point (picklable for the spawn start method): it dies with its
    supervisor (`children.adopt`), reports progress on `pulse`, writes under the lease's
    fencing `epoch` (None: no fence), sees only the GPUs of its `placement`
    (`devices.apply`, before anything starts CUDA), and exits with `children.exit_code_of`
    an error that must not be retried."""
    if placement is not None:
        devices.apply(placement, os.environ)
    from replayrl.engine.asynchronous import roles as async_roles
    from replayrl.engine.asynchronous import trainer as async_trainer

    children.adopt(parent_pid, pulse)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {role}{index} %(levelname)s %(message)s"
    )
    logs.install(os.environ)  # a spawned child redacts secrets like its parent
    cfg = config_from_dict(cfg_data)
    paths = storage.paths_of(cfg)
    if epoch is not None:
        from replayrl.storage import fencing

        fencing.install(fencing.Fence(paths.root, epoch))
    from replayrl.engine.lineage import system_metrics_of

    try:
        if role == "worker":
            with system_metrics_of(cfg, paths, node_id=f"worker{index}"):
                async_roles.worker_loop(
                    cfg, paths, worker=index, segment_id=segment_id, threads=threads
                )
        elif role == "trainer":
            async_trainer.trainer_loop(cfg, paths, segment_id=segment_id, threads=threads)
        elif role == "evaluator":
            with system_metrics_of(cfg, paths, node_id="evaluator"):
                async_roles.evaluator_loop(cfg, paths, segment_id=segment_id, threads=threads)
        else:
            raise ReplayRLError(f"unknown role {role!r}")
    except ReplayRLError as e:
        code = children.exit_code_of(e)
        if code is None:
            raise
        log.error("%s", e)
        sys.exit(code)


def run_async(cfg: RunConfig, *, threads: int | None = 1, signals=None) -> AsyncSummary:
    """Run one segment of the lineage with the asynchronous engine; see the module docstring.
    `threads`: torch threads per role process (1: one core each). `signals`: a
    `stopping.StopSignals`; once it received SIGTERM or SIGINT the roles are stopped and
    `stopping.Stopped` raised, the lease released."""
    from replayrl.engine.inline import task_start_time
    from replayrl.engine.lineage import open_lineage

    if not cfg.asynchronous.enabled:
        raise ReplayRLError("run_async needs asynchronous.enabled: true (--engine async).")
    started_at = task_start_time()
    start = time.perf_counter()
    paths = storage.paths_of(cfg)
    with lease.held(paths, owner=lease.inline_owner(), ttl_s=storage.cli_lease_ttl_s()) as holder:
        paths, state, tracker = open_lineage(cfg, hold=holder.hold, evaluate_initial=False)
        segment = begin_segment(cfg, paths, started_at=started_at)
        fence = getattr(holder, "fence", None)
        restarts = Supervisor(
            cfg,
            paths,
            segment,
            threads=threads,
            epoch=None if fence is None else fence.epoch,
            lost=lambda: holder.lost,
            signals=signals,
        ).run()
    done = board.read_segment(paths)
    evaluations = []
    for name in storage.list_dir(storage.join(board.root(paths), "eval")):
        found = board.read_eval(paths, int(name[1:].split(".")[0]))
        if found is not None:
            evaluations.append(
                (found["version"], found["result"]["pass1"], found["cumulative_seconds"])
            )
    return AsyncSummary(
        lineage=cfg.lineage,
        arm=cfg.arm,
        run_root=paths.root,
        mlflow_run_id=state.mlflow_run_id,
        tracking_uri=tracker.uri,
        first_step=segment.first_step,
        final_step=done.final_step if done and done.final_step is not None else segment.first_step,
        wall_seconds=time.perf_counter() - start,
        evaluations=sorted(evaluations),
        restarts=dict(restarts),
    )


def _gpu_count() -> int:
    """GPUs this process sees (0 without CUDA); counting them starts no CUDA context."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class Supervisor:
    """The role processes of one segment: start them, restart any that dies or stalls (the
    watchdog), stop them all at the end. `run()` returns the restarts per role."""

    def __init__(self, cfg, paths, segment, *, threads, epoch, lost, signals):
        self.cfg, self.paths, self.segment = cfg, paths, segment
        self.threads, self.epoch, self.lost, self.signals = threads, epoch, lost, signals
        self.ctx = mp.get_context("spawn")  # delta-rs (and torch's threads) are not fork-safe
        self.data = cfg.to_dict()
        self.roles = [("trainer", 0), ("evaluator", 0)] + [
            ("worker", w) for w in range(cfg.asynchronous.workers)
        ]
        # Each role's GPUs and what shares them (`devices`); all on the CPU without CUDA.
        self.placements = devices.assign_devices(
            _gpu_count(), workers=cfg.asynchronous.workers, trainers=cfg.asynchronous.trainers
        )
        self.procs: dict[tuple[str, int], mp.Process] = {}
        self.pulses: dict[tuple[str, int], watchdog.Pulse] = {}
        # Roles the watchdog is stopping: when SIGTERM went, and why.
        self.stopping: dict[tuple[str, int], tuple[float, str]] = {}
        self.restarts: Counter = Counter()
        self.finished: set[tuple[str, int]] = set()

    def start(self, role: str, index: int) -> None:
        pulse = watchdog.Pulse.new(self.ctx)
        p = self.ctx.Process(
            target=run_role,
            args=(
                self.data,
                role,
                index,
                self.segment.id,
                self.threads,
                os.getpid(),
                pulse.shared,
                self.epoch,
                self.placements[(role, index)],
            ),
            name=f"replayrl-{role}{index}",
        )
        p.start()
        self.procs[(role, index)] = p
        self.pulses[(role, index)] = pulse

    def run(self) -> Counter:
        for role, index in self.roles:
            self.start(role, index)
        drain_until = None
        try:
            while len(self.finished) < len(self.roles):
                time.sleep(POLL_S)
                self._check_stop()
                for key in list(self.procs):
                    self._watch(key)
                if ("trainer", 0) in self.finished and drain_until is None:
                    drain_until = time.time() + DRAIN_S
                if drain_until is not None and time.time() > drain_until:
                    log.warning(
                        "stopping roles that did not finish %.0f s after the trainer", DRAIN_S
                    )
                    break
        finally:
            stop_all(list(self.procs.values()), grace_s=self.cfg.asynchronous.stop_grace_s)
        return self.restarts

    def _check_stop(self) -> None:
        why = self.lost()
        if why:
            raise LeaseLost(self.paths.root, why, "with its roles")
        if self.signals is not None and self.signals.received is not None:
            step = board.read_trainer(self.paths).gradient_step
            self.signals.check(f"at gradient step {step}")

    def _watch(self, key: tuple[str, int]) -> None:
        """One look at role `key`: a stall stopped, an exit taken note of or restarted."""
        a = self.cfg.asynchronous
        p, name = self.procs[key], f"{key[0]}{key[1]}"
        if key in self.finished:
            return
        if p.exitcode is None:
            if key in self.stopping:
                since, _ = self.stopping[key]
                if time.monotonic() - since > a.stop_grace_s:
                    p.kill()  # a stopped (SIGSTOP) or stuck process ignores SIGTERM
                return
            stalled = self.pulses[key].stalled(
                timeout_s=a.stall_timeout_s, startup_s=a.stall_startup_s
            )
            if stalled is not None:
                why = f"made no progress for {stalled[0]:.0f} s (limit {stalled[1]:.0f} s)"
                log.warning(
                    "%s %s: stopping it (SIGTERM, then SIGKILL after %.0f s)",
                    name,
                    why,
                    a.stop_grace_s,
                )
                self.stopping[key] = (time.monotonic(), why)
                p.terminate()
            return
        _, why = self.stopping.pop(key, (0.0, f"died (exit code {p.exitcode})"))
        if p.exitcode == 0:
            self.finished.add(key)
            return
        if p.exitcode == children.EXIT_SUPERSEDED:
            raise ReplayRLError(
                f"the asynchronous {key[0]} {key[1]} found that a newer run took the lineage "
                f"{self.cfg.lineage} over (see its log above); this run stops."
            )
        if self.restarts[name] >= MAX_RESTARTS:
            raise ReplayRLError(
                f"the asynchronous {key[0]} {key[1]} of {self.cfg.lineage} {why}, after "
                f"{MAX_RESTARTS} restarts; see its log above. Everything committed is kept: "
                "rerun the same command to resume."
            )
        self.restarts[name] += 1
        log.warning(
            "%s %s: starting it again (%d of %d)", name, why, self.restarts[name], MAX_RESTARTS
        )
        self.start(*key)


def stop_all(procs: list, *, grace_s: float) -> None:
    """Stop every process of `procs` still running: SIGTERM (a role exits at once, running
    its `finally` blocks), then SIGKILL to any left after `grace_s`. A stopped worker loses
    at most its uncommitted batch, a stopped trainer the steps since its last publication."""
    alive = [p for p in procs if p.exitcode is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(timeout=max(deadline - time.monotonic(), 0.01))
    for p in alive:
        if p.exitcode is None:
            log.warning("%s did not stop %.0f s after SIGTERM: SIGKILL", p.name, grace_s)
            p.kill()
            p.join(timeout=10)
