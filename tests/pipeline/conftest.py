"""Fixtures of the pipeline tier. `kfp_standin` serves a STAND-IN for the KFP v2beta1 REST
API on a free loopback port; it is not Kubeflow Pipelines (see `kfp_helpers`)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kfp_helpers import Rejected, StandinState, route


@dataclass
class KfpStandin:
    url: str
    state: StandinState
    rejected: list[str]


@pytest.fixture
def kfp_standin():
    """A stand-in for the KFP v2beta1 REST API on a free loopback port (see module doc)."""
    state = StandinState()
    rejected: list[str] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            try:
                with lock:
                    answer, status = route(state, method, self.path, self.headers, body), 200
            except Rejected as e:
                rejected.append(f"{method} {self.path}: {e}")
                answer, status = {"error_message": str(e), "code": e.status}, e.status
            blob = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(blob)))
            self.end_headers()
            self.wfile.write(blob)

        def do_GET(self):  # noqa: N802
            self._serve("GET")

        def do_POST(self):  # noqa: N802
            self._serve("POST")

        def log_message(self, *args):  # keep pytest output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield KfpStandin(f"http://127.0.0.1:{server.server_address[1]}", state, rejected)
    finally:
        server.shutdown()
        server.server_close()
