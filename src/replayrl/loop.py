"""The inline engine: the whole loop in one Python process.

generate -> compact -> train -> evaluate (every k iterations) -> record, for each iteration
from the lineage's next one up to `cfg.iterations`. Re-running a lineage resumes after its
last recorded iteration; an interrupted iteration is redone, and its steps overwrite their
own partial output, so no row is duplicated. The Kubeflow engine calls the same steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from replayrl import lease, steps
from replayrl.config import RunConfig
from replayrl.lineage import open_lineage, record_iteration
from replayrl.progress import progress

log = logging.getLogger(__name__)

# How long the inline engine's lease on its lineage lasts unless renewed (it is renewed before
# every iteration, so it must outlast one). A run that died on another host blocks the
# lineage this long at most; one that died on this host is taken over at once.
INLINE_LEASE_TTL_S = 3600.0


@dataclass(frozen=True)
class IterationSummary:
    iteration: int
    pass1: float | None
    cumulative_generated_tokens: float
    cumulative_seconds: float


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


def run_inline(cfg: RunConfig) -> RunSummary:
    start = time.perf_counter()
    cache = steps.StepCache()
    paths, state, tracker = open_lineage(cfg, cache=cache)
    # One writer per lineage: a second run stops here, before it writes a row.
    owner = lease.inline_owner()
    lease.hold(paths, owner=owner, ttl_s=INLINE_LEASE_TTL_S)
    try:
        return _loop(cfg, cache, paths, state, tracker, owner=owner, start=start)
    finally:
        try:
            lease.release(paths, owner=owner)
        except Exception as e:  # noqa: BLE001 - never mask the run's own error
            log.warning("could not release the lease of %s: %s", paths.root, e)


def _loop(cfg: RunConfig, cache, paths, state, tracker, *, owner: str, start: float) -> RunSummary:
    resumed_from = state.next_iteration
    logged = tracker.logged_steps(state.mlflow_run_id)
    history = tracker.client.get_metric_history(state.mlflow_run_id, "eval/pass1")
    initial = next((m.value for m in history if m.step == 0), None)
    rows: list[IterationSummary] = []
    bar = progress(total=cfg.iterations, desc=f"{cfg.lineage}", initial=state.next_iteration - 1)
    last_pass1 = initial
    for t in range(state.next_iteration, cfg.iterations + 1):
        lease.hold(paths, owner=owner, ttl_s=INLINE_LEASE_TTL_S)  # renew
        v = state.policy_version
        gen = steps.generate(cfg, paths, iteration=t, policy_version=v, cache=cache)
        comp = steps.compact(cfg, paths, iteration=t, current_policy_version=v, cache=cache)
        tr = steps.train(
            cfg,
            paths,
            iteration=t,
            policy_version=v,
            buffer_version=comp.buffer_version,
            cache=cache,
        )
        ev = (
            steps.evaluate(cfg, paths, policy_version=tr.policy_version, cache=cache)
            if steps.eval_due(cfg, t)
            else None
        )
        state, metrics = record_iteration(
            cfg,
            paths,
            state,
            tracker,
            gen=gen,
            comp=comp,
            tr=tr,
            ev=ev,
            logged_steps=logged,
        )
        if ev is not None:
            last_pass1 = ev.pass1
            rows.append(
                IterationSummary(
                    t,
                    ev.pass1,
                    metrics["cumulative/generated_tokens"],
                    metrics["cumulative/seconds"],
                )
            )
        bar.update(1)
        bar.set_postfix(
            pass1=f"{last_pass1:.3f}" if last_pass1 is not None else "-",
            reward=f"{gen.mean_reward:.2f}",
        )
    bar.close()
    if state.next_iteration > cfg.iterations:
        tracker.set_terminated(state.mlflow_run_id)
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
