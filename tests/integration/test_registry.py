"""A lineage's checkpoints in MLflow, on the real `mlflow server` fixture: one logged model per
full checkpoint with its evaluation metrics, exactly once across a resume; `replayrl register`
makes a tagged, aliased model version; `load_registered` gives back the checkpoint's weights
byte for byte; and the run carries system metrics (CPU and memory series)."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest
import tiny_config
from mlflow.entities import LoggedModelStatus
from mlflow.tracking import MlflowClient

from replayrl import storage
from replayrl.cli.main import main as cli
from replayrl.engine.inline import run_inline
from replayrl.engine.models import MODEL_TYPE, REFERENCE_FILE, load_registered

pytestmark = pytest.mark.integration


def lineage(tmp_path: Path, uri: str, *extra: str):
    """A tiny lineage of 3 iterations, a full checkpoint after iterations 2 and 3 (and v0),
    evaluated at each, tracked on `uri` with a system-metrics sample every 0.2 s."""
    return tiny_config.config(
        tmp_path / "runs",
        "storage.lineage=alpha",
        f"tracking.uri={uri}",
        f"tracking.experiment=models-{uuid.uuid4().hex[:8]}",
        "tracking.system_metrics_interval_s=0.2",
        "iterations=3",
        "train.checkpoint_every=2",
        "eval.every=1",
        "eval.num_prompts=8",
        *extra,
    )


def checkpoint_models(client: MlflowClient, run_id: str) -> list:
    run = client.get_run(run_id)
    found = client.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'"
    )
    return sorted(
        (m for m in found if m.model_type == MODEL_TYPE),
        key=lambda m: int(m.tags["policy_version"]),
    )


def sha256_of(folder: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.iterdir())
        if f.is_file()
        and not storage.is_training_state(f.name)
        and not f.name.startswith(".")
        and f.name != REFERENCE_FILE
    }


def test_checkpoints_are_logged_models_registered_and_loaded_back(tmp_path, mlflow_server):
    cfg = lineage(tmp_path, mlflow_server.uri, "iterations=2")
    run_id = run_inline(cfg).mlflow_run_id
    # Resumed to iteration 3: the checkpoints logged before are not logged again.
    cfg = lineage(tmp_path, mlflow_server.uri, f"tracking.experiment={cfg.tracking.experiment}")
    assert run_inline(cfg).mlflow_run_id == run_id
    client = MlflowClient(mlflow_server.uri)
    models = checkpoint_models(client, run_id)
    assert [m.name for m in models] == ["alpha-v000000", "alpha-v000002", "alpha-v000003"]
    paths = storage.paths_of(cfg)
    s = cfg.train.steps_per_iteration
    outputs = {o.model_id: o.step for o in client.get_run(run_id).outputs.model_outputs}
    for m in models:
        v = int(m.tags["policy_version"])
        assert m.status == LoggedModelStatus.READY
        assert m.tags["checkpoint"] == paths.checkpoint(v)
        assert m.tags["lineage"] == "alpha" and m.tags["config_hash"] == cfg.config_hash()
        assert outputs[m.model_id] == v * s  # output at the checkpoint's gradient step
        pass1 = [x for x in m.metrics if x.key == "eval/pass1"]
        assert [x.step for x in pass1] == [v * s]
        (in_run,) = [x for x in client.get_metric_history(run_id, "eval/pass1") if x.step == v * s]
        assert pass1[0].value == in_run.value

    # The run's system metrics: CPU and memory series sampled while it ran.
    metrics = client.get_run(run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics
    assert "system/system_memory_usage_megabytes" in metrics
    assert len(client.get_metric_history(run_id, "system/cpu_utilization_percentage")) >= 2

    name = f"policy-{uuid.uuid4().hex[:6]}"
    root = str(tmp_path / "runs")
    args = ["register", "--run-root", root, "--lineage", "alpha", "--name", name]
    assert cli([*args, "--best", "eval/pass1", "--alias", "best"]) == 0
    assert cli([*args, "--version", "2", "--alias", "candidate"]) == 0
    assert cli([*args, "--version", "2", "--alias", "candidate"]) == 0  # the same version
    versions = client.search_model_versions(f"name = '{name}'")
    v2 = client.get_model_version_by_alias(name, "candidate")
    assert len(versions) == (1 if client.get_model_version_by_alias(name, "best") == v2 else 2)
    assert v2.tags["lineage"] == "alpha"
    assert v2.tags["config_hash"] == cfg.config_hash()
    assert v2.tags["run_root"] == storage.normalize_root(root)
    assert v2.tags["policy_version"] == "2"
    ck = storage.read_state(paths).checkpoint
    assert v2.tags["rollouts_version"] != "none" and v2.tags["usage_version"] != "none"
    assert ck["policy_version"] == 3  # the last checkpoint's versions are state.json's
    v3 = next(m for m in models if m.tags["policy_version"] == "3")
    assert v3.tags["rollouts_version"] == str(ck["rollouts_version"])
    assert v3.tags["usage_version"] == str(ck["usage_version"])
    assert v2.run_id == run_id and v2.tags["model_id"] == models[1].model_id

    local = load_registered(mlflow_server.uri, name, alias="candidate", cache_dir=tmp_path / "c")
    expected = storage.checkpoint_local_dir(paths.checkpoint(2), tmp_path / "c2")
    assert sha256_of(local) == sha256_of(expected)
    assert any(n.endswith(".safetensors") for n in sha256_of(local))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(local)
    assert sum(p.numel() for p in loaded.parameters()) > 0


def test_copied_models_load_from_mlflow_and_the_end_of_a_lineage_registers(tmp_path):
    """The sqlite default; `tracking.copy_models` puts the weights into MLflow's artifact
    store, and `tracking.register_model_name` registers the last checkpoint at the end."""
    name = f"policy-{uuid.uuid4().hex[:6]}"
    cfg = lineage(
        tmp_path,
        f"sqlite:///{tmp_path}/mlflow.db",
        "iterations=1",
        "tracking.copy_models=true",
        f"tracking.register_model_name={name}",
        "tracking.system_metrics=false",
    )
    run_id = run_inline(cfg).mlflow_run_id
    client = MlflowClient(cfg.tracking.uri)
    assert not any(k.startswith("system/") for k in client.get_run(run_id).data.metrics)
    mv = client.get_model_version_by_alias(name, "candidate")
    assert mv.tags["policy_version"] == "1" and mv.tags["copied"] == "true"
    local = load_registered(cfg.tracking.uri, name, alias="candidate", cache_dir=tmp_path / "c")
    paths = storage.paths_of(cfg)
    expected = storage.checkpoint_local_dir(paths.checkpoint(1), tmp_path / "c2")
    assert sha256_of(local) == sha256_of(expected)
    assert not any(storage.is_training_state(f.name) for f in local.iterdir())
