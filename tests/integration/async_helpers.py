"""The asynchronous roles' loops run in threads of the test process (one model load at a
time: transformers' loading is not thread-safe) or in spawn processes, against a lineage the
test sets up, the test playing the roles it does not run (a stalled trainer that publishes by
hand). Nothing is mocked: the loops read and write the real board, buffer and storage."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import tiny_config

from replayrl import storage
from replayrl.engine.asynchronous import board, peers
from replayrl.engine.asynchronous.supervisor import begin_segment
from replayrl.engine.lineage import open_lineage


def async_cfg(run_root: str, tmp_path: Path, *extra: str):
    return tiny_config.config(
        run_root,
        "asynchronous.enabled=true",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        "iterations=2",  # 8 gradient steps; evaluations due at 0, 4 and 8
        "asynchronous.publish_every=2",
        "asynchronous.max_unused_rows=32",  # one batch of R = 32 rows waits at most
        *extra,
    )


def run_worker(cfg_data: dict, worker: int, segment_id: str) -> None:
    """A spawn process's entry point: worker `worker`'s loop, on one torch thread."""
    from replayrl.config import config_from_dict
    from replayrl.engine.asynchronous.roles import worker_loop

    cfg = config_from_dict(cfg_data)
    worker_loop(cfg, storage.paths_of(cfg), worker=worker, segment_id=segment_id, threads=1)


class Role(threading.Thread):
    """One role's loop in a thread of this process; its exception is kept for the test."""

    def __init__(self, target, *args, **kwargs):
        super().__init__(daemon=True)
        self.call = (target, args, kwargs)
        self.error: BaseException | None = None

    def run(self):
        target, args, kwargs = self.call
        try:
            target(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def start_segment(cfg, *, roles: list[str]):
    """A new lineage and its segment, the roles the test does not run marked started."""
    paths, _, _ = open_lineage(cfg, evaluate_initial=False)
    segment = begin_segment(cfg, paths, started_at=time.time())
    for role in roles:
        peers.mark_started(paths, segment.id, role)
    board.write_trainer(paths, board.TrainerStatus())
    return paths, segment


def publish(paths, version: int, weights: Path) -> None:
    """What the trainer does at a publication: the weights at `version`, then the pointer."""
    storage.write_checkpoint(weights, board.weights_uri(paths, version))
    board.point_to(paths, board.Published(version, time.time(), float(version), 0))


def wait_for(predicate, role: Role, *, what: str, timeout_s: float = 120.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if role.error is not None:
            raise role.error
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def end(paths, segment, role: Role) -> None:
    board.write_segment(paths, board.Segment(**{**segment.__dict__, "done": True}))
    role.join(timeout=120)
    assert not role.is_alive()
    if role.error is not None:
        raise role.error
