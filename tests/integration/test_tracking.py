"""A lineage's MLflow run on a shared tracking server (the real `mlflow server` fixture):
found by run root, lineage and config hash, so a lineage named like one in another run root
gets a run of its own, and an opener that loses the creation of a lineage drops its run."""

from __future__ import annotations

import urllib.request
import uuid
from pathlib import Path

import pytest
import tiny_config
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from replayrl import storage
from replayrl.engine.inline import run_inline
from replayrl.engine.lineage import open_lineage
from replayrl.engine.tracking import Tracker, experiment_of_run, ui_link
from replayrl.errors import ReplayRLError
from replayrl.storage import LineageState

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


def alpha(tmp_path: Path, root: str, uri: str, experiment: str):
    """A one-iteration tiny lineage named 'alpha' under `tmp_path/root`, tracked on `uri`."""
    return tiny_config.config(
        tmp_path / root,
        "storage.lineage=alpha",
        f"tracking.uri={uri}",
        f"tracking.experiment={experiment}",
        "iterations=1",
        "eval.num_prompts=8",
        "train.steps_per_iteration=2",
    )


def steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_same_named_lineages_in_two_run_roots_never_share_a_run(tmp_path, mlflow_server):
    experiment = f"exp-{uuid.uuid4().hex[:8]}"
    a = alpha(tmp_path, "a", mlflow_server.uri, experiment)
    b = alpha(tmp_path, "b", mlflow_server.uri, experiment)
    assert a.lineage == b.lineage and a.config_hash() == b.config_hash()
    ra, rb = run_inline(a).mlflow_run_id, run_inline(b).mlflow_run_id
    assert ra != rb
    client = MlflowClient(mlflow_server.uri)
    for cfg, run_id in ((a, ra), (b, rb)):
        # each logged its own v0 evaluation and its own iteration, once
        # (MLflow steps are gradient steps: the one iteration of S = 2 ends on step 2)
        assert steps(client, run_id, "iteration") == [0, 2]
        assert steps(client, run_id, "eval/pass1") == [0, 2]
        assert steps(client, run_id, "train/loss") == [2]
        tags = client.get_run(run_id).data.tags
        assert tags["run_root"] == storage.normalize_root(cfg.storage.run_root)
        assert tags["lineage"] == "alpha" and tags["config_hash"] == cfg.config_hash()


def test_find_run_matches_run_root_lineage_and_config_exactly(mlflow_server):
    tracker = Tracker(mlflow_server.uri, f"exp-{uuid.uuid4().hex[:8]}")
    # MLflow's filter cannot quote a value holding both quote characters: compared here
    odd = '/runs/it\'s "odd"'
    ids = {
        key: tracker.start(
            run_root=key[0], lineage=key[1], config_hash=key[2], tags={}, params={"seed": 0}
        )
        for key in [("/runs/a", "alpha", "h1"), ("/runs/b", "alpha", "h1"), (odd, "alpha", "h1")]
        + [("/runs/a", "alpha", "h2"), ("/runs/a", "alpha2", "h1")]
    }
    assert len(set(ids.values())) == 5
    for (root, lineage, h), run_id in ids.items():
        assert tracker.find_run(run_root=root, lineage=lineage, config_hash=h) == run_id
        # an opening that died before its state was written finds its run again
        assert tracker.start(run_root=root, lineage=lineage, config_hash=h, tags={}, params={}) == (
            run_id
        )
    assert tracker.find_run(run_root="/runs/c", lineage="alpha", config_hash="h1") is None
    assert tracker.find_run(run_root="/runs/it's", lineage="alpha", config_hash="h1") is None


def test_an_opener_that_loses_the_creation_drops_its_run(tmp_path, mlflow_server):
    """Another opener writes the lineage's state.json first (here, from `hold`, the moment
    before this one writes anything): this opener fails and deletes the run it created."""
    cfg = alpha(tmp_path, "a", mlflow_server.uri, f"exp-{uuid.uuid4().hex[:8]}")
    client = MlflowClient(mlflow_server.uri)
    tracker = Tracker(mlflow_server.uri, cfg.tracking.experiment)
    winner_run = client.create_run(tracker.experiment_id, run_name="winner").info.run_id
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    winner = LineageState(
        lineage=cfg.lineage,
        arm=cfg.arm,
        seed=cfg.seed,
        config_hash=cfg.config_hash(),
        next_iteration=1,
        policy_version=0,
        mlflow_run_id=winner_run,
        tracking_uri=mlflow_server.uri,
        ledger={},
    )

    def hold() -> None:
        storage.advance_state(paths, winner, expected_next_iteration=None)

    with pytest.raises(ReplayRLError, match="changed underneath"):
        open_lineage(cfg, hold=hold, evaluate_initial=False)
    root = storage.normalize_root(cfg.storage.run_root)
    identity = {"run_root": root, "lineage": cfg.lineage, "config_hash": cfg.config_hash()}
    assert tracker.find_run(**identity) is None
    (dropped,) = [
        r
        for r in client.search_runs([tracker.experiment_id], run_view_type=ViewType.ALL)
        if r.data.tags.get("run_root") == root
    ]
    assert dropped.info.lifecycle_stage == "deleted"
    assert client.get_run(winner_run).info.lifecycle_stage == "active"
    assert storage.read_state(paths).mlflow_run_id == winner_run


def test_experiments_open_on_their_runs_in_the_mlflow_ui(mlflow_server):
    """MLflow 3's UI opens an experiment on the page of its kind (`mlflow.experimentKind`);
    replayrl's are model training, so users land on the runs and their charts, not on an
    empty traces page. An experiment made without the tag gets it when a lineage uses it."""
    client = MlflowClient(mlflow_server.uri)
    created = f"kind-{uuid.uuid4().hex[:8]}"
    tracker = Tracker(mlflow_server.uri, created)
    tags = client.get_experiment(tracker.experiment_id).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    by_hand = f"kind-{uuid.uuid4().hex[:8]}"
    experiment_id = client.create_experiment(by_hand)
    assert "mlflow.experimentKind" not in client.get_experiment(experiment_id).tags
    Tracker(mlflow_server.uri, by_hand)
    assert client.get_experiment(experiment_id).tags["mlflow.experimentKind"] == (
        "custom_model_development"
    )


def test_printed_links_open_the_runs_not_the_traces(mlflow_server):
    """`replayrl run`, `compare` and `experiment` print these links; the experiment's carries
    `workflowType=machine_learning`, which MLflow 3's UI needs to open on the runs."""
    tracker = Tracker(mlflow_server.uri, f"links-{uuid.uuid4().hex[:8]}")
    run_id = tracker.client.create_run(tracker.experiment_id).info.run_id
    exp = tracker.experiment_id
    assert experiment_of_run(mlflow_server.uri, run_id) == exp
    assert ui_link(mlflow_server.uri, exp) == (
        f"{mlflow_server.uri}/#/experiments/{exp}?workflowType=machine_learning"
    )
    assert ui_link(mlflow_server.uri + "/", exp, run_id) == (
        f"{mlflow_server.uri}/#/experiments/{exp}/runs/{run_id}"
    )
    # The UI is what the link's base serves.
    with urllib.request.urlopen(mlflow_server.uri + "/", timeout=30) as page:
        assert page.status == 200 and b"<html" in page.read().lower()
    # Credentials never reach the printed link; a local store is served by `mlflow ui`.
    assert ui_link("https://user:secret@mlflow.example.com", "7") == (
        "https://mlflow.example.com/#/experiments/7?workflowType=machine_learning"
    )
    assert ui_link("sqlite:////tmp/runs/mlflow.db", "1").startswith("http://127.0.0.1:5000/#/")
