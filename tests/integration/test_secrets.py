"""Credentials never leave the environment: after a real run on S3 tracked on a real MLflow
server through a tracking URI with a password (`http://user:password@host`), with debug
logging on, and after the errors a user meets (wrong secret, unreachable store, unreachable
tracking server), neither the secret key nor the tracking password appears in any MLflow
param, tag or artifact, log line, stored file, compiled pipeline YAML or error message.

The session token cannot ride along the real run: SeaweedFS takes any request that carries
`X-Amz-Security-Token` for temporary (STS) credentials, which it does not know, and rejects
it (InvalidAccessKeyId). So the token is checked where it leaks: botocore's debug log of a
real request to the server (the signed headers, the canonical request), and the error the
CLI prints when the server refuses it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pyarrow.fs as pafs
import pytest
from mlflow.tracking import MlflowClient
from tiny_config import PRESET

from replayrl import storage
from replayrl.config import load_config

SESSION_TOKEN = "FAKE-SESSION-TOKEN-" + uuid.uuid4().hex * 4

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
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)):
        if info.type == pafs.FileType.File and info.size < 2**20:
            with fs.open_input_stream(info.path) as f:
                out[info.path] = f.read().decode("utf-8", "replace")
    return out


@pytest.mark.slow
def test_no_secret_is_anywhere(tmp_path, s3_root, s3_server, mlflow_server, tiny):
    secret = s3_server.secret_key
    password = f"pw-{uuid.uuid4().hex}"
    # MLflow's server ignores basic-auth credentials unless its auth app is on: the client
    # sends them (as an Authorization header), the server answers as usual.
    tracking_uri = mlflow_server.uri.replace("http://", f"http://replayrl:{password}@")
    experiment = f"secrets-{uuid.uuid4().hex[:8]}"
    # the tiny config but its run root, which `--run-root` gives
    overrides = tiny.overrides(
        s3_root,
        f"tracking.uri={tracking_uri}",
        f"tracking.experiment={experiment}",
        "eval.num_prompts=8",
        "eval.every=25",
        "train.steps_per_iteration=2",
    )
    overrides = [o for o in overrides if not o.startswith("storage.run_root=")]
    sets = [a for o in overrides for a in ("--set", o)]
    run = cli("-v", "run", "--config", str(PRESET), "--run-root", s3_root, *sets)
    assert run.returncode == 0, run.stderr[-3000:]
    assert " DEBUG botocore" in run.stderr  # the debug log whose headers are redacted
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
    state = storage.read_state(storage.paths_of(cfg))
    assert state.tracking_uri == mlflow_server.uri  # stored without its credentials
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
    # the tracking server unreachable: MLflow's error names the URL it tried, password and all
    env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"}
    gone = cli(
        "-v",
        "run",
        "--config",
        str(PRESET),
        "--run-root",
        s3_root,
        *sets,
        "--set",
        f"tracking.uri=http://replayrl:{password}@127.0.0.1:9",
        "--set",
        "storage.lineage=secrets-unreachable-tracking",
        env=env,
    )
    assert gone.returncode == 2 and "Cannot reach the MLflow tracking store" in gone.stderr
    seen["unreachable tracking error"] = gone.stdout + gone.stderr

    leaks = [name for name, text in seen.items() if secret in text]
    assert leaks == [], f"the secret key appears in {leaks}"
    # Compiling copies the config file into the pipelines' default `config` parameter, with
    # the tracking URI's credentials removed.
    leaks = [name for name, text in seen.items() if password in text]
    assert leaks == [], f"the tracking password appears in {leaks}"
    assert len(seen) > 10


def test_the_session_token_is_nowhere(tmp_path, s3_root, s3_server, monkeypatch):
    """A real botocore request carrying the token, logged at DEBUG through the filter the CLI
    installs, then the CLI's error when the server refuses the token."""
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)
    probe = textwrap.dedent(
        f"""
        import logging, os
        from replayrl import logs, storage
        from replayrl.storage import s3
        logging.basicConfig(level=logging.DEBUG)
        logs.install(os.environ)
        client = s3.client(storage.s3_settings())
        try:
            s3.put_if(client, "{s3_root}/probe", b"x", etag=None)
        except Exception as e:
            logging.getLogger("probe").exception("refused: %s", e)
        """
    )
    logged = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert logged.returncode == 0, logged.stderr[-3000:]
    # the request was signed with the token and logged (its headers, the canonical request
    # botocore signs, the signature), then refused; each logged with the value masked
    for masked in ("'X-Amz-Security-Token': b'***'", "x-amz-security-token:***"):
        assert masked in logged.stderr
    assert "'Authorization': b'***'" in logged.stderr and "Signature:\n***" in logged.stderr
    assert "InvalidAccessKeyId" in logged.stderr
    seen = {"botocore debug log": logged.stdout + logged.stderr}

    bad = cli("-v", "buffer", "stats", "--run-root", s3_root, "--lineage", "any")
    assert bad.returncode == 2 and "rejected the credentials" in bad.stderr
    seen["refused-token error"] = bad.stdout + bad.stderr
    monkeypatch.delenv("AWS_SESSION_TOKEN")  # the server refuses it: list without it
    seen.update(stored_texts(s3_root))

    for name, text in seen.items():
        assert SESSION_TOKEN not in text, f"the session token appears in {name}"
        assert s3_server.secret_key not in text, f"the secret key appears in {name}"
