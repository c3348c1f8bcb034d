"""The lineage's MLflow store gone, moved or locked, through the real CLI
(`python -m replayrl.cli.main run`), each lineage tracked in the default store (a sqlite file
in its run root):

- `mlflow.db` deleted under a lineage: extending it logs to a new MLflow run of the lineage
  (tagged with the run it replaces), with what the lineage keeps (its params and config, v0's
  evaluation, its last committed iteration, its checkpoint); nothing of the lineage changes
  but its run id;
- the run root moved (`mv A B`): extending it from B logs to the same run in B's store, its
  artifact paths follow the root, and nothing is created under A;
- the store locked longer than sqlite's busy timeout (20 s, MLflow's): a lock that clears
  within the retry bound ($REPLAYRL_TRACKING_RETRY_S) costs a wait; one that does not stops
  the run with one line, and a rerun logs every step once.

The store choice (moved, copied, gone, configured), the rewrite of a moved store's paths and
the retry bound are also tested alone, without a run (the last three tests, seconds).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tiny_config
from mlflow.tracking import MlflowClient

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import load_config
from replayrl.engine import stores, tracking
from replayrl.engine.stores import lineage_store
from replayrl.engine.tracking import Tracker, TrackingUnavailable
from replayrl.errors import ReplayRLError

pytestmark = pytest.mark.integration
S = 2  # train.steps_per_iteration: iteration t is MLflow step t·S
BUSY_TIMEOUT_S = 20  # MLflow's sqlite busy timeout (PRAGMA busy_timeout = 20000)


def run(root: Path, iterations: int, *, env: dict | None = None) -> subprocess.CompletedProcess:
    """`replayrl run` of lineage 'a' under `root`, tracked in the default store."""
    sets = tiny_config.overrides(
        root,
        f"iterations={iterations}",
        "eval.num_prompts=8",
        f"train.steps_per_iteration={S}",
        "buffer.capacity=256",  # nothing evicted: every iteration's rows stay
    )
    args = ["run", "--config", str(tiny_config.PRESET), "--lineage", "a"]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "replayrl.cli.main",
            *args,
            *[a for s in sets for a in ("--set", s)],
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("replayrl: error:")]


def ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and not error_lines(p.stderr), p.stderr[-3000:]


def kept(root: Path) -> dict:
    """What the lineage keeps besides its MLflow run: state (less the run), rows, checkpoints."""
    paths = storage.lineage_paths(str(root), "a")
    state = json.loads(Path(paths.state).read_text())
    for key in ("mlflow_run_id", "tracking_uri"):
        state.pop(key)
    rows = []  # a run stopped before its first iteration has no buffer yet
    if Path(paths.buffer, "rollouts").exists():
        rows = ReplayBuffer(paths.buffer).read(columns=["rollout_id", "iteration", "reward"])
        rows = rows.to_pylist()
    checkpoints = {
        v: hashlib.sha256(
            Path(
                storage.checkpoint_files_uri(paths.checkpoint(v)), "model.safetensors"
            ).read_bytes()
        ).hexdigest()
        for v in storage.complete_versions(paths)
    }
    return {
        "state": state,
        "rows": sorted(rows, key=lambda r: r["rollout_id"]),
        "checkpoints": checkpoints,
    }


def rows_of(k: dict, iterations: set[int]) -> list:
    return [r for r in k["rows"] if r["iteration"] in iterations]


def state_of(root: Path):
    return storage.read_state(storage.lineage_paths(str(root), "a"))


def steps(uri: str, run_id: str, key: str = "iteration") -> list[int]:
    """The steps metric `key` of run `run_id` is logged at, read from the sqlite file itself
    (MLflow's client keeps a store open per URI, which would still read a deleted file)."""
    con = sqlite3.connect(uri.removeprefix("sqlite:///"))
    try:
        found = con.execute(
            "SELECT step FROM metrics WHERE run_uuid = ? AND key = ?", (run_id, key)
        ).fetchall()
    finally:
        con.close()
    return sorted(step for (step,) in found)


@pytest.mark.slow
def test_a_deleted_store_gets_a_new_run_with_what_the_lineage_keeps(tmp_path):
    root = tmp_path / "A"
    ok(run(root, 2))
    before, old = kept(root), state_of(root)
    uri = f"sqlite:///{root}/mlflow.db"
    assert old.tracking_uri == uri and steps(uri, old.mlflow_run_id) == [0, S, 2 * S]
    (root / "mlflow.db").unlink()

    extended = run(root, 3)
    ok(extended)
    assert f"MLflow run {old.mlflow_run_id} of lineage 'a' is not in" in extended.stderr
    now = state_of(root)
    assert now.tracking_uri == uri and now.mlflow_run_id != old.mlflow_run_id
    after = kept(root)
    # Nothing the lineage keeps was lost: iterations 1-2's rows and checkpoints are as they
    # were, and iteration 3 went on from them.
    assert rows_of(after, {1, 2}) == rows_of(before, {1, 2}) and rows_of(after, {3})
    assert {v: d for v, d in after["checkpoints"].items() if v <= 2} == before["checkpoints"]
    assert after["state"]["next_iteration"] == 4
    # The new run: v0 evaluated again, iteration 2 (the last committed one, from state.json)
    # and 3, each once; iteration 1's metrics were only in the deleted store.
    client = MlflowClient(uri)
    new = client.get_run(now.mlflow_run_id)
    assert new.data.tags["replayrl.replaces_run"] == old.mlflow_run_id
    assert new.data.tags["replayrl.history_from_iteration"] == "2"
    assert new.data.tags["run_root"] == str(root) and new.data.tags["lineage"] == "a"
    assert new.data.params["iterations"] == "3" and new.info.status == "FINISHED"
    assert steps(uri, now.mlflow_run_id) == [0, 2 * S, 3 * S]
    assert steps(uri, now.mlflow_run_id, "eval/pass1") == [0, 2 * S, 3 * S]
    assert steps(uri, now.mlflow_run_id, "train/loss") == [2 * S, 3 * S]
    models = client.search_logged_models([new.info.experiment_id])
    assert sorted(m.name for m in models) == ["a-v000002", "a-v000003"]

    # Resuming again finds the new run: nothing is replaced or logged twice.
    again = run(root, 3)
    ok(again)
    assert state_of(root).mlflow_run_id == now.mlflow_run_id
    assert steps(uri, now.mlflow_run_id) == [0, 2 * S, 3 * S]


@pytest.mark.slow
def test_a_moved_run_root_logs_to_its_store_and_writes_nothing_at_the_old_path(tmp_path):
    a, b = tmp_path / "A", tmp_path / "B"
    ok(run(a, 2))
    old = state_of(a)
    a.rename(b)
    before = kept(b)

    extended = run(b, 3)
    ok(extended)
    assert not a.exists(), "the old run root was recreated"
    now = state_of(b)
    uri = f"sqlite:///{b}/mlflow.db"
    assert now.mlflow_run_id == old.mlflow_run_id and now.tracking_uri == uri
    after = kept(b)
    assert rows_of(after, {1, 2}) == rows_of(before, {1, 2}) and rows_of(after, {3})
    assert {v: d for v, d in after["checkpoints"].items() if v <= 2} == before["checkpoints"]
    # One run holds every step, once; its artifacts (the new checkpoint's model) are in B.
    assert steps(uri, now.mlflow_run_id) == [0, S, 2 * S, 3 * S]
    client = MlflowClient(uri)
    run_ = client.get_run(now.mlflow_run_id)
    assert run_.info.artifact_uri.startswith(f"file://{b}/") and run_.data.tags["run_root"] == str(
        b
    )
    models = client.search_logged_models([run_.info.experiment_id])
    assert sorted(m.name for m in models) == ["a-v000000", "a-v000002", "a-v000003"]
    assert all(m.artifact_location.startswith(f"file://{b}/mlartifacts/") for m in models)
    assert (b / "mlartifacts" / "models").is_dir()


class Lock:
    """An exclusive lock on a sqlite store, held from another thread (its own connection,
    as another process's would be) from the moment the lineage's state.json exists (the
    lineage is open and step 0 logged) for `hold_s` seconds, or until `release()`."""

    def __init__(self, db: Path, state: Path, *, hold_s: float | None):
        self.db, self.state, self.hold_s = db, state, hold_s
        self.taken = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._hold, daemon=True)
        self.thread.start()

    def _hold(self) -> None:
        deadline = time.monotonic() + 300
        while not self.state.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        con = sqlite3.connect(self.db, timeout=120, isolation_level=None)
        try:
            con.execute("BEGIN EXCLUSIVE")
            self.taken.set()
            self.done.wait(self.hold_s)
            con.execute("ROLLBACK")
        finally:
            con.close()

    def release(self) -> None:
        self.done.set()
        self.thread.join(60)


@pytest.mark.slow
def test_a_store_locked_past_the_busy_timeout_but_within_the_bound_costs_a_wait(tmp_path):
    root = tmp_path / "runs"
    lock = Lock(root / "mlflow.db", root / "a" / "state.json", hold_s=BUSY_TIMEOUT_S + 8)
    p = run(root, 3)
    lock.release()
    assert lock.taken.is_set()
    ok(p)
    assert "is busy" in p.stderr  # the retry is said
    state = state_of(root)
    assert state.next_iteration == 4
    assert steps(state.tracking_uri, state.mlflow_run_id) == [0, S, 2 * S, 3 * S]
    assert steps(state.tracking_uri, state.mlflow_run_id, "train/loss") == [S, 2 * S, 3 * S]


@pytest.mark.slow
def test_a_store_locked_past_the_bound_stops_with_one_line_and_a_rerun_logs_every_step(tmp_path):
    root = tmp_path / "runs"
    lock = Lock(root / "mlflow.db", root / "a" / "state.json", hold_s=None)
    p = run(root, 2, env={"REPLAYRL_TRACKING_RETRY_S": "0"})
    lock.release()
    assert lock.taken.is_set()
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    (line,) = error_lines(p.stderr)
    assert f"sqlite:///{root}/mlflow.db" in line and "locked" in line
    assert "REPLAYRL_TRACKING_RETRY_S" in line and "rerun the same command" in line
    before = kept(root)  # what the stopped run committed

    again = run(root, 2)
    ok(again)
    after = kept(root)
    committed = set(range(1, before["state"]["next_iteration"]))
    assert rows_of(after, committed) == rows_of(before, committed)
    state = state_of(root)
    assert state.next_iteration == 3
    assert steps(state.tracking_uri, state.mlflow_run_id) == [0, S, 2 * S]
    assert steps(state.tracking_uri, state.mlflow_run_id, "train/loss") == [S, 2 * S]
    models = MlflowClient(state.tracking_uri).search_logged_models(
        [MlflowClient(state.tracking_uri).get_run(state.mlflow_run_id).info.experiment_id]
    )
    assert sorted(m.name for m in models) == ["a-v000000", "a-v000002"]


# ---------------------------------------------------------------- the pieces, without a run


def _cfg(root: Path, *extra: str):
    return load_config(tiny_config.PRESET, overrides=[f"storage.run_root={root}", *extra])


def _store(path: Path) -> tuple[str, str]:
    """A sqlite store at `path` holding one run: (its URI, the run id)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(f"sqlite:///{path}", "replayrl")
    return tracker.uri, tracker.client.create_run(tracker.experiment_id).info.run_id


def test_which_store_a_resumed_lineage_logs_to(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    a, b = tmp_path / "A", tmp_path / "B"
    recorded, run_id = _store(a / "mlflow.db")
    default_b = f"sqlite:///{b}/mlflow.db"
    # not moved: the recorded store
    assert lineage_store(_cfg(a), recorded, run_id) == (recorded, None)
    # moved, the old root gone: B's store (and nothing is created at A)
    a.rename(b)
    assert lineage_store(_cfg(b), recorded, run_id) == (default_b, str(a))
    assert not a.exists()
    # copied (A and B both hold the run): B's own copy
    shutil.copytree(b, a)
    assert lineage_store(_cfg(b), recorded, run_id) == (default_b, str(a))
    # B's store does not hold the run (another root's store): the recorded one, still there
    _store(tmp_path / "C" / "mlflow.db")
    assert lineage_store(_cfg(tmp_path / "C"), recorded, run_id) == (recorded, None)
    # the recorded store is gone: the configured one, else the run root's own default
    shutil.rmtree(a)
    assert lineage_store(_cfg(tmp_path / "D"), recorded, run_id) == (
        f"sqlite:///{tmp_path / 'D'}/mlflow.db",
        None,
    )
    elsewhere = f"sqlite:///{tmp_path}/elsewhere.db"
    assert lineage_store(_cfg(tmp_path / "D", f"tracking.uri={elsewhere}"), recorded, run_id) == (
        elsewhere,
        None,
    )
    # configured as recorded: the user's word, even for a store that is gone
    assert lineage_store(_cfg(tmp_path / "D", f"tracking.uri={recorded}"), recorded, run_id) == (
        recorded,
        None,
    )
    # a tracking server: as recorded
    assert lineage_store(_cfg(b), "http://mlflow:5000", run_id) == ("http://mlflow:5000", None)
    assert not a.exists() and not (tmp_path / "D").exists()


def test_a_moved_store_names_the_new_root(tmp_path):
    a, b = tmp_path / "A", tmp_path / "B2"
    artifacts = f"file://{a}/mlartifacts"
    tracker = Tracker(f"sqlite:///{a}/mlflow.db", "replayrl", artifact_location=artifacts)
    run_id = tracker.client.create_run(
        tracker.experiment_id, tags={"run_root": str(a), "other": str(a)}
    ).info.run_id
    a.rename(b)
    uri = f"sqlite:///{b}/mlflow.db"
    assert stores.follow_moved_root(uri, str(a), str(b)) > 0
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.artifact_uri.startswith(f"file://{b}/mlartifacts/")
    assert client.get_experiment(tracker.experiment_id).artifact_location == (
        f"file://{b}/mlartifacts"
    )
    assert run.data.tags["run_root"] == str(b)
    assert run.data.tags["other"] == str(a)  # only the tags that name a place of the root
    assert stores.follow_moved_root(uri, str(a), str(b)) == 0  # idempotent
    assert not a.exists()


def test_a_busy_store_is_retried_within_the_bound_then_one_line(monkeypatch):
    monkeypatch.setattr(tracking.time, "sleep", lambda s: None)
    locked = sqlite3.OperationalError("database is locked")
    calls = []

    def busy_twice():
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("wrapped") from locked
        return "done"

    assert tracking._retrying(busy_twice, "sqlite:///s.db", "log_batch") == "done"
    assert len(calls) == 3

    def always():
        raise locked

    monkeypatch.setenv("REPLAYRL_TRACKING_RETRY_S", "0")
    with pytest.raises(TrackingUnavailable) as err:
        tracking._retrying(always, "sqlite:///s.db", "log_batch")
    message = str(err.value)
    assert "sqlite:///s.db" in message and "database is locked" in message
    assert "REPLAYRL_TRACKING_RETRY_S=0" in message and "\n" not in message

    def other():
        calls.append(1)
        raise ValueError("not the store")

    calls.clear()
    with pytest.raises(ValueError):  # only a busy store is retried
        tracking._retrying(other, "sqlite:///s.db", "log_batch")
    assert len(calls) == 1
    for bad in ("nan", "inf", "-1", "soon"):
        monkeypatch.setenv("REPLAYRL_TRACKING_RETRY_S", bad)
        with pytest.raises(ReplayRLError, match="REPLAYRL_TRACKING_RETRY_S"):
            tracking._retrying(always, "sqlite:///s.db", "log_batch")


def test_a_sqlite_store_beside_an_s3_run_root_keeps_its_artifacts_beside_the_store(
    tmp_path, monkeypatch
):
    """MLflow's default artifact root for a sqlite store is ./mlruns, relative to whatever
    folder the process started in: a run with an S3 run root and a local sqlite store left
    its config and logged models in the caller's working directory (the clone, in tests)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    store = tmp_path / "store" / "mlflow.db"
    cfg = tiny_config.config("s3://some-bucket/runs", f"tracking.uri=sqlite:///{store}")
    tracker = stores.make_tracker(cfg, cfg.tracking.uri)
    experiment = MlflowClient(cfg.tracking.uri).get_experiment(tracker.experiment_id)
    assert experiment.artifact_location == f"file://{store.parent}/mlartifacts"
    run = MlflowClient(cfg.tracking.uri).create_run(tracker.experiment_id)
    MlflowClient(cfg.tracking.uri).log_text(run.info.run_id, "x", "config.yaml")
    assert list((store.parent / "mlartifacts").rglob("config.yaml"))
    assert not (cwd / "mlruns").exists()
