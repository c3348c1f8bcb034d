"""The layer contract in pyproject.toml ([tool.importlinter]) holds on the package, and fails
when a lower layer imports a higher one, lazily inside a function included."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(tmp_path: Path, src: Path) -> subprocess.CompletedProcess:
    """Run lint-imports with the project's own contract against the package under `src`."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    lines = ["[importlinter]", f"root_package = {config['root_package']}", ""]
    for i, contract in enumerate(config["contracts"]):
        lines += [f"[importlinter:contract:{i}]", f"name = {contract['name']}"]
        lines += [f"type = {contract['type']}", "layers ="]
        lines += [f"    {layer}" for layer in contract["layers"]]
    ini = tmp_path / "contract.ini"
    ini.write_text("\n".join(lines) + "\n")
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ini), "--no-cache"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(
        ROOT / "src" / "replayrl", src / "replayrl", ignore=shutil.ignore_patterns("__pycache__")
    )
    return src


def test_the_package_keeps_its_layers(tmp_path, package_copy):
    done = lint_imports(tmp_path, package_copy)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 kept, 0 broken" in done.stdout


def test_a_lazy_upward_import_breaks_the_contract(tmp_path, package_copy):
    metrics = package_copy / "replayrl" / "core" / "metrics.py"
    metrics.write_text(
        metrics.read_text()
        + "\n\ndef _upward():\n    from replayrl.engine import steps\n\n    return steps\n"
    )
    done = lint_imports(tmp_path, package_copy)
    assert done.returncode != 0
    assert "BROKEN" in done.stdout
    assert "replayrl.core.metrics -> replayrl.engine.steps" in done.stdout


def test_the_policy_import_circle_stays_broken(tmp_path, package_copy):
    """training_state (what a checkpoint holds) used to import sharded for the optimizer's file
    layout, while sharded and distributed import it: a circle the second contract forbids."""
    state = package_copy / "replayrl" / "policy" / "training_state.py"
    state.write_text(
        state.read_text()
        + "\n\ndef _circle():\n    from replayrl.policy import sharded\n\n    return sharded\n"
    )
    done = lint_imports(tmp_path, package_copy)
    assert done.returncode != 0
    assert "replayrl.policy.training_state -> replayrl.policy.sharded" in done.stdout
