"""The conditional-write probe against a real S3 server (SeaweedFS): opening a lineage on S3
checks once that the store honours `If-None-Match: *` and `If-Match` on PutObject, and
refuses a store that ignores them (there the compare-and-swap of `state.json` and the lease
would be last-writer-wins) before anything of the lineage is written.

A store that ignores the headers is SeaweedFS behind `HeaderProxy`, a loopback HTTP proxy
that drops them from every request. SeaweedFS checks SigV4 signatures and botocore signs
`If-Match` / `If-None-Match` (they are not in its unsigned-header list), so a request with
a header removed would fail as a bad signature, not as an ignored condition. The proxy
therefore re-signs exactly the requests it changes, with the test server's own keys (as a
store that ignores the headers after checking the client's signature would behave); every
other request is forwarded byte for byte, Host header included, so its original signature
still holds. With `strip=False` the proxy forwards everything unchanged and only counts the
conditional requests, which is how the tests see that a second open does not probe again.
"""

from __future__ import annotations

import http.client
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest

from replayrl import storage
from replayrl.config import load_config
from replayrl.engine.inline import run_inline
from replayrl.errors import ReplayRLError
from replayrl.kfp import runtime
from replayrl.storage import lease

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
CONDITIONAL = ("if-match", "if-none-match")


@dataclass
class HeaderProxy:
    """A loopback HTTP proxy in front of `upstream` (an http:// endpoint) on a free port.

    `strip`: drop `If-Match` / `If-None-Match` and re-sign the request with `access_key` /
    `secret_key`; otherwise forward it unchanged. `conditional` counts the requests that
    came in with either header."""

    upstream: str
    access_key: str
    secret_key: str
    strip: bool
    conditional: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive and 100-continue, as clients expect

            def log_message(self, *args) -> None:  # quiet test output
                pass

            def forward(self) -> None:
                proxy.forward(self)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
            self._server = None

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        headers = list(handler.headers.items())
        if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
            # pyarrow's uploads: forwarded whole, with a Content-Length (neither is signed)
            body = _dechunk(handler.rfile)
            headers = [(n, v) for n, v in headers if n.lower() != "transfer-encoding"]
            headers.append(("Content-Length", str(len(body))))
        else:
            length = int(handler.headers.get("Content-Length") or 0)
            body = handler.rfile.read(length) if length else b""
        if any(name.lower() in CONDITIONAL for name, _ in headers):
            with self._lock:
                self.conditional += 1
            if self.strip:
                headers = self._resigned(handler, headers, body)
        target = urlparse(self.upstream)
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
        try:
            conn.putrequest(
                handler.command, handler.path, skip_host=True, skip_accept_encoding=True
            )
            for name, value in headers:  # the client's Host, so its signature still holds
                conn.putheader(name, value)
            conn.endheaders(body or None)
            response = conn.getresponse()
            data = response.read()
            handler.send_response_only(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                    handler.send_header(name, value)
            if handler.command == "HEAD":
                handler.send_header("Content-Length", response.getheader("Content-Length", "0"))
            else:
                handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            if handler.command != "HEAD":
                handler.wfile.write(data)
        finally:
            conn.close()

    def _resigned(self, handler, headers: list[tuple[str, str]], body: bytes):
        """`headers` without the conditional ones, signed again (SigV4) for the same URL."""
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        dropped = (*CONDITIONAL, "authorization", "x-amz-date", "x-amz-content-sha256")
        kept = {name: value for name, value in headers if name.lower() not in dropped}
        request = AWSRequest(
            method=handler.command,
            url=f"http://{handler.headers['Host']}{handler.path}",
            data=body,
            headers=kept,
        )
        signer = S3SigV4Auth(Credentials(self.access_key, self.secret_key), "s3", "us-east-1")
        signer.add_auth(request)
        return list(request.headers.items())


def _dechunk(stream) -> bytes:
    """The body of an HTTP/1.1 `Transfer-Encoding: chunked` request (trailers dropped)."""
    out = b""
    while True:
        size = int(stream.readline().split(b";")[0].strip(), 16)
        if size == 0:
            while stream.readline().strip():
                pass
            return out
        out += stream.read(size)
        stream.readline()  # the CRLF after each chunk


def proxy_fixture(strip: bool):
    @pytest.fixture
    def fixture(s3_env, monkeypatch):
        proxy = HeaderProxy(s3_env.endpoint, s3_env.access_key, s3_env.secret_key, strip=strip)
        proxy.start()
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setenv("REPLAYRL_S3_DEADLINE_S", "5")  # a broken proxy fails fast
        yield proxy
        proxy.stop()

    return fixture


stripping_proxy = proxy_fixture(strip=True)
transparent_proxy = proxy_fixture(strip=False)


def prefix_of(root: str) -> str:
    return root.split("/", 3)[3] + "/"


def objects_under(server, root: str) -> list[str]:
    """The keys under run root `root`, but folder markers: pyarrow leaves an empty
    "<folder>/" object when it deletes the last object of a folder (as `ensure_writable`
    does with its plain write probe, and a released lease)."""
    return [key for key in server.keys(prefix_of(root)) if not key.endswith("/")]


def test_seaweedfs_passes_the_probe_and_keeps_no_probe_object(s3_root, s3_env):
    storage.ensure_writable(s3_root)
    assert objects_under(s3_env, s3_root) == []
    # the compare-and-swap it vouches for works there
    paths = storage.lineage_paths(s3_root, "lin")
    state = storage.LineageState(lineage="lin", arm="replay", seed=0, config_hash="h")
    storage.advance_state(paths, state, expected_next_iteration=None)
    assert objects_under(s3_env, s3_root) == [prefix_of(s3_root) + "lin/state.json"]


def test_the_verdict_is_cached_per_store_and_run_root(s3_root, s3_env, transparent_proxy):
    storage.ensure_writable(s3_root)
    # two If-None-Match puts, one current and one stale If-Match put
    assert transparent_proxy.conditional == 4
    assert objects_under(s3_env, s3_root) == []
    storage.ensure_writable(s3_root)
    storage.ensure_writable(s3_root + "/")  # the same run root
    assert transparent_proxy.conditional == 4
    storage.ensure_writable(s3_root + "-other")  # another run root is probed on its own
    assert transparent_proxy.conditional == 8


def test_a_store_ignoring_conditional_writes_is_refused_before_any_lineage_write(
    tmp_path, s3_root, s3_env, stripping_proxy
):
    cfg = load_config(
        PRESET,
        overrides=[
            f"storage.run_root={s3_root}",
            f"model.cache_dir={tmp_path / 'cache'}",
            # Were the probe missing, this run would stop (at once) at the missing model.
            f"model.source={tmp_path / 'no-such-model'}",
        ],
    )
    with pytest.raises(ReplayRLError) as err:
        run_inline(cfg)
    message = str(err.value)
    assert "\n" not in message
    assert f"object store at {stripping_proxy.endpoint} (bucket '{s3_env.bucket}')" in message
    assert "ignored If-None-Match: *" in message and "ignored If-Match" in message
    assert "two runs could both advance a lineage" in message and "SeaweedFS 3.97" in message
    assert s3_env.secret_key not in message
    assert stripping_proxy.conditional == 4
    # no lineage state, lease, config, checkpoint or probe object: the prefix is empty
    assert objects_under(s3_env, s3_root) == []
    assert not any(cfg.lineage in key for key in s3_env.keys(prefix_of(s3_root)))

    # The Kubeflow open_lineage component gets the same refusal (cached: no new probe),
    # before it writes its lease: the store is checked first.
    with pytest.raises(ReplayRLError, match="ignored If-None-Match"):
        runtime.open_run(
            config=str(PRESET),
            arm="",
            lineage=cfg.lineage,
            run_root=s3_root,
            owner="kfp-run-1",
            required_iterations=1,
        )
    assert stripping_proxy.conditional == 4  # no lease put, and no second probe
    paths = storage.lineage_paths(s3_root, cfg.lineage)
    assert lease.read(paths) is None and storage.read_state(paths) is None
    assert objects_under(s3_env, s3_root) == []
