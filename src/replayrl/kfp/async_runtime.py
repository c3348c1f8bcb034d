"""What the components of the Kubeflow `async_segment` pipeline do inside their pods.

One run of the pipeline is one *segment* of an asynchronous lineage (`asynchronous.enabled`):

    begin_async_segment (CPU)   resolve the config, open (or resume) the lineage under the
                                run's lease, write the segment (`async_engine.begin_segment`)
                                with a deadline the pods' timeout allows
                                (`segment_seconds_allowed`), even when the config gives none
    async_role (accelerators)   W workers, the trainer and the evaluator, in parallel pods,
                                each a loop of `replayrl.engine.asynchronous.roles` holding the lease as the
                                run's owner while it works

A role whose peers have not all started within `asynchronous.peer_start_timeout_s` gives the
segment up, and every role stops (`replayrl.engine.asynchronous.peers`); a role that stops so
also stops the run's Argo workflow when a peer's pod is still Pending
(`replayrl.kfp.pending_peers`): a pod left Pending cannot keep the others, the run and its
exit task waiting for ever.

The roles coordinate only through the lineage's buffer and the files of
`replayrl.engine.asynchronous.board` (published weights, status, segment.json) under the run root: S3 on a
cluster. The segment id is derived from the KFP run id, so a retried pod of the same run finds
its own segment, and a later run's segment replaces it (a role of an older run then stops).

Every pod holds the lineage's lease as the run (one owner, many pods): a run that finds the
lineage held by another run stops before it writes, as every replayrl step does, and a role
that loses the lease (it expired and another run took it) stops with an error instead of
writing into a lineage that is no longer its run's.

Knows nothing about pipelines or pods; imports no `kfp` module.
"""

from __future__ import annotations

import _thread
import ctypes
import dataclasses
import hashlib
import logging
import os
import threading
import time
from typing import Any

from replayrl import storage
from replayrl.config import RunConfig, load_config
from replayrl.engine.asynchronous.peers import PeersMissing
from replayrl.errors import ReplayRLError
from replayrl.kfp.pending_peers import end_pending_peers
from replayrl.kfp.runtime import POD_ENV, check_run_root, lease_ttl_s, resolve
from replayrl.storage import lease

log = logging.getLogger(__name__)

ROLES = ("worker", "trainer", "evaluator")


def segment_id_for(owner: str) -> str:
    """The segment id of run `owner` (the KFP run id): a short, stable hash of it."""
    return hashlib.sha256(owner.encode()).hexdigest()[:12]


# A segment's last work after its deadline (the final gradient step, usage, weights and a
# full checkpoint, the last evaluation) gets this share of the accelerator pods' timeout,
# at least FINISH_MARGIN_MIN_S and at most half of it.
FINISH_MARGIN_SHARE = 0.1
FINISH_MARGIN_MIN_S = 600.0


def segment_seconds_allowed(cfg: RunConfig) -> float | None:
    """The longest a segment may run on Kubeflow: the accelerator pods' timeout
    (`kubernetes.gpu_step_timeout_s`) less the margin its final checkpoint and evaluation
    need (10% of it, at least 600 s, at most half): 19,440 s (5 h 24 min) for 6 h pods.
    None when the pods have no timeout (0). Counted from the begin task, before any role pod
    starts, so it ends before the timeout of every role, however long it was Pending."""
    timeout_s = float(cfg.kubernetes.gpu_step_timeout_s)
    if timeout_s <= 0:
        return None
    margin_s = min(max(FINISH_MARGIN_SHARE * timeout_s, FINISH_MARGIN_MIN_S), timeout_s / 2)
    return timeout_s - margin_s


def require_async(cfg: RunConfig) -> None:
    if not cfg.asynchronous.enabled:
        raise ReplayRLError(
            "The async_segment pipeline runs the asynchronous engine: its config must set "
            "asynchronous.enabled: true (a separate lineage from the synchronous one). For a "
            "synchronous lineage use replay_loop or replay_iteration."
        )


def require_kfp_pod() -> None:
    """Refuse to begin a segment outside a KFP pod (`kfp.local`): there tasks run one after
    another, so the trainer would wait forever for rows from workers that have not
    started. `replayrl run --engine async` runs the same roles side by side on one machine."""
    if not os.environ.get(POD_ENV):
        raise ReplayRLError(
            "The async_segment pipeline runs its workers, trainer and evaluator as parallel "
            "tasks; kfp.local runs tasks one after another, so the trainer would wait forever "
            "for rows from workers that have not started. Run it on a Kubeflow cluster, or on "
            "this machine with `replayrl run --engine async`. Nothing was written."
        )


def begin_async_segment(
    *,
    config: str,
    arm: str = "",
    lineage: str = "",
    run_root: str = "",
    owner: str,
    workers: int,
    model_id: str = "",
    dataset_id: str = "",
    trainer_nodes: int = 1,
) -> tuple[RunConfig, str]:
    """Begin run `owner`'s segment of an asynchronous lineage: (the resolved config, the
    segment id). Opens the lineage (creating it, or resuming it as it stands: an asynchronous
    lineage is never rewound) with the lease held as `owner`, publishes v0 when nothing is
    published, and writes the segment from the newest published version. The lease stays
    held for the role tasks (and the exit task releases it); on failure it is released.
    `workers`: the worker tasks the pipeline was compiled with, which must be the config's
    `asynchronous.workers` (a worker's batches interleave with the others' by that count)."""
    from replayrl.engine.asynchronous.supervisor import begin_segment
    from replayrl.engine.inline import task_start_time
    from replayrl.engine.lineage import open_lineage

    started_at = task_start_time()
    cfg = resolve(
        config,
        arm=arm,
        lineage=lineage,
        run_root=run_root,
        model_id=model_id,
        dataset_id=dataset_id,
    )
    require_async(cfg)
    if cfg.asynchronous.workers != workers:
        raise ReplayRLError(
            f"This async_segment pipeline was compiled with {workers} worker task(s), but the "
            f"config says asynchronous.workers: {cfg.asynchronous.workers}. Compile it with "
            f"that config (`replayrl compile --config FILE`), or set asynchronous.workers: "
            f"{workers}. Nothing was written."
        )
    if cfg.asynchronous.trainer_nodes != trainer_nodes:
        raise ReplayRLError(
            f"This async_segment pipeline was compiled for a trainer on {trainer_nodes} "
            f"node(s), but the config says asynchronous.trainer_nodes: "
            f"{cfg.asynchronous.trainer_nodes}. Compile it with that config (`replayrl compile "
            f"--config FILE`). Nothing was written."
        )
    paths = storage.paths_of(cfg)
    # The store is checked before the lease is written (as `runtime.open_run` does).
    storage.ensure_writable(cfg.storage.run_root)
    try:
        with lease.heartbeat(paths, owner=owner, ttl_s=lease_ttl_s(cfg)):
            paths, _, _ = open_lineage(cfg, evaluate_initial=False)
            segment = begin_segment(
                cfg,
                paths,
                started_at=started_at,
                segment_id=segment_id_for(owner),
                max_seconds=segment_seconds_allowed(cfg),
            )
    except BaseException:
        lease.release(paths, owner=owner)  # a no-op when another run holds it
        raise
    log.info(
        "segment %s of %s: gradient steps %d -> %d, %s",
        segment.id,
        cfg.lineage,
        segment.first_step,
        segment.end_step,
        "no deadline"
        if segment.deadline is None
        else f"ends by {segment.deadline - time.time():.0f} s from now at the latest",
    )
    return cfg, segment.id


def async_role(
    *, config: str, owner: str, role: str, index: int = 0, segment_id: str
) -> dict[str, Any]:
    """Run one role of segment `segment_id` in this pod until the segment is done: worker
    `index`, the trainer or the evaluator (`replayrl.engine.asynchronous.roles`), with the lineage's lease
    held as run `owner` and renewed by a heartbeat. A retried pod resumes from the published
    weights and the buffer. Returns the role's numbers (for the KFP UI). Does not release the
    lease: the other roles still work; the pipeline's exit task releases it. When the
    segment was given up (`PeersMissing`), first stops the run's workflow if a peer's pod is
    Pending (`replayrl.kfp.pending_peers`), so the run still ends and its exit task runs."""
    if role not in ROLES:
        raise ReplayRLError(f"Unknown asynchronous role {role!r}; use one of {', '.join(ROLES)}.")
    cfg = load_config(text=config)
    check_run_root(cfg)
    require_async(cfg)
    paths = storage.paths_of(cfg)
    try:
        return _run_role(cfg, paths, owner=owner, role=role, index=index, segment_id=segment_id)
    except PeersMissing:
        # The segment was given up: a peer whose pod stays Pending would keep this run (and
        # its exit task) open for ever, so stop the run's workflow (best effort, never
        # raises), then stop with the role's own error line.
        end_pending_peers(segment_id)
        raise


def _run_role(
    cfg: RunConfig,
    paths: storage.LineagePaths,
    *,
    owner: str,
    role: str,
    index: int,
    segment_id: str,
) -> dict[str, Any]:
    from replayrl.engine.asynchronous import board
    from replayrl.engine.asynchronous import roles as async_roles
    from replayrl.engine.asynchronous import trainer as async_trainer

    # The role tasks run side by side under their run's one take: they join its epoch.
    with lease.heartbeat(paths, owner=owner, ttl_s=lease_ttl_s(cfg), join=True) as beat:
        watch = _StopWhenLost(beat)
        try:
            with watch:
                if role == "worker":
                    status = async_roles.worker_loop(
                        cfg, paths, worker=index, segment_id=segment_id, threads=None
                    )
                elif role == "trainer":
                    final = async_trainer.trainer_loop(
                        cfg, paths, segment_id=segment_id, threads=None
                    )
                    return {"final_step": final, **_numbers(board.read_trainer(paths))}
                else:
                    status = async_roles.evaluator_loop(
                        cfg, paths, segment_id=segment_id, threads=None
                    )
        except KeyboardInterrupt:
            if not watch.fired:
                raise
            raise ReplayRLError(
                f"Another run took the lease of {paths.root} ({beat.lost}); this {role} "
                f"stopped. Everything it committed is kept."
            ) from None
    return _numbers(status)


def _interrupt_main() -> None:
    """Raise KeyboardInterrupt in the main thread at its next Python instruction, whatever
    SIGINT's handler is (`_thread.interrupt_main` simulates SIGINT, which a process that
    ignores or handles SIGINT would not turn into KeyboardInterrupt)."""
    main = threading.main_thread().ident
    if main is None:
        _thread.interrupt_main()
        return
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(main), ctypes.py_object(KeyboardInterrupt)
    )


class _StopWhenLost:
    """While the block runs, interrupt the main thread (KeyboardInterrupt) once the heartbeat
    finds the lease held by another run, so a role does not go on writing to a lineage that
    is another run's now (the one-machine engine stops its processes the same way). The
    interrupt arrives at the latest while the block exits (joining the watcher)."""

    def __init__(self, beat: lease.Heartbeat, *, poll_s: float = 1.0):
        self.beat, self.poll_s = beat, poll_s
        self.fired = False
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="replayrl-lease-watch", daemon=True
        )

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            if self.beat.lost:
                self.fired = True
                _interrupt_main()
                return

    def __enter__(self) -> _StopWhenLost:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def _numbers(status: Any) -> dict[str, Any]:
    return {
        k: v
        for k, v in dataclasses.asdict(status).items()
        if k not in ("pid", "updated_at") and isinstance(v, int | float) and not isinstance(v, bool)
    }
