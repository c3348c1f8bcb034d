"""`make lint` type-checks core/, storage/ and buffer/ with mypy ([tool.mypy] in
pyproject.toml): with the project's settings mypy fails on a type error, and on a function
that annotates only part of its signature. Only core/clock.py (stdlib only) of a copy of the
package is checked, so each run takes a second or two, not the ~15 s of a cold full check."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # runs mypy twice (`make lint` runs it too)

ROOT = Path(__file__).resolve().parents[2]
MYPY = Path(sys.executable).with_name("mypy")


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    """pyproject.toml and src/replayrl, copied: mypy reads its settings from the first and,
    through `mypy_path = "src"`, the package from the second."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(
        ROOT / "src" / "replayrl",
        tmp_path / "src" / "replayrl",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return tmp_path


def mypy_clock(project: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MYPY), "-m", "replayrl.core.clock"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_mypy_passes_on_the_unchanged_module(project_copy):
    done = mypy_clock(project_copy)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success" in done.stdout


def test_mypy_fails_on_a_type_error(project_copy):
    clock = project_copy / "src" / "replayrl" / "core" / "clock.py"
    clock.write_text(
        clock.read_text()
        + '\n\ndef _wrong() -> int:\n    return "one"\n'
        + "\n\ndef _half(a: int, b):\n    return a\n"
    )
    done = mypy_clock(project_copy)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "[return-value]" in done.stdout
    # disallow_incomplete_defs: `b` has no annotation while `a` has one
    assert "[no-untyped-def]" in done.stdout
