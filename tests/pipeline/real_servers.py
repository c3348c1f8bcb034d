"""The integration tier's real servers for pipeline tests: its conftest (SeaweedFS as
`S3Server`, the `s3_server`, `s3_env`, `s3_root` and `mlflow_server` fixtures), defined
once there and loaded here as a module. A test module that takes a fixture from it names it
at module level (`s3_root = servers().s3_root`), which is how pytest finds it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

NAME = "replayrl_test_servers"
CONFTEST = Path(__file__).parents[1] / "integration" / "conftest.py"


def servers():
    """The integration conftest as a module, loaded once per process."""
    if NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(NAME, CONFTEST)
        module = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[NAME]
