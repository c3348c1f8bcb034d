"""Bad input is refused at load: `replayrl run` with a NaN, an infinity, a value out of its
range or of the wrong type in any knob family, a config or task file that is not UTF-8, is
empty or has the wrong schema, or a run root that cannot be one, exits non-zero within
seconds with exactly one `replayrl: error:` line, no traceback, and nothing written: no
lineage directory, no state, no MLflow database.

Each case runs the real command line in this process (`replayrl.cli.main.main`), so the
imports are paid once; two of them also run as a child process, as a user runs them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiny_config

from replayrl.cli.main import main
from replayrl.config import SECTIONS, load_config
from replayrl.errors import ReplayRLError

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
GOOD_ROW = {"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}

# --set overrides refused when the config is loaded, one per class of bad input.
KNOBS = {
    # NaN and infinities, per family of float knobs
    "optimizer lr nan": ["train.lr=nan"],
    "optimizer lr inf": ["train.lr=inf"],
    "optimizer lr yaml .inf": ["train.lr=.inf"],
    "adam beta1 nan": ["train.adam_beta1=nan"],
    "weight decay -inf": ["train.weight_decay=-inf"],
    "grad clip nan": ["train.grad_clip=nan"],
    "loss delta_v nan (no range, still finite)": ["train.delta_v=nan"],
    "loss clip_eps inf": ["train.clip_eps=inf"],
    "rollout temperature nan": ["rollout.temperature=nan"],
    "rollout top_p nan": ["rollout.top_p=nan"],
    "vllm memory share inf": ["rollout.vllm_gpu_memory_utilization=inf"],
    "eval temperature -inf": ["eval.temperature=-inf"],
    "eval pass1_temperature nan": ["eval.pass1_temperature=nan"],
    "buffer positive_bias nan": ["buffer.positive_bias=nan"],
    "buffer grace inf": ["buffer.vacuum_grace_s=inf"],
    "warm start lr inf": ["model.warm_start_lr=inf"],
    "warm start target nan": ["model.warm_start_target_pass1=nan"],
    "async segment seconds nan": ["asynchronous.segment_seconds=nan"],
    "huge float overflows to inf": ["train.lr=1e999"],
    # ranges
    "adam beta2 = 1": ["train.adam_beta2=1.0"],
    "adam beta1 < 0": ["train.adam_beta1=-0.1"],
    "weight decay < 0": ["train.weight_decay=-5"],
    "temperature 0": ["rollout.temperature=0"],
    "clip_eps 1.5": ["train.clip_eps=1.5"],
    "grace < 0": ["buffer.vacuum_grace_s=-1"],
    "file size 0": ["buffer.target_file_bytes=0"],
    "compaction file count 0": ["buffer.compact_min_files=0"],
    "positive bias > 1": ["buffer.positive_bias=1.5"],
    "eval nucleus > 1": ["eval.pass1_top_p=1.5"],
    "micro-batch tokens < 0": ["train.micro_batch_tokens=-1"],
    "attention heads 0 (was a division by zero)": ["model.num_heads=0"],
    "is_cap <= 0": ["train.loss=asymre", "train.is_cap=-1"],
    "negative seed": ["seed=-1"],
    "iterations 0": ["iterations=0"],
    "retry backoff < 0": ["kubernetes.retry_backoff_s=-1"],
    # wrong types and shapes
    "lr not a number": ["train.lr=abc"],
    "batch size not an integer": ["train.batch_size=1.5"],
    "batch size a word": ["train.batch_size=many"],
    "integer overflowing as a float": ["iterations=1e999"],
    "bool not a bool": ["buffer.sample_with_replacement=maybe"],
    "section not a mapping": ["train=5"],
    "options not a mapping": ["task.options=5"],
    "unknown key": ["train.lrr=0.1"],
    "override without =": ["train.lr"],
    "key under a value": ["train.lr.x=1"],
}


def refused(tmp_path: Path, capsys, args: list[str], root: Path) -> str:
    """Run `replayrl run ...` with the tiny loop under `root` (nothing of it should run);
    assert the refusal; return its one error line."""
    loop = [*tiny_config.MODEL, *tiny_config.TASK, *tiny_config.LOOP]
    argv = ["run", "--config", str(PRESET), "--run-root", str(root)]
    argv += [f"--set=model.cache_dir={tmp_path / 'cache'}", *(f"--set={s}" for s in loop)]
    start = time.monotonic()
    code = main([*argv, *args])
    seconds = time.monotonic() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("replayrl: error:")]
    assert code != 0 and len(lines) == 1, err
    assert "Traceback" not in err
    assert seconds < 60, f"refused after {seconds:.0f} s"
    return lines[0]


def assert_nothing_written(root: Path) -> None:
    """No lineage directory, state, lease or MLflow database: the run root is absent or
    empty (a probe of its writability is removed again)."""
    if root.is_dir():
        assert sorted(p.relative_to(root) for p in root.rglob("*")) == []


@pytest.mark.parametrize("overrides", list(KNOBS.values()), ids=list(KNOBS))
def test_bad_knobs_are_refused_at_load(tmp_path, capsys, overrides):
    root = tmp_path / "runs"
    line = refused(tmp_path, capsys, [f"--set={s}" for s in overrides], root)
    key = overrides[-1].split("=", 1)[0]
    assert key.split(".")[0] in line or "--set" in line, line
    assert not root.exists()


def test_every_float_knob_refuses_nan_and_infinity():
    """The generic check covers every float knob there is, not only those listed above."""
    floats = [
        f"{name}.{f.name}"
        for name, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if "float" in str(f.type)
    ]
    assert len(floats) > 20
    for key in floats:
        for value in ("nan", "inf", "-inf"):
            with pytest.raises(ReplayRLError, match=f"^{re.escape(key)} must be a finite number"):
                load_config(PRESET, overrides=[f"{key}={value}"])


# --------------------------------------------------------------- config files


CONFIG_FILES = {
    "not UTF-8": (b"arm: replay\nseed: 0  # caf\xe9\n", "not UTF-8 text: byte 0xe9 at line 2"),
    "malformed YAML": (b"train:\n  lr: [1e-4\n", "Malformed YAML"),
    "a list, not a mapping": (b"- 1\n- 2\n", "must be a YAML mapping"),
    "a NaN in the file": (b"train:\n  lr: .nan\n", "train.lr must be a finite number"),
    "an unknown section": (b"trian:\n  lr: 0.1\n", "Did you mean 'train'"),
}


@pytest.mark.parametrize("name", list(CONFIG_FILES))
def test_bad_config_files_are_refused(tmp_path, capsys, name):
    data, expected = CONFIG_FILES[name]
    config = tmp_path / "bad.yaml"
    config.write_bytes(data)
    root = tmp_path / "runs"
    code = main(["run", "--config", str(config), "--run-root", str(root)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("replayrl: error:")]
    assert code != 0 and len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in err and not root.exists()


# --------------------------------------------------------------- task files

GOOD = json.dumps(GOOD_ROW).encode() + b"\n"
FOLDER = object()  # the task path is a folder


def parquet(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


# name -> (file name, its bytes, None (no file) or FOLDER, what the error says besides its path)
TASK_FILES = {
    "jsonl not UTF-8": (
        "train.jsonl",
        GOOD + b'{"question": "caf\xe9", "answer": "#### 1"}\n',
        "not UTF-8 text: byte 0xe9 at line 2, column 18",
    ),
    "jsonl empty": ("train.jsonl", b"", "is empty"),
    "jsonl only blank lines": ("train.jsonl", b"\n   \n\n", "is empty"),
    "jsonl not JSON": ("train.jsonl", GOOD + b"{question: 1}\n", "line 2: not valid JSON"),
    "jsonl row not an object": ("train.jsonl", b"[1, 2]\n", "line 1: expected a JSON object"),
    "jsonl wrong schema": (
        "train.jsonl",
        b'{"question": "1 + 1?", "solution": "2"}\n',
        "line 1: missing or non-text column 'answer'",
    ),
    "jsonl wrong type": (
        "train.jsonl",
        b'{"question": 7, "answer": "#### 7"}\n',
        "line 1: missing or non-text column 'question'",
    ),
    "parquet wrong schema": (
        "train.parquet",
        parquet(pa.table({"prompt": ["1 + 1?"], "answer": ["#### 2"]})),
        "missing column 'question'",
    ),
    "parquet no rows": (
        "train.parquet",
        parquet(
            pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())})
        ),
        "has no rows",
    ),
    "parquet not Parquet": ("train.parquet", GOOD, "not a readable Parquet file"),
    "wrong suffix": ("train.csv", b"question,answer\n", "must end in .jsonl or .parquet"),
    "missing file": ("absent.jsonl", None, "does not exist"),
    "a folder, not a file": ("folder.jsonl", FOLDER, ""),
}


@pytest.mark.parametrize("name", list(TASK_FILES))
def test_bad_task_files_are_refused_naming_the_file(tmp_path, capsys, name):
    file_name, data, expected = TASK_FILES[name]
    path = tmp_path / "data" / file_name
    path.parent.mkdir()
    if data is FOLDER:
        path.mkdir()
    elif data is not None:
        path.write_bytes(data)
    root = tmp_path / "runs"
    args = ["--set=task.name=gsm8k", f"--set=task.path={path}", "--set=task.options={}"]
    line = refused(tmp_path, capsys, args, root)
    assert str(path) in line and expected in line, line
    assert_nothing_written(root)


# Options of a generated task: read when the lineage opens, before it writes anything.
TASK_OPTIONS = {
    "option not an integer": ("task.options.min_digits=abc", "must be int"),
    "option a fraction": ("task.options.max_terms=2.5", "must be int"),
    "option out of range": ("task.options.min_digits=-3", "min_digits must be positive"),
    "option unknown": ("task.options.digits=2", "unknown option(s) ['digits']"),
}


@pytest.mark.parametrize("name", list(TASK_OPTIONS))
def test_bad_task_options_are_refused(tmp_path, capsys, name):
    override, expected = TASK_OPTIONS[name]
    root = tmp_path / "runs"
    line = refused(tmp_path, capsys, [f"--set={override}"], root)
    assert "task 'chain_sum'" in line and expected in line, line
    assert_nothing_written(root)


# --------------------------------------------------------------- run roots


def test_a_run_root_that_is_a_file_is_refused(tmp_path, capsys):
    root = tmp_path / "runs"
    root.write_text("not a folder")
    line = refused(tmp_path, capsys, [], root)
    assert str(root) in line and "cannot be written" in line, line
    assert root.read_text() == "not a folder"


def test_a_run_root_under_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    root = tmp_path / "file" / "runs"
    line = refused(tmp_path, capsys, [], root)
    assert str(root) in line, line
    assert (tmp_path / "file").read_text() == "not a folder"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes any folder")
def test_a_run_root_without_permission_is_refused(tmp_path, capsys):
    root = tmp_path / "runs"
    root.mkdir(mode=0o500)
    try:
        line = refused(tmp_path, capsys, [], root)
    finally:
        root.chmod(0o700)
    assert str(root) in line, line
    assert_nothing_written(root)


def test_a_lineage_path_that_is_a_file_is_refused_before_anything_is_written(tmp_path, capsys):
    root = tmp_path / "runs"
    root.mkdir()
    (root / "alpha").write_text("not a folder")
    refused(tmp_path, capsys, ["--lineage=alpha", "--set=model.warm_start_max_steps=0"], root)
    assert sorted(p.name for p in root.iterdir()) == ["alpha"]


# --------------------------------------------------------------- as a user runs it


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--set", "train.lr=nan"], "train.lr must be a finite number in (0, 1], got nan."),
        (["--set", "train.weight_decay=-5"], "train.weight_decay must be >= 0, got -5.0."),
        pytest.param(
            ["--set", "task.name=gsm8k", "--set", "task.path={bad}", "--set", "task.options={}"],
            "task file '{bad}' is not UTF-8 text: byte 0xff at line 1, column 1; save it as UTF-8",
            marks=pytest.mark.slow,  # the engine's imports: ~12 s on two cores
            id="task file not UTF-8",
        ),
    ],
)
def test_the_command_refuses_in_a_child_process(tmp_path, args, expected):
    root, bad = tmp_path / "runs", tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\n")
    args = [a.replace("{bad}", str(bad)) for a in args]
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "replayrl.cli.main", "run", "--config", str(PRESET)]
        + ["--run-root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and time.monotonic() - start < 60
    errors = [line for line in done.stderr.splitlines() if line.startswith("replayrl: error:")]
    assert errors == [f"replayrl: error: {expected.replace('{bad}', str(bad))}"], done.stderr
    assert "Traceback" not in done.stderr
    assert_nothing_written(root)
