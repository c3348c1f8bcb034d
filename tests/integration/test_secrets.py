"""Credentials never leave the environment: after a real run on S3 tracked on a real MLflow
server, and after the errors a user meets (wrong secret, unreachable store), the secret key
appears in no MLflow param, tag or artifact, no log line, no stored file, no compiled
pipeline YAML and no error message."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pyarrow.fs as pafs
import pytest
from mlflow.tracking import MlflowClient
from tiny_config import PRESET

from replayrl import storage
from replayrl.config import load_config

pytestmark = pytest.mark.integration


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "replayrl.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env or dict(os.environ),
    )


def stored_texts(root: str) -> dict[str, str]:
    """Every small object under the run root (state, config, markers, logs), as text."""
    fs, path = storage.filesystem(root)
    out = {}
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
        if info.type == pafs.FileType.File and info.size < 2**20:
            with fs.open_input_stream(info.path) as f:
                out[info.path] = f.read().decode("utf-8", "replace")
    return out


@pytest.mark.slow
def test_the_secret_key_is_nowhere(tmp_path, s3_root, s3_server, mlflow_server, tiny):
    secret = s3_server.secret_key
    experiment = f"secrets-{uuid.uuid4().hex[:8]}"
    # the tiny config but its run root, which `--run-root` gives
    overrides = tiny.overrides(
        s3_root,
        f"tracking.uri={mlflow_server.uri}",
        f"tracking.experiment={experiment}",
        "eval.num_prompts=8",
        "eval.every=25",
        "train.steps_per_iteration=2",
    )
    overrides = [o for o in overrides if not o.startswith("storage.run_root=")]
    sets = [a for o in overrides for a in ("--set", o)]
    run = cli("-v", "run", "--config", str(PRESET), "--run-root", s3_root, *sets)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = {"run stdout": run.stdout, "run stderr (debug logging)": run.stderr}

    client = MlflowClient(mlflow_server.uri)
    exp = client.get_experiment_by_name(experiment)
    [mlrun] = client.search_runs([exp.experiment_id])
    seen["mlflow params"] = repr(mlrun.data.params)
    seen["mlflow tags"] = repr(mlrun.data.tags)
    seen["mlflow metric names"] = repr(sorted(mlrun.data.metrics))
    for artifact in client.list_artifacts(mlrun.info.run_id):
        local = client.download_artifacts(mlrun.info.run_id, artifact.path, str(tmp_path))
        seen[f"mlflow artifact {artifact.path}"] = open(local).read()
    seen.update(stored_texts(s3_root))
    seen["mlflow server log"] = mlflow_server.log.read_text(errors="replace")

    cfg = load_config(PRESET, overrides=[*overrides, f"storage.run_root={s3_root}"])
    config_file = tmp_path / "config.yaml"
    config_file.write_text(cfg.to_yaml())
    compiled = cli("compile", "--out", str(tmp_path / "compiled"), "--config", str(config_file))
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    for path in (tmp_path / "compiled").glob("*.yaml"):
        seen[f"compiled {path.name}"] = path.read_text()
    assert any(name.startswith("compiled ") for name in seen)

    # errors a user meets: a wrong secret, and the store unreachable (real secret set)
    wrong = "WRONG" + secret[5:]
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": wrong}
    bad = cli("buffer", "stats", "--run-root", s3_root, "--lineage", cfg.lineage, env=env)
    assert bad.returncode == 2 and "rejected the credentials" in bad.stderr
    seen["wrong-secret error"] = bad.stderr.replace(wrong, "<the wrong secret>")
    env = {**os.environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "REPLAYRL_S3_DEADLINE_S": "1"}
    down = cli("buffer", "stats", "--run-root", s3_root, "--lineage", cfg.lineage, env=env)
    assert down.returncode == 2 and "unreachable" in down.stderr
    seen["unreachable error"] = down.stderr
    assert wrong not in bad.stderr

    leaks = [name for name, text in seen.items() if secret in text]
    assert leaks == [], f"the secret key appears in {leaks}"
    assert len(seen) > 10
