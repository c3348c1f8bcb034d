"""Segments that end: an asynchronous segment on Kubeflow has a deadline even when the config
gives none (the pods' timeout less a margin), and when one of its roles never starts (a
trainer pod Pending for lack of GPUs) every role that did start stops within
`asynchronous.peer_start_timeout_s` with one error line, so the run ends and its exit task
releases the lineage.

The roles are the Kubeflow task bodies (`async_runtime.async_role`) on a tiny config, each in
a process of its own as each would be in its pod; the trainer simply never runs. Nothing is
mocked."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from test_kfp_async import tiny_async

from replayrl import storage
from replayrl.config import load_config
from replayrl.engine.asynchronous import board, peers, roles
from replayrl.kfp import async_runtime, runtime
from replayrl.storage import lease

pytestmark = pytest.mark.pipeline

TIMEOUT_S = 3.0
# What a role may take past the limit: its check interval (a tenth of the limit) and the
# unit of work it is in when the limit passes (its start-up and first batch or evaluation of
# the tiny model), on a loaded 2-core machine. Without the limit they would wait 1800 s.
SLACK_S = 60.0
# The tiny config, the limit, and a worker that waits after its first batch of 128 rows.
ROLE_CONFIG = (f"asynchronous.peer_start_timeout_s={TIMEOUT_S}", "asynchronous.max_unused_rows=64")


# A role task's body as its pod runs it: its error becomes one line on stderr, exit code 1.
# Timed from after the imports (tens of seconds on a loaded machine), as the role is.
ROLE_POD = """
import sys, time
from replayrl.kfp import async_runtime, runtime
from replayrl.engine.asynchronous import roles, trainer
config, owner, role, index, segment_id = sys.argv[1:]
start = time.monotonic()
try:
    with runtime.user_errors_as_exit():
        async_runtime.async_role(
            config=open(config).read(), owner=owner, role=role, index=int(index),
            segment_id=segment_id,
        )
finally:
    print(f"ran {time.monotonic() - start:.2f} s")
"""


def _run_roles(tmp_path, config: str, owner: str, segment_id: str, roles):
    """Run `roles` side by side, each in a process of its own as each would in its pod:
    {(role, index): (exit code, the last stderr line, seconds its body ran)}."""
    path = tmp_path / "config.yaml"
    path.write_text(config)
    procs = {
        (role, index): subprocess.Popen(
            [sys.executable, "-c", ROLE_POD, str(path), owner, role, str(index), segment_id],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role, index in roles
    }
    ended = {}
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            lines = err.strip().splitlines()
            seconds = float(out.strip().splitlines()[-1].split()[1])
            ended[key] = (proc.returncode, lines[-1] if lines else "", seconds)
            print(f"{key}: exit {proc.returncode} after {seconds:.1f} s")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return ended


def _one_error_line(code: int, line: str, role: str) -> str:
    assert code == 1, f"the {role} ended with exit code {code}: {line}"
    assert line.startswith("replayrl: error: Segment "), line
    assert f"this {role} stops. Nothing committed is lost" in line, line
    return line


@pytest.mark.slow
def test_every_role_ends_when_the_trainer_never_starts(tmp_path):
    config = tiny_async(tmp_path, *ROLE_CONFIG)
    cfg, segment_id = async_runtime.begin_async_segment(config=config, owner="run-a", workers=1)
    paths = storage.paths_of(cfg)

    ended = _run_roles(
        tmp_path, cfg.to_yaml(), "run-a", segment_id, [("worker", 0), ("evaluator", 0)]
    )

    for (role, index), (code, line, seconds) in ended.items():
        name = f"worker {index}" if role == "worker" else role
        line = _one_error_line(code, line, name)
        # Whichever role gave up first, both name the trainer and the knob.
        assert "the trainer had not started 3 s after" in line, line
        assert "asynchronous.peer_start_timeout_s" in line and "Pending" in line
        assert TIMEOUT_S <= seconds <= TIMEOUT_S + SLACK_S, (role, seconds)
    # What the worker committed before it stopped (if it got that far) is in the buffer, once.
    worker, buf = board.read_worker(paths, 0), roles.buffer_of(paths)
    rows = [] if buf.version() is None else buf.read(columns=["rollout_id"])["rollout_id"]
    assert len(rows) == len(set(rows)) == worker.rows_appended

    # The trainer's pod is scheduled at last: it stops at once, before loading a model.
    (code, line, seconds), *_ = _run_roles(
        tmp_path, cfg.to_yaml(), "run-a", segment_id, [("trainer", 0)]
    ).values()
    line = _one_error_line(code, line, "trainer")
    assert "was given up (" in line and "the trainer had not started" in line, line
    assert seconds < SLACK_S
    assert not storage.exists(storage.join(board.root(paths), "trainer.json")), "no step"
    assert board.latest(paths).version == 0

    # The exit task still runs and frees the lineage for the next run.
    said = runtime.release_run(
        config=cfg.to_yaml(), run_root="", owner="run-a", arms=[""], lineages=[""]
    )
    assert said == [f"released the lease of {paths.root}"]
    assert lease.read(paths) is None


@pytest.mark.slow
def test_the_trainer_ends_when_no_worker_or_evaluator_starts(tmp_path):
    config = tiny_async(tmp_path, *ROLE_CONFIG)
    cfg, segment_id = async_runtime.begin_async_segment(config=config, owner="run-b", workers=1)
    paths = storage.paths_of(cfg)

    (code, line, seconds), *_ = _run_roles(
        tmp_path, cfg.to_yaml(), "run-b", segment_id, [("trainer", 0)]
    ).values()

    line = _one_error_line(code, line, "trainer")
    assert "the evaluator, worker 0 had not started 3 s after the trainer did" in line, line
    assert TIMEOUT_S <= seconds <= TIMEOUT_S + SLACK_S
    assert board.read_trainer(paths).gradient_step == 0
    assert peers.abandoned_reason(paths, segment_id).startswith("the trainer gave it up")


def test_peers_give_the_segment_up_once_and_late_roles_stop_at_once(tmp_path):
    """The rule on a hand-written board, no model: a role waits for its peers' start records
    up to the limit, the first to give up records why, and every role then stops with it."""
    cfg = load_config(
        text=tiny_async(tmp_path, "asynchronous.workers=2", "asynchronous.peer_start_timeout_s=1")
    )
    paths = storage.paths_of(cfg)
    board.write_segment(paths, board.Segment(id="s1", first_step=0, end_step=8, started_at=0.0))
    trainer = peers.Peers(cfg, paths, segment_id="s1", role="trainer").start()
    worker0 = peers.Peers(cfg, paths, segment_id="s1", role="worker0").start()
    peers.mark_started(paths, "s0", "evaluator")  # an older segment's record counts for nothing
    time.sleep(0.2)  # past the check interval (a tenth of the limit)
    trainer.check()  # within the limit: fine
    assert trainer.missing == ["evaluator", "worker1"]
    peers.mark_started(paths, "s1", "evaluator")
    time.sleep(1.1)
    with pytest.raises(peers.PeersMissing) as e:
        trainer.check()
    assert str(e.value) == (
        "Segment s1 was given up (the trainer gave it up: worker 1 had not started 1 s after "
        "the trainer did (asynchronous.peer_start_timeout_s); on Kubeflow its pod is likely "
        "Pending: no free accelerator, a quota, or a node selector or tolerations no node "
        "matches); this trainer stops. Nothing committed is lost; the next run begins a new "
        "segment."
    )
    with pytest.raises(peers.PeersMissing, match="the trainer gave it up: worker 1"):
        worker0.check()  # it saw the others start, and still stops with the first reason
    assert peers.abandon(paths, "s1", by="worker0", reason="other").startswith("the trainer")
    with pytest.raises(peers.PeersMissing, match="this worker 1 stops") as late:
        peers.Peers(cfg, paths, segment_id="s1", role="worker1").start()
    # A role that finds the record names it.
    assert f"recorded in {peers.abandoned_uri(paths)}, which holds only this segment" in str(
        late.value
    )
    # The next segment starts clean, and records its own give-up over the old one.
    peers.Peers(cfg, paths, segment_id="s2", role="trainer").start()
    assert peers.abandoned_reason(paths, "s2") is None
    peers.abandon(paths, "s2", by="evaluator", reason="r")
    assert peers.abandoned_reason(paths, "s2") == "the evaluator gave it up: r"
    assert peers.abandoned_reason(paths, "s1") is None


def test_a_kubeflow_segment_has_a_deadline_from_the_pod_timeout(tmp_path):
    def allowed(*overrides: str) -> float | None:
        return async_runtime.segment_seconds_allowed(
            load_config(text=tiny_async(tmp_path, *overrides))
        )

    # 6 h pods (the default): 10% for the last checkpoint and evaluation.
    assert allowed() == 6 * 3600 - 2160
    assert allowed("kubernetes.gpu_step_timeout_s=3600") == 3000  # at least 600 s
    assert allowed("kubernetes.gpu_step_timeout_s=600") == 300  # at most half
    assert allowed("kubernetes.gpu_step_timeout_s=0") is None  # no pod timeout, no limit

    # segment_seconds and segment_steps null: the begin task still writes a deadline.
    base = tiny_async(tmp_path, "kubernetes.gpu_step_timeout_s=3600")
    before = time.time()
    cfg, _ = async_runtime.begin_async_segment(config=base, owner="run-c", workers=1)
    paths = storage.paths_of(cfg)
    assert cfg.asynchronous.segment_seconds is None and cfg.asynchronous.segment_steps is None
    deadline = board.read_segment(paths).deadline
    assert before + 3000 <= deadline <= time.time() + 3000
    # A shorter segment_seconds wins; a longer one is cut to what the pods allow.
    for seconds, expected in ((100, 100), (10_000, 3000)):
        before = time.time()
        cfg, _ = async_runtime.begin_async_segment(
            config=base.replace("segment_seconds: null", f"segment_seconds: {seconds}"),
            owner="run-c",
            workers=1,
        )
        assert cfg.asynchronous.segment_seconds == seconds
        deadline = board.read_segment(paths).deadline
        assert before + expected <= deadline <= time.time() + expected
