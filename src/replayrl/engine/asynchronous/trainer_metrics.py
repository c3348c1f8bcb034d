"""The asynchronous trainer's MLflow records (`replayrl.engine.asynchronous.trainer` is its
loop): each publication's metrics (`_log`: the usage, cost and replay metrics of the steps
since the last publication, at step g and at step ktokens), the evaluator's results of due
versions once it has written them (`_log_evals`), the versions already logged when a trainer
starts (`_logged_versions`), and, after a segment's last publication, the wait for its due
evaluations (`_await_evaluations`). Metrics are built by `replayrl.engine.metric_schema`, as
every engine's. Knows nothing about steps, batches, retention or checkpoints: it reads what
the trainer counted (`_Window`, `_Uses`, its status) and the board's records.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import numpy as np

from replayrl import storage
from replayrl.config import RunConfig
from replayrl.engine import children, metric_schema
from replayrl.engine.asynchronous import board
from replayrl.engine.asynchronous.roles import POLL_S, eval_due_versions

if TYPE_CHECKING:
    from replayrl.engine.asynchronous.trainer import _Uses, _Window

log = logging.getLogger(__name__)


def _log(
    cfg, paths, tracker, run_id, window: _Window, uses: _Uses, record, status, workers
) -> None:
    """The publication's metrics, at step g and (async/, replay/) at step ktokens, built with
    the record path's shared functions (`replayrl.engine.metric_schema`)."""
    g = record.version
    a = cfg.asynchronous
    ages = np.concatenate(window.ages) if window.ages else np.array([])
    k_inf = sum(w.rows_appended for w in workers)
    k_train = status.row_uses
    gen_busy = sum(w.busy_seconds for w in workers)
    # Device-seconds on both sides: W workers' summed, T trainer ranks' (rank 0's x T).
    train_busy = a.trainers * status.busy_seconds
    # The replay ratio per row: uses so far of each row this window's steps used.
    used = {rid for table in window.usage for rid in table.column("rollout_id").to_pylist()}
    # (Rows retention deleted since their use have left the in-memory counts.)
    counts = np.array([uses.count[rid] for rid in used if rid in uses.count], dtype=np.float64)
    evaluator = board.read_evaluator(paths)
    asynchronous = {
        "published_version": float(g),
        "rows_generated": float(k_inf),
        "row_uses": float(k_train),
        "unused_rows": float(status.unused_rows),
        **metric_schema.async_cost_metrics(
            workers=a.workers,
            trainers=a.trainers,
            rows_generated=k_inf,
            row_uses=k_train,
            workers_busy_seconds=gen_busy,
            trainer_busy_seconds=status.busy_seconds,
        ),
        "trainer_busy_seconds": status.busy_seconds,
        "trainer_idle_seconds": status.idle_seconds,
        "workers_busy_seconds": gen_busy,
        "workers_idle_seconds": sum(w.idle_seconds for w in workers),
        "trainer_send_seconds": status.send_seconds,
        "trainer_publish_seconds": status.publish_seconds,
        "weight_send_failures": float(status.send_failures),
        "workers_apply_seconds": sum(w.apply_seconds for w in workers),
        "workers_receive_seconds": sum(w.receive_seconds for w in workers),
        "versions_by_broadcast": float(sum(w.broadcast_loads for w in workers)),
        "versions_from_files": float(sum(w.file_loads for w in workers)),
        "evaluator_busy_seconds": evaluator.busy_seconds,
        "evaluator_idle_seconds": evaluator.idle_seconds,
        "oldest_worker_version": float(
            min(
                (w.policy_version for w in workers if w.policy_version is not None),
                default=math.nan,
            )
        ),
    }
    replay = metric_schema.replay_metrics(ages=ages, gaps=np.asarray(window.gaps)) | {
        "replay/uses_per_row_mean": float(counts.mean()) if counts.size else math.nan,
        "replay/uses_per_row_max": float(counts.max()) if counts.size else math.nan,
    }
    at_step = {f"async/{k}": v for k, v in asynchronous.items()} | replay
    at_step |= metric_schema.train_metrics(window.stats) | {
        "iteration": g / cfg.train.steps_per_iteration,
        "cumulative/wall_seconds": record.cumulative_seconds,
        "cumulative/generated_tokens": float(record.cumulative_generated_tokens),
        "cumulative/rollouts_generated": float(k_inf),
        "cumulative/rollouts_trained": float(k_train),
        # The comparison's compute axis, as the inline ledger's: generation + training
        # seconds, here the workers' and the trainers' busy device-seconds.
        "cumulative/generation_seconds": gen_busy,
        "cumulative/training_seconds": train_busy,
        "cumulative/seconds": gen_busy + train_busy,
    }
    by_tokens = {
        name.replace("/", "_by_ktokens/", 1): v
        for name, v in at_step.items()
        if name.startswith(("async/", "replay/"))
    }
    tracker.log_groups(
        run_id,
        [[g, at_step], [record.cumulative_generated_tokens // 1000, by_tokens]],
        timestamp_ms=int(time.time() * 1000),
        engine=metric_schema.ASYNC,
    )


def _logged_versions(tracker, run_id: str, cfg: RunConfig) -> set[int]:
    return {int(m.step) for m in tracker.client.get_metric_history(run_id, "eval/pass1")}


def _log_evals(cfg, paths, tracker, run_id, logged: set[int], *, up_to: int) -> list[int]:
    """Log the evaluator's results of due versions up to `up_to` not logged yet."""
    done = []
    for v in eval_due_versions(cfg, up_to=up_to):
        if v in logged:
            continue
        found = board.read_eval(paths, v)
        if found is None:
            continue
        r, k = found["result"], found["k"]
        kt = int(found["cumulative_generated_tokens"]) // 1000
        at_step = metric_schema.eval_metrics(r, k=k, prefix="eval/") | {
            "eval/cumulative_wall_seconds": found["cumulative_seconds"],
        }
        at_tokens = metric_schema.eval_metrics(r, k=k, prefix="eval_by_ktokens/")
        tracker.log_groups(
            run_id,
            [[v, at_step], [kt, at_tokens]],
            timestamp_ms=int(time.time() * 1000),
            engine=metric_schema.ASYNC,
        )
        logged.add(v)
        done.append(v)
    return done


def _await_evaluations(
    cfg,
    paths,
    tracker,
    run_id,
    logged: set[int],
    final_step: int,
    *,
    timeout_s: float = 3600.0,
    check=None,
) -> None:
    """After the segment's last publication: log every due evaluation up to `final_step`
    once the evaluator has written it (it stops after the last one). `check()` may raise to
    stop waiting (an evaluator that never started)."""
    deadline = time.time() + timeout_s
    due = set(eval_due_versions(cfg, up_to=final_step))
    while True:
        children.beat()
        if check is not None:
            check()
        _log_evals(cfg, paths, tracker, run_id, logged, up_to=final_step)
        missing = [v for v in due - logged if storage.is_complete(board.weights_uri(paths, v))]
        if not missing or time.time() > deadline:
            if missing:
                log.warning("evaluations of versions %s did not arrive in time", sorted(missing))
            return
        time.sleep(POLL_S * 5)
