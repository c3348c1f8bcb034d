"""Back-pressure counts the buffer's unused rows once, over all W workers: W worker processes
(the real `worker_loop`, the tiny model, a real Delta buffer) against a stalled trainer stop
appending once the rows no step has used pass the cap, and together never append more than
cap + W x R (the bound `roles.unused_rows` states); counted per worker, each would have
appended up to cap + R by itself."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
from async_helpers import async_cfg, run_worker, start_segment

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import async_max_unused_rows
from replayrl.engine.asynchronous import board
from replayrl.engine.asynchronous.roles import unused_rows

pytestmark = pytest.mark.integration
W = 3
R = 32  # rows of one batch: 4 prompts x 8 samples


def test_the_count_adds_every_workers_appends_after_the_trainers_version():
    trainer = board.TrainerStatus(buffer_version=3, unused_rows=10)
    a = board.WorkerStatus(worker=0, recent_appends=[[2, 32], [4, 32]])
    b = board.WorkerStatus(worker=1, recent_appends=[[5, 32]])
    assert unused_rows(trainer, [a, b]) == 10 + 32 + 32  # v2 is in the trainer's count
    assert unused_rows(board.TrainerStatus(), [a, b]) == 3 * 32  # it saw no version yet


@pytest.mark.slow  # three worker processes: 25-50 s here
def test_workers_together_stop_at_the_cap_against_a_stalled_trainer(tmp_path):
    cfg = async_cfg(tmp_path / "runs", tmp_path, f"asynchronous.workers={W}")
    cap = async_max_unused_rows(cfg)
    assert cap == R
    paths, segment = start_segment(cfg, roles=["trainer", "evaluator"])
    ctx = mp.get_context("spawn")  # delta-rs is not fork-safe
    workers = [
        ctx.Process(target=run_worker, args=(cfg.to_dict(), w, segment.id)) for w in range(W)
    ]
    for p in workers:
        p.start()
    buf = ReplayBuffer(paths.buffer)
    rows, quiet_since, deadline = 0, time.time(), time.time() + 300
    try:
        # The trainer never steps: wait until the rows stop growing for a while.
        while time.time() < deadline:
            assert all(p.exitcode is None for p in workers), [p.exitcode for p in workers]
            now = buf.read(columns=["rollout_id"]).num_rows if buf.version() is not None else 0
            if now != rows:
                rows, quiet_since = now, time.time()
            elif rows > cap and time.time() - quiet_since > 3.0:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the workers never stopped appending ({rows} rows)")
    finally:
        board.write_segment(paths, board.Segment(**{**segment.__dict__, "done": True}))
        for p in workers:
            p.join(timeout=120)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in workers] == [0] * W
    statuses = board.read_workers(paths, W)
    assert sum(s.rows_appended for s in statuses) == rows
    # Every worker was held back, and all of them together stayed within the bound.
    assert all(s.idle_seconds > 0 for s in statuses), [s.idle_seconds for s in statuses]
    assert cap < rows <= cap + W * R, rows


def test_a_status_read_while_its_worker_rewrites_it_is_whole(s3_root, tmp_path):
    """Each worker now reads every worker's status while they rewrite them: on S3 a read that
    races a rewrite can come back cut (measured here: about 1 read in 6 under constant
    rewriting), which the board reads again instead of stopping the worker."""
    paths = storage.lineage_paths(s3_root, "l")
    board.write_worker(paths, board.WorkerStatus(worker=1))
    stop = threading.Event()

    def rewrite():
        n = 0
        while not stop.is_set():
            n += 1
            appends = [[v, R] for v in range(n % 9)]  # a status of changing length
            board.write_worker(paths, board.WorkerStatus(worker=1, recent_appends=appends))

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    try:
        reads, until = 0, time.time() + 3.0
        while time.time() < until:
            assert board.read_worker(paths, 1).worker == 1
            reads += 1
    finally:
        stop.set()
        writer.join(timeout=30)
    assert reads > 50
