"""Every test runs with the Hugging Face hub offline: no code path may download a model or
data on CPU, and a test that needs a hub name builds a local hub cache (see
tests/integration/test_hub_inputs.py). Set before any test module imports huggingface_hub,
which reads it once; subprocesses inherit it.

The `tiny` fixture is the suite's one tiny configuration (`tiny_config`): every tier's
lineages start from its model and its warm start, built once per run.

Under pytest-xdist (`make test` runs two workers on two cores) each worker's torch uses one
thread, and so do the processes it starts: two workers of two threads each on two cores spin
against each other and run several times slower than one.

The workers take tests in collection order, so the tests `tests/durations.json` names as the
longest (the kill and stall trials, the demo: minutes each) are moved to the front, longest
first: collected last, one of them would run alone on one worker while the other sat idle.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import tiny_config  # noqa: E402  (tests/ is on sys.path: this conftest's folder)

_made_cache: str | None = None


def pytest_configure(config):
    """Name this run's shared model cache before xdist starts its workers (they inherit it).
    A REPLAYRL_TEST_CACHE set by the user is kept and reused across runs."""
    global _made_cache
    if not os.environ.get(tiny_config.CACHE_ENV):
        _made_cache = tempfile.mkdtemp(prefix="replayrl-test-cache-")
        os.environ[tiny_config.CACHE_ENV] = _made_cache


def pytest_unconfigure(config):
    if _made_cache is not None:
        shutil.rmtree(_made_cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """The longest tests first (`tests/durations.json`, written by `tests/durations.py`),
    longest first; the others keep their order (a stable sort)."""
    path = Path(__file__).with_name("durations.json")
    seconds = json.loads(path.read_text()) if path.exists() else {}
    items.sort(key=lambda item: -seconds.get(item.nodeid, 0.0))


@pytest.fixture(scope="session")
def tiny():
    """The suite's tiny configuration, its warm start built (once per run, shared by the
    xdist workers): `tiny.config(run_root, *overrides, arm=None)` loads a RunConfig,
    `tiny.overrides(run_root, *overrides)` gives the `--set` list for a CLI or a child."""
    tiny_config.ensure_warm_start()
    return tiny_config
