"""A run root that cannot be written or that goes away, through the real CLI: the run root,
the lineage's folder, a buffer table, its Delta log or the checkpoints folder made
immutable (`chattr +i`: the tests run as root, whom a chmod does not stop), a run root below
a file, the run root (or only the lineage's folder) deleted while a run is live, and an S3
bucket deleted under a lineage.

Each ends in one line (`replayrl: error: ...`, exit 2, no traceback); nothing committed is
lost, no folder is created anew where one vanished, and where the cause can be undone (the
flag cleared) the same command resumes the lineage."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_helpers import PRESET, cli, crash_overrides, ok, one_error_line

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LINEAGE = "chain_sum-replay-s0"
LOOP = ("iterations=2",)


def run_args(tmp: Path, root: str, *extra: str) -> list[str]:
    sets = crash_overrides(tmp, root, *LOOP, *extra)
    return ["run", "--config", str(PRESET), *[a for s in sets for a in ("--set", s)]]


def committed(root: Path) -> dict[str, bytes]:
    """What a refused command must keep: state.json (less its fencing epoch: taking the
    lease raises it), every checkpoint file and every entry of the buffer's Delta logs (a
    log only grows: a refused run may have committed rows of the iteration it redoes, which
    the next resume rewinds)."""
    out = {}
    for p in sorted(root.rglob("*")):
        relative = str(p.relative_to(root))
        if not p.is_file() or p.name.endswith(".lock"):
            continue
        if p.name == "state.json":
            state = json.loads(p.read_bytes())
            state.pop("epoch", None)
            out[relative] = json.dumps(state, sort_keys=True).encode()
        elif "/checkpoints/" in relative or "/_delta_log/" in relative:
            out[relative] = p.read_bytes()
    return out


def assert_kept(before: dict[str, bytes], root: Path) -> None:
    after = committed(root)
    assert {k: after.get(k) for k in before} == before


# ---------------------------------------------------------------- a lineage to spoil


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A 2-iteration lineage (its tracking store beside the run root), made once."""
    tmp = tmp_path_factory.mktemp("run-root")
    ok(cli(*run_args(tmp, str(tmp / "runs"))))
    return tmp


@pytest.fixture
def lineage(made: Path, tmp_path: Path) -> Path:
    """A copy of the module's lineage (run root `tmp_path/runs`) with its own tracking store."""
    shutil.copytree(made / "runs", tmp_path / "runs")
    [db] = made.glob("mlflow-*.db")
    uri = next(
        s for s in crash_overrides(tmp_path, str(tmp_path / "runs")) if s.startswith("tracking.")
    )
    shutil.copy(db, uri.split("sqlite:///", 1)[1])
    state_file = tmp_path / "runs" / LINEAGE / "state.json"
    state = json.loads(state_file.read_text())
    state["tracking_uri"] = uri.split("=", 1)[1]
    state_file.write_text(json.dumps(state, indent=2, sort_keys=True))
    return tmp_path


def next_iteration(tmp: Path) -> int:
    return json.loads((tmp / "runs" / LINEAGE / "state.json").read_text())["next_iteration"]


# ---------------------------------------------------------------- cannot be written


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    """`path` (a folder) immutable while the block runs: nothing can be created, removed or
    renamed in it, by root too. Skips the test where the file system has no such flag."""
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is not supported here: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.skipif(shutil.which("chattr") is None, reason="no chattr")
@pytest.mark.parametrize(
    "folder,needle",
    [
        ("", "Run root"),
        (LINEAGE, "lease.json"),
        (f"{LINEAGE}/buffer/rollouts", "Cannot write iteration 3"),
        (f"{LINEAGE}/buffer/rollouts/_delta_log", "Cannot write iteration 3"),
        (f"{LINEAGE}/checkpoints", "checkpoints/v000003"),
    ],
    ids=["run-root", "lineage", "rollouts-table", "delta-log", "checkpoints"],
)
def test_a_folder_that_cannot_be_written_is_one_line_and_the_same_command_resumes(
    lineage, folder, needle
):
    root = lineage / "runs"
    before = committed(root)
    args = run_args(lineage, str(root), "iterations=3")
    with immutable(root / folder):
        one_error_line(cli(*args), needle)
        assert ok(cli("buffer", "stats", "--run-root", str(root), "--lineage", LINEAGE))
    assert_kept(before, root)
    ok(cli(*args))
    assert next_iteration(lineage) == 4


def test_a_run_root_below_a_file_is_one_line_and_creates_nothing(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    root = tmp_path / "a-file" / "runs"
    one_error_line(cli(*run_args(tmp_path, str(root))), "Run root", "cannot be written")
    one_error_line(
        cli("buffer", "stats", "--run-root", str(root), "--lineage", LINEAGE), "No lineage"
    )
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("mlflow-")) == [
        "a-file"
    ]


# ---------------------------------------------------------------- gone while a run is live

# A child that runs the real CLI and deletes a folder (rm -rf) the first time a named step
# is reached in a given iteration: `python -c VANISH <folder> <step> <iteration> -- <argv>`.
VANISH = """
import shutil, sys
folder, step, iteration = sys.argv[1], sys.argv[2], int(sys.argv[3])
argv = sys.argv[sys.argv.index("--") + 1:]
from replayrl.buffer.table import ReplayBuffer
from replayrl.engine import steps
from replayrl.storage import checkpoints, state
owner, name = {
    "append": (ReplayBuffer, "append"),
    "log_usage": (ReplayBuffer, "log_usage"),
    "compact": (ReplayBuffer, "compact"),
    "evaluate": (steps, "evaluate"),
    "mark_complete": (checkpoints, "mark_complete"),
    "advance_state": (state, "advance_state"),
}[step]
original, generate, now = getattr(owner, name), steps.generate, {"iteration": 0, "done": False}
def tracking(*a, **k):
    now["iteration"] = k["iteration"]
    return generate(*a, **k)
def wrapper(*a, **k):
    if now["iteration"] == iteration and not now["done"]:
        now["done"] = True
        shutil.rmtree(folder)
    return original(*a, **k)
steps.generate = tracking
setattr(owner, name, wrapper)
from replayrl.cli.main import main
sys.exit(main(argv))
"""


@pytest.mark.parametrize(
    "gone,step,iteration,needle",
    [
        ("runs", "append", 2, "buffer/rollouts: its Delta log entry for version 0"),
        ("runs", "compact", 2, "is gone"),
        ("runs", "log_usage", 2, "buffer/usage: its Delta log entry for version 0"),
        ("runs", "evaluate", 2, "Run root"),
        ("runs", "advance_state", 2, "Run root"),
        ("runs", "mark_complete", 2, "Run root"),
        (f"runs/{LINEAGE}", "append", 2, "its Delta log entry for version 0"),
        (f"runs/{LINEAGE}", "advance_state", 2, f"Lineage '{LINEAGE}' folder"),
    ],
    ids=[
        "root-before-append",
        "root-before-compact",
        "root-before-usage-log",
        "root-before-evaluate",
        "root-before-commit",
        "root-before-checkpoint-marked",
        "lineage-before-append",
        "lineage-before-commit",
    ],
)
def test_a_run_root_deleted_under_a_live_run_is_one_line_and_not_recreated(
    tmp_path, gone, step, iteration, needle
):
    root = tmp_path / "runs"
    argv = run_args(tmp_path, str(root), "iterations=3", "train.checkpoint_every=2")
    done = subprocess.run(
        [sys.executable, "-c", VANISH, str(tmp_path / gone), step, str(iteration), "--", *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = one_error_line(done, needle)
    assert "gone" in line and ("put it back" in line or "Put it back" in line), line
    # Nothing of the lineage was written anew where it was: no empty run root, no lone
    # state.json, checkpoint or table in a recreated folder.
    assert not (tmp_path / gone).exists()


# ---------------------------------------------------------------- an S3 bucket deleted


def test_an_s3_bucket_deleted_under_a_lineage_is_one_line(tmp_path, s3_server, s3_env):
    bucket = f"gone-{uuid.uuid4().hex[:8]}"
    s3_server.ensure_bucket(bucket)
    root = f"s3://{bucket}/runs"
    args = run_args(tmp_path, root, "iterations=1")
    ok(cli(*args))
    client = s3_server.client()
    keys = [
        {"Key": o["Key"]}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]
    for start in range(0, len(keys), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": keys[start : start + 1000]})
    client.delete_bucket(Bucket=bucket)

    fix = f"bucket '{bucket}' does not exist"
    one_error_line(cli(*run_args(tmp_path, root, "iterations=2")), fix)
    one_error_line(cli("buffer", "stats", "--run-root", root, "--lineage", LINEAGE), fix)
    # The bucket is not made again behind the user's back.
    assert bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}
