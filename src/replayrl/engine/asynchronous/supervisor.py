"""The asynchronous engine on one machine: W generation workers, one trainer and one evaluator
as separate processes over the lineage's durable buffer (`replayrl run --engine async`).

One call runs one *segment*: from the newest published weights to `asynchronous.segment_steps`
more gradient steps, `asynchronous.segment_seconds`, or the lineage's last step
(iterations x S), whichever comes first. Reading it top to bottom:

    open the lineage (create it, or resume it: no rewind, the buffer stays as it is)
    hold its lease for the whole segment (a heartbeat renews it)
    begin the segment: v0 published if nothing is, segment.json written
    start the roles (`replayrl.engine.asynchronous.roles`) as spawn processes (delta-rs is not fork-safe)
    supervise them: a role that dies (a crash, SIGKILL) is started again, up to
        MAX_RESTARTS times each; it resumes from the published weights and the buffer
    when the trainer has marked the segment done, wait for the workers and the evaluator

Roles coordinate only through storage (`replayrl.engine.asynchronous.board`), exactly as the parallel tasks
of the Kubeflow async_segment pipeline do; this module only starts and watches processes.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from replayrl import storage
from replayrl.config import RunConfig, config_from_dict
from replayrl.engine.asynchronous import board
from replayrl.errors import ReplayRLError
from replayrl.storage import LineagePaths, lease

log = logging.getLogger(__name__)

# How often one role is started again after it died, per segment.
MAX_RESTARTS = 3
LEASE_TTL_S = 600.0
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
    cfg: RunConfig, paths: LineagePaths, *, started_at: float, segment_id: str | None = None
) -> board.Segment:
    """Publish v0 when nothing is published yet, then write the segment that starts at the
    newest published version (a crashed segment's record is replaced)."""
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
    segment = board.Segment(
        id=segment_id or uuid.uuid4().hex[:12],
        first_step=pointer.version,
        end_step=end,
        started_at=started_at,
        deadline=None if a.segment_seconds is None else time.time() + a.segment_seconds,
        cumulative_seconds_at_start=pointer.cumulative_seconds,
    )
    board.write_segment(paths, segment)
    return segment


def run_role(cfg_data: dict, role: str, index: int, segment_id: str, threads: int | None) -> None:
    """A role process's entry point (picklable for the spawn start method)."""
    from replayrl.engine.asynchronous import roles as async_roles
    from replayrl.engine.asynchronous import trainer as async_trainer

    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {role}{index} %(levelname)s %(message)s"
    )
    cfg = config_from_dict(cfg_data)
    paths = storage.paths_of(cfg)
    if role == "worker":
        async_roles.worker_loop(cfg, paths, worker=index, segment_id=segment_id, threads=threads)
    elif role == "trainer":
        async_trainer.trainer_loop(cfg, paths, segment_id=segment_id, threads=threads)
    elif role == "evaluator":
        async_roles.evaluator_loop(cfg, paths, segment_id=segment_id, threads=threads)
    else:
        raise ReplayRLError(f"unknown role {role!r}")


def run_async(cfg: RunConfig, *, threads: int | None = 1) -> AsyncSummary:
    """Run one segment of the lineage with the asynchronous engine; see the module docstring.
    `threads`: torch threads per role process (1: one core each)."""
    from replayrl.engine.inline import task_start_time
    from replayrl.engine.lineage import open_lineage

    if not cfg.asynchronous.enabled:
        raise ReplayRLError("run_async needs asynchronous.enabled: true (--engine async).")
    started_at = task_start_time()
    start = time.perf_counter()
    paths = storage.paths_of(cfg)
    with lease.held(paths, owner=lease.inline_owner(), ttl_s=LEASE_TTL_S) as holder:
        paths, state, tracker = open_lineage(cfg, hold=holder.hold, evaluate_initial=False)
        segment = begin_segment(cfg, paths, started_at=started_at)
        restarts = _supervise(cfg, paths, segment, threads=threads, lost=lambda: holder.lost)
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


def _supervise(
    cfg: RunConfig, paths: LineagePaths, segment: board.Segment, *, threads, lost
) -> Counter:
    """Start the roles, restart any that dies, return when all have finished."""
    ctx = mp.get_context("spawn")  # delta-rs (and torch's threads) are not fork-safe
    data = cfg.to_dict()
    roles = [("trainer", 0), ("evaluator", 0)] + [
        ("worker", w) for w in range(cfg.asynchronous.workers)
    ]
    procs: dict[tuple[str, int], mp.Process] = {}
    restarts: Counter = Counter()
    finished: set[tuple[str, int]] = set()

    def start(role: str, index: int) -> None:
        p = ctx.Process(
            target=run_role,
            args=(data, role, index, segment.id, threads),
            name=f"replayrl-{role}{index}",
        )
        p.start()
        procs[(role, index)] = p

    for role, index in roles:
        start(role, index)
    drain_until = None
    try:
        while len(finished) < len(roles):
            time.sleep(0.2)
            if lost():
                raise ReplayRLError(
                    f"another run took the lease of {paths.root}; this segment stops"
                )
            for key, p in list(procs.items()):
                if key in finished or p.exitcode is None:
                    continue
                if p.exitcode == 0:
                    finished.add(key)
                    continue
                name = f"{key[0]}{key[1]}"
                if restarts[name] >= MAX_RESTARTS:
                    raise ReplayRLError(
                        f"the asynchronous {key[0]} {key[1]} of {cfg.lineage} died "
                        f"{MAX_RESTARTS + 1} times (last exit code {p.exitcode}); see its log "
                        "above. Everything committed is kept: rerun the same command to resume."
                    )
                restarts[name] += 1
                log.warning(
                    "%s died (exit code %s): starting it again (%d of %d)",
                    name,
                    p.exitcode,
                    restarts[name],
                    MAX_RESTARTS,
                )
                start(*key)
            if ("trainer", 0) in finished and drain_until is None:
                drain_until = time.time() + DRAIN_S
            if drain_until is not None and time.time() > drain_until:
                log.warning("stopping roles that did not finish %.0f s after the trainer", DRAIN_S)
                break
    finally:
        _stop_all(procs, paths, segment)
    return restarts


def _stop_all(procs: dict, paths: LineagePaths, segment: board.Segment) -> None:
    """Stop every role still running: mark the segment done (they stop between batches),
    then terminate what is left. A stopped worker loses at most its uncommitted batch."""
    alive = [p for p in procs.values() if p.exitcode is None]
    if not alive:
        return
    current = board.read_segment(paths)
    if current is not None and current.id == segment.id and not current.done:
        board.write_segment(paths, board.Segment(**{**current.__dict__, "done": True}))
    deadline = time.time() + 30
    for p in alive:
        p.join(timeout=max(deadline - time.time(), 0.1))
    for p in alive:
        if p.exitcode is None:
            p.terminate()
            p.join(timeout=10)
