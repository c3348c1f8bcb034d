"""The asynchronous engine end to end on the tiny model: W workers, a trainer and an evaluator
as real spawn processes over a real Delta buffer. Async runs are not bit-reproducible, so
these tests check the guarantees that hold instead: versions only increase, every sample's
staleness is non-negative and matches the published version that generated it, no
committed row is lost or duplicated (also under SIGKILL), back-pressure engages, and a
second segment resumes from the published weights and the buffer as they are."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
import tiny_config
from metric_schema_check import assert_logs_the_declared_metrics
from mlflow.tracking import MlflowClient

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import load_config
from replayrl.engine.asynchronous import board
from replayrl.engine.asynchronous.supervisor import run_async
from replayrl.engine.metric_schema import ASYNC
from replayrl.errors import ReplayRLError
from replayrl.storage import paths_of

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


def small(tmp_path: Path, *extra: str, arm: str | None = None) -> list[str]:
    """The suite's tiny config (`tiny_config`), asynchronous."""
    return tiny_config.overrides(
        tmp_path / "runs",
        "asynchronous.enabled=true",
        "iterations=4",
        "eval.every=2",
        "rollout.prompts_per_iteration=4",  # R = 32 rows per worker batch
        "buffer.capacity=4096",  # no retention: every committed row must still be there
        "buffer.positive_bias=0.0",
        "asynchronous.publish_every=2",
        *extra,
    )


def cfg_of(tmp_path, *extra, arm=None):
    return load_config(PRESET, overrides=small(tmp_path, *extra), arm=arm)


def tables(cfg):
    buf = ReplayBuffer(paths_of(cfg).buffer)
    return buf.read(), buf.read_usage()


def history(cfg, run_id: str, key: str) -> list[tuple[int, float]]:
    uri = f"sqlite:///{storage.normalize_root(cfg.storage.run_root)}/mlflow.db"
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def assert_async_invariants(cfg, *, publish_every: int) -> None:
    """What every asynchronous lineage must satisfy, read back from storage."""
    rows, usage = tables(cfg)
    ids = rows.column("rollout_id").to_pylist()
    assert len(ids) == len(set(ids)), "a rollout is stored twice"
    version_of = dict(zip(ids, rows.column("policy_version").to_pylist(), strict=True))
    # Every use: of a stored row, at a non-negative staleness that matches the version the
    # row was generated with, which is a published one (multiples of publish_every, or 0).
    used = usage.column("rollout_id").to_pylist()
    at_use = usage.column("policy_version_at_use").to_numpy()
    of_row = usage.column("rollout_policy_version").to_numpy()
    assert set(used) <= set(ids)
    assert (at_use - of_row >= 0).all()
    assert [version_of[r] for r in used] == of_row.tolist()
    assert all(v % publish_every == 0 for v in of_row)
    # Each gradient step g used B rows with the weights of step g - 1.
    steps = usage.column("iteration").to_numpy()
    assert (at_use == steps - 1).all()
    counts = np.bincount(steps)[1:]
    assert set(counts.tolist()) == {cfg.train.batch_size}
    # Versions only increase: a worker's later batches never use older weights.
    iters = rows.column("iteration").to_numpy()
    versions = rows.column("policy_version").to_numpy()
    w = cfg.asynchronous.workers
    for worker in range(w):
        mine = (iters - 1) % w == worker
        order = np.argsort(iters[mine], kind="stable")
        assert (np.diff(versions[mine][order]) >= 0).all()


@pytest.mark.slow
def test_two_segments_keep_every_guarantee_and_log_the_paper_metrics(tmp_path):
    cfg = cfg_of(
        tmp_path,
        "asynchronous.segment_steps=8",
        "asynchronous.min_rows=64",  # the trainer's first step needs two batches
        "asynchronous.max_unused_rows=32",  # the worker pauses past one unused batch
        "tracking.system_metrics_interval_s=0.5",
    )
    paths = paths_of(cfg)
    started = time.perf_counter()
    first = run_async(cfg)
    wall = time.perf_counter() - started
    assert (first.first_step, first.final_step) == (0, 8)
    assert board.latest(paths).version == 8
    worker = board.read_worker(paths, 0)
    assert worker.idle_seconds > 0, "the worker never paused for back-pressure"
    # Publishing (4 publications and the segment's last checkpoint) is a ledger part of its
    # own, not busy time; the trainer's parts fit in the segment's wall clock.
    trainer = board.read_trainer(paths)
    assert trainer.publish_seconds > 0
    parts = trainer.busy_seconds + trainer.idle_seconds + trainer.publish_seconds
    assert parts + trainer.send_seconds < wall, (trainer, wall)
    rows_after_first = set(tables(cfg)[0].column("rollout_id").to_pylist())

    second = run_async(cfg)
    assert (second.first_step, second.final_step) == (8, 16)
    assert second.mlflow_run_id == first.mlflow_run_id
    rows, usage = tables(cfg)
    assert rows_after_first <= set(rows.column("rollout_id").to_pylist())
    # Steps 1..16 each logged once: the second segment went on from the published step 8.
    assert sorted(set(usage.column("iteration").to_pylist())) == list(range(1, 17))
    assert_async_invariants(cfg, publish_every=2)

    # Evaluations at v0, every eval.every x S = 8 steps, and the lineage's last step.
    assert [s for s, _ in history(cfg, first.mlflow_run_id, "eval/pass1")] == [0, 8, 16]
    assert [s for s, _, _ in second.evaluations] == [0, 8, 16]
    for key in (
        "async/mu",
        "async/gamma_counts",
        "async/gamma",
        "async/trainer_idle_seconds",
        "async/trainer_publish_seconds",
        "async/workers_idle_seconds",
        "replay/sample_age_mean",
        "replay/uses_per_row_mean",
        "replay/steps_since_last_use_mean",
    ):
        steps = [s for s, _ in history(cfg, first.mlflow_run_id, key)]
        assert steps and steps[-1] == 16, key
        assert history(cfg, first.mlflow_run_id, key.replace("/", "_by_ktokens/", 1)), key
    # gamma_counts = (1 + W/T) / (1 + mu by counts); the paper's gamma from busy seconds.
    mu = history(cfg, first.mlflow_run_id, "async/mu")[-1][1]
    gamma_counts = history(cfg, first.mlflow_run_id, "async/gamma_counts")[-1][1]
    assert gamma_counts == pytest.approx(2 / (1 + mu))
    mu_busy = history(cfg, first.mlflow_run_id, "async/mu_busy")[-1][1]
    gamma = history(cfg, first.mlflow_run_id, "async/gamma")[-1][1]
    assert gamma == pytest.approx(2 / (1 + mu_busy))
    ages = history(cfg, first.mlflow_run_id, "replay/sample_age_max")
    assert all(v >= 0 for _, v in ages)
    run = MlflowClient(f"sqlite:///{storage.normalize_root(cfg.storage.run_root)}/mlflow.db")
    assert run.get_run(first.mlflow_run_id).info.status == "FINISHED"  # 16 = 4 iterations x 4
    # What generated the rows, as the synchronous engines tag it (`compare` refuses to mix).
    tags = run.get_run(first.mlflow_run_id).data.tags
    assert tags["system.accelerator"].startswith("cpu") and tags["system.accelerator_count"] == "0"
    # The one metric schema: exactly what it declares for this engine, on the same step axis.
    uri = f"sqlite:///{storage.normalize_root(cfg.storage.run_root)}/mlflow.db"
    logged = assert_logs_the_declared_metrics(uri, first.mlflow_run_id, ASYNC)
    assert history(cfg, first.mlflow_run_id, "iteration")[-1] == (16, 4.0)
    # What `replayrl compare` reads, at every evaluated step, as for the inline engine.
    assert {"cumulative/seconds", "cumulative/generated_tokens"} <= logged
    assert any(name.startswith("eval/pass_at_") for name in logged)
    from replayrl.experiments.compare import read_curve, read_lineages

    curve = read_curve(tracking_uri=uri, run_id=first.mlflow_run_id)
    assert curve.iterations == (0, 2, 4) and curve.seconds[0] == 0 < curve.seconds[-1]
    assert curve.last["async/gamma"] == gamma
    # `replayrl compare` reads the experiment's lineages with the same reader.
    found = read_lineages(tracking_uri=uri, experiment=cfg.tracking.experiment)
    assert [c.lineage for c in found.curves] == [cfg.lineage]
    assert found.curves[0].pass1 == curve.pass1
    # System metrics of each role, one series per role, in the lineage's run.
    for node in ("trainer", "worker0", "evaluator"):
        assert any(name.startswith(f"system/{node}/cpu") for name in logged), (node, logged)


@pytest.mark.slow
def test_the_on_policy_queue_uses_every_row_exactly_once(tmp_path):
    # One batch is S·B = 64 rows; the worker starts the next one only once at most B = 16
    # wait unused, i.e. after the trainer's third step on the batch before. Whether the
    # trainer then waits for fresh rows depends on timing (a busy machine can generate the
    # next batch while the trainer publishes), so what is asserted is what back-pressure
    # guarantees whatever the timing: the worker paused, and no row is older at use than
    # S + publish_every - 1 steps (a worker running ahead would generate the second batch
    # with version 0, 7 steps older than its last use).
    # The demo's model, untrained.
    demo_model = ["model.hidden_size=128", "model.num_layers=4", "model.num_heads=4"]
    demo_model += ["model.num_kv_heads=2", "model.intermediate_size=256"]
    demo_model += ["model.warm_start_max_steps=0"]
    cfg = cfg_of(
        tmp_path, "iterations=2", "asynchronous.max_unused_rows=16", *demo_model, arm="on-policy"
    )
    summary = run_async(cfg)
    assert summary.final_step == 8
    paths = paths_of(cfg)
    assert board.read_worker(paths, 0).idle_seconds > 0, "the worker never paused"
    rows, usage = tables(cfg)
    used = usage.column("rollout_id").to_pylist()
    assert len(used) == 8 * cfg.train.batch_size
    assert len(set(used)) == len(used), "the queue handed a row out twice"
    # Used rows leave the buffer (the trainer deletes them); the rest were never used.
    assert not set(used) & set(rows.column("rollout_id").to_pylist())
    at_use = usage.column("policy_version_at_use").to_numpy()
    age = at_use - usage.column("rollout_policy_version").to_numpy()
    assert (age >= 0).all()
    s, publish_every = cfg.train.steps_per_iteration, cfg.asynchronous.publish_every
    assert age.max() <= s + publish_every - 1, f"the worker ran ahead: ages {sorted(set(age))}"
    # The second batch waited for the trainer: made by a policy the trainer published.
    second = usage.filter(pc.greater_equal(usage.column("policy_version_at_use"), s))
    assert min(second.column("rollout_policy_version").to_pylist()) >= s - publish_every


@pytest.mark.slow
def test_two_data_parallel_trainers_keep_every_guarantee(tmp_path):
    # T = 2: the trainer role is rank 0 of two replicas that split every batch of B rows.
    cfg = cfg_of(tmp_path, "iterations=2", "asynchronous.trainers=2")
    summary = run_async(cfg)
    assert summary.final_step == 8 and not summary.restarts
    assert_async_invariants(cfg, publish_every=2)
    assert board.latest(paths_of(cfg)).version == 8
    last = {
        key: history(cfg, summary.mlflow_run_id, f"async/{key}")[-1][1]
        for key in ("mu", "mu_busy", "gamma", "gamma_counts", "rows_generated", "row_uses")
        + ("workers_busy_seconds", "trainer_busy_seconds")
    }
    assert last["gamma_counts"] == pytest.approx((1 + 1 / 2) / (1 + last["mu"]))  # W = 1
    # Device-seconds on both sides: the trainers' are T = 2 times rank 0's busy seconds.
    per_row = last["workers_busy_seconds"] / last["rows_generated"]
    per_use = 2 * last["trainer_busy_seconds"] / last["row_uses"]
    assert last["mu_busy"] == pytest.approx(per_row / per_use, rel=1e-6)
    assert last["gamma"] == pytest.approx((1 + 1 / 2) / (1 + last["mu_busy"]))


def test_async_config_errors_are_clear(tmp_path, capsys):
    with pytest.raises(ReplayRLError, match="asynchronous.trainers"):
        cfg_of(tmp_path, "asynchronous.trainers=32")  # B = 16 rows cannot feed 32 trainers
    with pytest.raises(ReplayRLError, match="max_unused_rows"):
        cfg_of(tmp_path, "asynchronous.min_rows=512", "asynchronous.max_unused_rows=32")
    from replayrl.cli.main import main

    config = tmp_path / "async.yaml"
    config.write_text(PRESET.read_text() + "\nasynchronous: {enabled: true}\n")
    assert main(["run", "--config", str(config), "--run-root", str(tmp_path / "r")]) == 2
    assert "--engine async" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def _wait_for(predicate, *, timeout_s: float, what: str, proc: subprocess.Popen):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n{proc.stdout.read()[-3000:]}")
        found = predicate()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_sigkilled_worker_and_trainer_lose_no_committed_row(tmp_path):
    """SIGKILL the worker, then the trainer, mid-segment: the engine starts each again, the
    rows committed before each kill are all still there, and the lineage ends consistent."""
    args = small(tmp_path, "iterations=40", "eval.every=10", "asynchronous.publish_every=4")
    cli = str(Path(sys.executable).parent / "replayrl")
    cmd = [cli, "run", "--config", str(PRESET), "--engine", "async"]
    for a in args:
        cmd += ["--set", a]
    cfg = load_config(PRESET, overrides=args)
    paths = paths_of(cfg)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        w = _wait_for(
            lambda: (s := board.read_worker(paths, 0)).batches >= 3 and s,
            timeout_s=300,
            what="the worker's third batch",
            proc=proc,
        )
        before_worker_kill = set(tables(cfg)[0].column("rollout_id").to_pylist())
        os.kill(w.pid, signal.SIGKILL)
        t = _wait_for(
            lambda: (s := board.read_trainer(paths)).gradient_step >= 24 and s.pid != w.pid and s,
            timeout_s=300,
            what="24 gradient steps",
            proc=proc,
        )
        before_trainer_kill = set(tables(cfg)[0].column("rollout_id").to_pylist())
        published_before = board.latest(paths).version
        os.kill(t.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "worker0 x1" in out and "trainer0 x1" in out, out[-2000:]
    rows, usage = tables(cfg)
    final = set(rows.column("rollout_id").to_pylist())
    assert before_worker_kill <= final and before_trainer_kill <= final
    assert board.latest(paths).version == cfg.total_gradient_steps >= published_before
    assert_async_invariants(cfg, publish_every=4)
    # Steps redone after the trainer's restart replaced their usage: each step once.
    steps = usage.column("iteration").to_numpy()
    assert sorted(set(steps.tolist())) == list(range(1, cfg.total_gradient_steps + 1))
    state = json.loads(Path(paths.state).read_text())
    assert state["policy_version"] == cfg.total_gradient_steps


def test_workers_stop_when_the_trainer_is_silent_for_good(tmp_path, monkeypatch):
    """A trainer that failed for good (a Kubeflow task out of retries) must not leave the
    workers waiting for a segment that never ends."""
    from replayrl.engine.asynchronous import roles as async_roles

    cfg = cfg_of(tmp_path)
    paths = paths_of(cfg)
    board.write_segment(
        paths, board.Segment(id="s1", first_step=0, end_step=8, started_at=time.time() - 100)
    )
    async_roles.check_trainer_alive(paths, "s1")  # silent for 100 s: fine
    monkeypatch.setattr(async_roles, "TRAINER_SILENT_S", 50.0)
    with pytest.raises(ReplayRLError, match="no status for 50 s"):
        async_roles.check_trainer_alive(paths, "s1")
    board.write_trainer(paths, board.TrainerStatus())  # it wrote just now
    async_roles.check_trainer_alive(paths, "s1")


def test_the_version_pointer_never_moves_back(tmp_path):
    cfg = cfg_of(tmp_path)
    paths = paths_of(cfg)
    board.point_to(paths, board.Published(8, time.time(), 10.0, 100))
    board.point_to(paths, board.Published(8, time.time(), 11.0, 120))  # the same: a retry
    with pytest.raises(ReplayRLError, match="versions only increase"):
        board.point_to(paths, board.Published(4, time.time(), 12.0, 130))
    assert board.latest(paths).version == 8
