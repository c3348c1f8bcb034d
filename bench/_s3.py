"""A SeaweedFS `weed mini` S3 server for the benchmarks, on free loopback ports, stopped by
its process group id. Reuses the integration tier's `S3Server` (tests/integration/conftest.py)
rather than a second copy of the start-up code."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

_CONFTEST = Path(__file__).resolve().parents[1] / "tests" / "integration" / "conftest.py"


def _server_class():
    spec = importlib.util.spec_from_file_location("_replayrl_integration_conftest", _CONFTEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module.S3Server


@contextlib.contextmanager
def s3_server() -> Iterator[object]:
    """A started server (`.endpoint`, `.env()`, `.bucket`), stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="bench-seaweedfs-") as tmp:
        server = _server_class()(Path(tmp) / "data")
        server.start()
        try:
            yield server
        finally:
            server.stop()
