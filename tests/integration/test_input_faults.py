"""A task file rewritten under a lineage, through the real CLI.

A GSM8K lineage is opened on a JSONL file; the file is then rewritten at the same path with
other questions. Resuming must refuse with one line (the buffer would mix iterations of the
old and the new problems, and the held-out set would change mid-curve), keep everything,
and go on only when the user says so (`--accept-changed-task-data`), recorded in the
lineage. A rewrite that keeps the questions (other formatting) is not a change.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import tiny_config
from fault_helpers import cli

from replayrl import storage

pytestmark = pytest.mark.slow
DATA = Path(__file__).parents[1] / "data" / "gsm8k_tiny.jsonl"


def _run(tmp_path: Path, task: Path, iterations: int, *extra: str) -> subprocess.CompletedProcess:
    sets = tiny_config.overrides(
        tmp_path / "runs",
        # The suite's warm-started tiny model as a checkpoint: no warm start on GSM8K.
        f"model.source={tiny_config.ensure_warm_start()}",
        "task.name=gsm8k",
        "task.options={}",
        f"task.path={task}",
        "task.num_train=20",
        "task.num_eval=8",
        "eval.num_prompts=8",
        f"iterations={iterations}",
    )
    args = ["run", "--config", str(tiny_config.PRESET), "--lineage", "gsm"]
    return cli(*args, *[a for s in sets for a in ("--set", s)], *extra)


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("replayrl: error:")]


def test_a_task_file_rewritten_under_a_lineage_is_refused_until_the_user_accepts_it(tmp_path):
    task = tmp_path / "gsm8k.jsonl"
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = _run(tmp_path, task, 1)
    assert first.returncode == 0, first.stderr
    paths = storage.lineage_paths(str(tmp_path / "runs"), "gsm")
    record = json.loads(Path(storage.join(paths.inputs, "task.json")).read_text())
    assert record["path"] == str(task) and record["history"] == []

    # The same questions written differently (key order) are the same problems: the lineage
    # opens (and has nothing left to do).
    task.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    assert _run(tmp_path, task, 1).returncode == 0
    state = Path(paths.state).read_bytes()

    # Other questions at the same path: refused before anything is touched.
    changed = [{**r, "question": r["question"] + " Explain."} for r in rows]
    task.write_text("".join(json.dumps(r) + "\n" for r in changed))
    refused = _run(tmp_path, task, 2)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    (line,) = _error_lines(refused.stderr)
    assert "task data of lineage 'gsm' changed" in line and str(task) in line
    assert "--accept-changed-task-data" in line and "new --lineage" in line
    assert Path(paths.state).read_bytes() == state  # nothing advanced, nothing rewound

    # Accepted: the run goes on with the new problems, and the lineage records the change.
    accepted = _run(tmp_path, task, 2, "--accept-changed-task-data")
    assert accepted.returncode == 0, accepted.stderr
    assert storage.read_state(paths).next_iteration == 3
    record = json.loads(Path(storage.join(paths.inputs, "task.json")).read_text())
    (old,) = record["history"]
    assert old["replaced_at_iteration"] == 2 and old["eval_sha256"] != record["eval_sha256"]
    assert _run(tmp_path, task, 2).returncode == 0  # the new data is the lineage's now
