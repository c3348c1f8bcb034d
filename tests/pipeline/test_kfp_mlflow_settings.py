"""Our MLflow settings win over what KFP 2.17's MLflow plugin injects into a step's pod
(`MLFLOW_TRACKING_URI` of its own server, its nested run's `MLFLOW_RUN_ID` and
`MLFLOW_EXPERIMENT_ID`), and every component says in its log which URI it uses, without
credentials."""

from __future__ import annotations

from dataclasses import replace

import pytest

from replayrl.config import RunConfig
from replayrl.engine.stores import tracking_uri
from replayrl.kfp import runtime, tracking_env

pytestmark = pytest.mark.pipeline
OURS = "https://alice:s3cr3t-pa55word@mlflow.example.com:5000"
PLUGIN = {
    "MLFLOW_TRACKING_URI": "https://kfp-mlflow.kubeflow.svc:8080",
    "MLFLOW_RUN_ID": "0f1e2d3c4b5a",
    "MLFLOW_EXPERIMENT_ID": "17",
    "MLFLOW_TRACKING_TOKEN": "plugin-token-not-ours",
}


def config(uri: str | None) -> RunConfig:
    cfg = RunConfig()
    return replace(
        cfg,
        tracking=replace(cfg.tracking, uri=uri),
        storage=replace(cfg.storage, run_root="s3://bucket/runs"),
    )


def test_the_config_uri_wins_over_the_plugins_in_a_pod():
    environ = dict(PLUGIN)
    line = tracking_env.settle(config(OURS), environ, in_pod=True)
    # the pod's environment now names our store, and not the plugin's run
    assert environ["MLFLOW_TRACKING_URI"] == OURS
    assert "MLFLOW_RUN_ID" not in environ and "MLFLOW_EXPERIMENT_ID" not in environ
    assert line == (
        "MLflow tracking URI: https://mlflow.example.com:5000 (from tracking.uri); "
        "$MLFLOW_TRACKING_URI (https://kfp-mlflow.kubeflow.svc:8080, e.g. set by KFP's MLflow "
        "plugin) is not used; ignored MLFLOW_RUN_ID, MLFLOW_EXPERIMENT_ID from the environment"
    )
    assert "s3cr3t" not in line


def test_without_a_config_uri_the_environment_decides_and_says_so():
    environ = {"MLFLOW_TRACKING_URI": "http://bob:hunter2-hunter2@mlflow.team:5000"}
    line = tracking_env.settle(config(None), environ, in_pod=True)
    assert line == "MLflow tracking URI: http://mlflow.team:5000 (from $MLFLOW_TRACKING_URI)"
    assert environ == {"MLFLOW_TRACKING_URI": "http://bob:hunter2-hunter2@mlflow.team:5000"}
    line = tracking_env.settle(config(None), {}, in_pod=True)
    assert line.startswith("MLflow tracking: the run root's own store")


def test_outside_a_pod_the_environment_is_left_alone():
    environ = dict(PLUGIN)
    line = tracking_env.settle(config(OURS), environ, in_pod=False)
    assert environ == PLUGIN
    assert line.startswith("MLflow tracking URI: https://mlflow.example.com:5000 (from tracking")


def test_every_component_prints_the_uri_it_uses_and_the_tracker_takes_it(monkeypatch, capsys):
    """`check_run_root` is what every component calls once its config is loaded."""
    for key, value in PLUGIN.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(runtime.POD_ENV, "replay-iteration-abc12-run-iterations")
    cfg = config(OURS)
    runtime.check_run_root(cfg)
    out = capsys.readouterr().out
    assert "MLflow tracking URI: https://mlflow.example.com:5000 (from tracking.uri)" in out
    assert "s3cr3t" not in out
    import os

    assert os.environ["MLFLOW_TRACKING_URI"] == OURS
    assert "MLFLOW_RUN_ID" not in os.environ
    # the engines' choice of store agrees, with or without the config's URI
    assert tracking_uri(cfg) == OURS
    assert tracking_uri(config(None)) == OURS


@pytest.mark.slow  # opens a lineage: the tiny model's warm start, v0 published
def test_a_lineage_opened_by_its_component_logs_to_the_configs_store(tmp_path, monkeypatch, capsys):
    """The whole path, with real MLflow stores: the environment names another store (as the
    plugin would), the config names ours; the lineage's run is in ours, and the other store
    is never created."""
    from kfp_helpers import small

    from replayrl import storage
    from replayrl.kfp.components import open_lineage

    theirs = tmp_path / "plugin.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{theirs}")
    monkeypatch.setenv("MLFLOW_RUN_ID", "0f1e2d3c4b5a")
    ours = f"sqlite:///{tmp_path / 'ours.db'}"
    cfg = small(tmp_path, "iterations=1", f"tracking.uri={ours}")
    open_lineage.python_func(
        config=cfg.to_yaml(), arm="", lineage="", run_root="", owner="run-a", required_iterations=1
    )
    assert f"MLflow tracking URI: {ours} (from tracking.uri)" in capsys.readouterr().out
    state = storage.read_state(storage.paths_of(cfg))
    assert state.tracking_uri == ours
    from replayrl.engine.tracking import Tracker

    run = Tracker(ours, cfg.tracking.experiment).client.get_run(state.mlflow_run_id)
    assert run.data.tags["lineage"] == cfg.lineage
    assert not theirs.exists()
