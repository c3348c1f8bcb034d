"""The tiny loop with its run root on a real S3 server (SeaweedFS) and its metrics on a real
MLflow server (artifacts on the same bucket): rows, checkpoints, state and metrics land
where a user would look for them."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import tiny_config
from mlflow.tracking import MlflowClient

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.engine.inline import run_inline

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


def small(tmp_path: Path, run_root: str, *extra: str, arm: str | None = None):
    """The fast tiny config of test_loop.py (`tiny_config`), with the run root given."""
    return tiny_config.config(run_root, "iterations=3", "buffer.positive_bias=0.0", *extra, arm=arm)


def tracked(tmp_path: Path, run_root: str, uri: str, *extra: str):
    """`small` tracked on `uri`, in an experiment of its own (the server is shared)."""
    return small(
        tmp_path,
        run_root,
        f"tracking.uri={uri}",
        f"tracking.experiment=exp-{uuid.uuid4().hex[:8]}",
        *extra,
    )


def history(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    run = client.get_run(run_id)
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        for key in run.data.metrics
    }


def test_loop_on_s3_and_mlflow_server(tmp_path, s3_root, mlflow_server):
    cfg = tracked(tmp_path, s3_root, mlflow_server.uri)
    summary = run_inline(cfg)
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)

    state = storage.read_state(paths)
    assert state.next_iteration == 4 and state.policy_version == 3
    assert state.tracking_uri == mlflow_server.uri
    # one task of 3 iterations (checkpoint_every 10): a full checkpoint at its end, beside
    # v0, each with a size and sha256 manifest in its marker
    assert storage.complete_versions(paths) == [0, 3]
    assert state.checkpoint["iteration"] == 3 and state.checkpoint["rollouts_version"] >= 0
    marker = json.loads(storage.read_bytes(storage.join(paths.checkpoint(3), "COMPLETE")))
    assert marker["files"]["model.safetensors"]["size"] > 0

    prefix = s3_root.split("/", 3)[3]
    keys = s3_root_keys(s3_root)
    assert f"{prefix}/{cfg.lineage}/state.json" in keys
    files = f"checkpoints/v000003/{marker['folder']}/model.safetensors"
    assert any(k.endswith(files) for k in keys)
    assert any("/buffer/rollouts/_delta_log/" in k for k in keys)

    buf = ReplayBuffer(paths.buffer, storage_options=storage.delta_storage_options(paths.buffer))
    rows = buf.read()
    assert rows.num_rows == 64 and sorted(set(rows.column("iteration").to_pylist())) == [2, 3]
    assert len(set(rows.column("rollout_id").to_pylist())) == 64
    assert buf.read_usage().num_rows == 3 * 64
    assert buf.check() == []

    client = MlflowClient(mlflow_server.uri)
    hist = history(client, summary.mlflow_run_id)
    s = cfg.train.steps_per_iteration  # MLflow steps are gradient steps: iteration t at t·S
    assert hist["iteration"] == [(0, 0), (s, 1), (2 * s, 2), (3 * s, 3)]
    assert [step for step, _ in hist["train/loss"]] == [s, 2 * s, 3 * s]
    assert [step for step, _ in hist["eval/pass1"]] == [0, s, 2 * s, 3 * s]
    assert all(v == 2.0 for _, v in hist["replay/ratio"])
    run = client.get_run(summary.mlflow_run_id)
    assert run.data.params["storage.run_root"] == s3_root
    assert run.data.tags["run_root"] == storage.normalize_root(s3_root)
    assert run.info.status == "FINISHED"
    # the run's artifacts went through the server to the bucket
    assert [a.path for a in client.list_artifacts(summary.mlflow_run_id)] == ["config.yaml"]
    artifact_keys = s3_keys_under(mlflow_server.artifacts)
    assert any(k.endswith(f"{summary.mlflow_run_id}/artifacts/config.yaml") for k in artifact_keys)

    # resuming a finished lineage does nothing and logs nothing twice
    again = run_inline(cfg)
    assert again.resumed_from == 4
    assert history(client, summary.mlflow_run_id) == hist


def s3_root_keys(uri: str) -> list[str]:
    return s3_keys_under(uri)


def s3_keys_under(uri: str) -> list[str]:
    import pyarrow.fs as pafs

    fs, path = storage.filesystem(uri)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return [i.path.split("/", 1)[1] for i in infos if i.type == pafs.FileType.File]


def test_two_lineages_share_a_bucket_without_touching_each_other(tmp_path, s3_root):
    tracking = f"sqlite:///{tmp_path}/mlflow.db"
    a = small(
        tmp_path, s3_root, "iterations=2", "storage.lineage=alpha", f"tracking.uri={tracking}"
    )
    b = small(
        tmp_path,
        s3_root,
        "iterations=2",
        "storage.lineage=beta",
        f"tracking.uri={tracking}",
    )
    run_inline(a)
    before = {k: v for k, v in object_etags(s3_root, "alpha").items()}
    run_inline(b)
    # b wrote nothing under alpha/, and alpha's objects are byte-for-byte the same
    assert object_etags(s3_root, "alpha") == before
    for cfg in (a, b):
        paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
        rows = ReplayBuffer(
            paths.buffer, storage_options=storage.delta_storage_options(paths.buffer)
        ).read()
        assert set(rows.column("lineage").to_pylist()) == {cfg.lineage}
        assert storage.read_state(paths).next_iteration == 3
    prefix = s3_root.split("/", 3)[3]
    tops = {k[len(prefix) + 1 :].split("/", 1)[0] for k in s3_root_keys(s3_root)}
    assert tops == {"alpha", "beta"}


def object_etags(root: str, lineage: str) -> dict[str, tuple[int, object]]:
    import pyarrow.fs as pafs

    fs, path = storage.filesystem(storage.join(root, lineage))
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return {i.path: (i.size, i.mtime) for i in infos if i.type == pafs.FileType.File}


@pytest.mark.slow
def test_kfp_local_engine_on_s3_and_mlflow_server(tmp_path, s3_root, mlflow_server):
    """The Kubeflow pipeline under kfp.local (one subprocess per step, as one pod per step)
    against the same servers: the steps find the store and the tracker through the
    standard variables, like pods given the S3 secret and the endpoints config map."""
    from replayrl.kfp.local import run_kfp_local

    cfg = tracked(tmp_path, s3_root, mlflow_server.uri, "iterations=1")
    summary = run_kfp_local(cfg, quiet=True)
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    state = storage.read_state(paths)
    assert state.next_iteration == 2 and storage.complete_versions(paths) == [0, 1]
    buf = ReplayBuffer(paths.buffer, storage_options=storage.delta_storage_options(paths.buffer))
    assert buf.read().num_rows == 32 and buf.read_usage().num_rows == 64
    hist = history(MlflowClient(mlflow_server.uri), summary.mlflow_run_id)
    s = cfg.train.steps_per_iteration  # MLflow steps are gradient steps: iteration 1 at S
    assert hist["iteration"] == [(0, 0), (s, 1)]
    assert [step for step, _ in hist["train/loss"]] == [s]
