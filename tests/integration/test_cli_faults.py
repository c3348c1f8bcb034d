"""Faults a user (or a script) makes through the command line, run as a user runs them (a
child `python -m replayrl.cli.main`): each ends in exactly one `replayrl: error:` line, no
traceback, a non-zero exit, and nothing of the lineage changed.

- numeric arguments: NaN, ±inf, `1e999`, values out of range and integers beyond 64 bits, in
  every command that takes a number (`replayrl.cli.args.number`);
- `state.json` edited by hand: a field of the wrong type, a checkpoint record missing a key,
  refused naming the field, before the lineage is fenced or anything read; a checkpoint
  folder state.json names, gone: the message says what can bring the lineage back;
- odd lineage names: refused before anything is written, or (a '.') working end to end;
- maintenance commands beside a live run: the ones that write refuse, naming the run that
  holds the lineage's lease, and the live run goes on unharmed; the read-only ones are safe;
- edge values of settings (`--set`): integers beyond 64 bits and floats beyond float32 are
  refused at load; a vacuum grace longer than any file's age keeps every file.

One lineage is built per module (the suite's tiny config, two iterations) and each test
works on a copy of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import fault_helpers
import pytest
from fault_helpers import crash_config, crash_overrides

from replayrl import storage
from replayrl.config import SECTIONS, load_config
from replayrl.errors import ReplayRLError
from replayrl.storage import lease

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


def cli(*args: str, tmp: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """`fault_helpers.cli`, logging to a file of this test's own."""
    env = {**os.environ, "REPLAYRL_LOG_FILE": str(tmp / "replayrl.log")}
    return fault_helpers.cli(*args, env=env, timeout=timeout)


def refused(proc: subprocess.CompletedProcess, *words: str, only: bool = False) -> str:
    """Assert `proc` was refused with one `replayrl: error:` line (its last line on stderr;
    `only`: the whole of stderr) holding every one of `words`, exit 2, and no traceback;
    return the line."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("replayrl: error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == lines[0]
    if only:
        assert proc.stderr.strip() == lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- one lineage per module


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """A lineage of two committed iterations (a full checkpoint each) with its own store."""
    from replayrl.engine.inline import run_inline

    base = tmp_path_factory.mktemp("built")
    cfg = crash_config(base, str(base / "runs"), "iterations=2")
    run_inline(cfg)
    return base, cfg.lineage


@dataclass
class Lineage:
    tmp: Path  # holds runs/ and the lineage's MLflow store
    root: str  # the run root
    name: str

    @property
    def paths(self) -> storage.LineagePaths:
        return storage.lineage_paths(self.root, self.name)

    @property
    def dir(self) -> Path:
        return Path(self.root) / self.name

    def state(self) -> dict:
        return json.loads((self.dir / "state.json").read_text())

    def write_state(self, data: dict) -> None:
        (self.dir / "state.json").write_text(json.dumps(data, indent=2))

    def files(self, *, epoch: bool = True) -> dict[str, str]:
        """sha256 of every file of the lineage (not the lease, nor lock files); `epoch`
        False leaves state.json's fencing epoch out (a run that takes the lease raises it)."""
        out = {}
        for f in sorted(self.dir.rglob("*")):
            if not f.is_file() or f.name == "lease.json" or f.name.startswith("."):
                continue
            rel = str(f.relative_to(self.dir))
            data = f.read_bytes()
            if rel == "state.json" and not epoch:
                state = json.loads(data)
                state.pop("epoch")
                data = json.dumps(state, sort_keys=True).encode()
            out[rel] = hashlib.sha256(data).hexdigest()
        return out

    def run_args(self, *extra: str) -> list[str]:
        """`replayrl run` of this lineage (the tiny loop), extended to `iterations=3`."""
        sets = crash_overrides(self.tmp, self.root, "iterations=3", *extra)
        return ["run", "--config", str(PRESET), *(x for s in sets for x in ("--set", s))]

    def buffer(self, command: str, *extra: str) -> list[str]:
        return ["buffer", command, "--run-root", self.root, "--lineage", self.name, *extra]


@pytest.fixture
def lineage(built, tmp_path) -> Lineage:
    """A copy of the module's lineage, its state pointing at the copy's MLflow store."""
    base, name = built
    copy = tmp_path / "l"
    shutil.copytree(base, copy)
    state = copy / "runs" / name / "state.json"
    state.write_text(state.read_text().replace(str(base), str(copy)))
    return Lineage(tmp=copy, root=str(copy / "runs"), name=name)


# ---------------------------------------------------------------- numeric arguments


# (arguments, the flag the line names); "{root}" and "{lineage}" are the lineage copy's.
ON_THE_LINEAGE = {
    "vacuum grace nan": (["vacuum", "--grace-s", "nan"], "--grace-s"),
    "vacuum grace inf": (["vacuum", "--grace-s", "inf"], "--grace-s"),
    "vacuum grace 1e999": (["vacuum", "--grace-s", "1e999"], "--grace-s"),
    "vacuum grace < 0": (["vacuum", "--grace-s=-1"], "--grace-s"),
    "inspect limit < 0": (["inspect", "--limit=-1"], "--limit"),
    "inspect limit > 64 bits": (["inspect", "--limit", "99999999999999999999"], "--limit"),
}


@pytest.mark.parametrize("args,flag", list(ON_THE_LINEAGE.values()), ids=list(ON_THE_LINEAGE))
def test_a_bad_number_in_a_buffer_command_is_refused_and_changes_nothing(lineage, args, flag):
    before = lineage.files()
    proc = cli(*lineage.buffer(args[0], *args[1:]), tmp=lineage.tmp)
    line = refused(proc, flag, only=True)
    assert line.startswith("replayrl: error: replayrl buffer: argument ")
    assert lineage.files() == before


ELSEWHERE = {
    "run iterations nan": (["run", "--config", str(PRESET), "--iterations", "nan"], "--iterations"),
    "plan prompt tokens 0": (
        ["plan", "--config", str(PRESET), "--prompt-tokens", "0"],
        "--prompt-tokens",
    ),
    "register version < 0": (
        ["register", "--run-root", "{out}", "--lineage", "l", "--version=-1"],
        "--version",
    ),
    "compile iterations 1e999": (
        ["compile", "--out", "{out}", "--iterations", "1e999"],
        "--iterations",
    ),
    "sweep report rho nan": (["sweep", "report", "--out", "{out}", "--rho", "nan"], "--rho"),
    "sweep seeds 0": (
        ["sweep", "run", "--config", str(PRESET), "--out", "{out}", "--seeds", "0"],
        "--seeds",
    ),
    "advise mu inf": (["advise", "--mu", "inf", "--rho", "0.5", "--alpha", "0.25"], "--mu"),
    "compare target 1.5": (["compare", "--out", "{out}", "--target", "1.5"], "--target"),
    "experiment seeds 0": (
        ["experiment", "--config", str(PRESET), "--out", "{out}", "--seeds", "0"],
        "--seeds",
    ),
    "submit iterations > 64 bits": (["submit", "--iterations", str(2**64)], "--iterations"),
}


@pytest.mark.parametrize("args,flag", list(ELSEWHERE.values()), ids=list(ELSEWHERE))
def test_a_bad_number_in_any_command_is_refused_before_it_does_anything(tmp_path, args, flag):
    out = tmp_path / "out"
    proc = cli(*(a.replace("{out}", str(out)) for a in args), tmp=tmp_path)
    refused(proc, f"argument {flag}: must be", only=True)
    assert not out.exists()


# ---------------------------------------------------------------- state.json by hand


def _set(path: str, value):
    """An edit of state.json: `path` a dotted key ("checkpoint.ledger"), `value` its new
    value (DELETE: the key removed)."""

    def edit(state: dict) -> None:
        *parents, key = path.split(".")
        target = state
        for p in parents:
            target = target[p]
        if value is DELETE:
            del target[key]
        else:
            target[key] = value

    return edit


DELETE = object()
STATE_EDITS = {
    "next_iteration a string": (_set("next_iteration", "3"), "next_iteration"),
    "policy_version < 0": (_set("policy_version", -1), "policy_version"),
    "epoch a float": (_set("epoch", 1.5), "epoch"),
    "mlflow run id a number": (_set("mlflow_run_id", 7), "mlflow_run_id"),
    "ledger value a string": (_set("ledger.wall_seconds", "long"), "ledger.wall_seconds"),
    "checkpoint without rollouts_version": (
        _set("checkpoint.rollouts_version", DELETE),
        "'rollouts_version'",
    ),
    "checkpoint without ledger": (_set("checkpoint.ledger", DELETE), "'ledger'"),
    "checkpoint a string": (_set("checkpoint", "v000002"), "checkpoint must be"),
    "checkpoint past next_iteration": (_set("checkpoint.iteration", 7), "checkpoint.iteration"),
    "last_metrics groups not a list": (_set("last_metrics.groups", {}), "last_metrics.groups"),
}


@pytest.mark.parametrize("edit,field", list(STATE_EDITS.values()), ids=list(STATE_EDITS))
def test_a_hand_edited_state_is_refused_naming_the_field(lineage, edit, field):
    state = lineage.state()
    edit(state)
    lineage.write_state(state)
    before = lineage.files()
    # vacuum: it reads the checkpoint record to keep what a rewind needs
    proc = cli(*lineage.buffer("vacuum", "--grace-s", "0"), tmp=lineage.tmp)
    line = refused(proc, "state.json' is not valid", field, "start a new --lineage", only=True)
    assert lineage.files() == before, line
    with pytest.raises(ReplayRLError, match=re.escape(field)):
        storage.read_state(lineage.paths)


def test_a_hand_edited_state_stops_a_run_before_it_fences_the_lineage(lineage):
    """The issue's case: `next_iteration` as a string was a TypeError traceback once the run
    compared it. Now refused when the run first reads the state, and the lease's fencing
    (which rewrites state.json with a higher epoch) refuses it too, so state.json keeps its
    bytes."""
    state = lineage.state()
    state["next_iteration"] = "3"
    lineage.write_state(state)
    before = lineage.files()
    proc = cli(*lineage.run_args(), tmp=lineage.tmp)
    refused(proc, 'next_iteration must be an integer >= 1, got "3"')
    assert lineage.files() == before


@pytest.mark.slow
def test_a_checkpoint_gone_from_under_state_json_says_what_can_bring_the_lineage_back(lineage):
    """Its folder deleted: resuming cannot write a committed checkpoint again (the old advice
    said it would); the line names the previous complete checkpoint to start from."""
    newest = lineage.dir / "checkpoints" / "v000002"
    assert newest.is_dir() and (lineage.dir / "checkpoints" / "v000000").is_dir()
    shutil.rmtree(newest)
    before = lineage.files(epoch=False)
    proc = cli(*lineage.run_args(), tmp=lineage.tmp)
    line = refused(proc, "v000002' is gone", "put the folder back", "new --lineage")
    assert "runs again" not in line
    assert f"model.source={lineage.paths.checkpoint(0)}" in line
    assert lineage.files(epoch=False) == before
    assert lineage.state()["next_iteration"] == 3


# ---------------------------------------------------------------- lineage names


ODD_NAMES = {
    "space": "my lineage",
    "unicode": "linéage",
    "dot-dot": "..",
    "leading dot": ".hidden",
    "leading dash": "-x",
    "empty": "",
    "too long": "x" * 200,
    "shell": "a;rm -rf b",
    "substitution": "$(touch pwned)",
    "backslash (a separator on S3 paths of delta-rs)": "a\\b",
    "newline": "a\nb",
    "slash": "a/b",
}


@pytest.mark.parametrize("name", list(ODD_NAMES.values()), ids=list(ODD_NAMES))
def test_an_odd_lineage_name_is_refused_before_anything_is_written(tmp_path, name):
    root = tmp_path / "runs"
    sets = crash_overrides(tmp_path, str(root), "iterations=1")  # a name let through: quick
    run = ["run", "--config", str(PRESET), *(x for s in sets for x in ("--set", s))]
    run.append(f"--lineage={name}")
    line = refused(cli(*run, tmp=tmp_path), "argument --lineage: Lineage name", only=True)
    assert "is not valid" in line and "e.g. '" in line
    buffer = ["buffer", "stats", "--run-root", str(root), f"--lineage={name}"]
    refused(cli(*buffer, tmp=tmp_path), "argument --lineage: Lineage name", only=True)
    assert written(tmp_path) == []


def test_an_odd_lineage_name_from_the_config_is_refused_before_anything_is_written(tmp_path):
    """A name from the config file or `--set storage.lineage` meets the same check when the
    lineage's layout is made, before its run root, state or MLflow store. 'a\\b' made a
    folder of that name, then delta-rs read it as 'a/b' and failed."""
    root = tmp_path / "runs"
    sets = crash_overrides(tmp_path, str(root), "iterations=1", "storage.lineage=a\\b")
    proc = cli(
        "run", "--config", str(PRESET), *(x for s in sets for x in ("--set", s)), tmp=tmp_path
    )
    refused(proc, "Lineage name 'a\\\\b' is not valid")
    assert written(tmp_path) == []


def written(tmp_path: Path) -> list[str]:
    """What is under `tmp_path` but the CLI's log file: no run root, no MLflow store."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name != "replayrl.log")


@pytest.mark.slow
def test_a_lineage_name_with_dots_runs_end_to_end(tmp_path):
    """'.' is allowed (sweep labels such as lr0.0001 have one); MLflow refuses it in a
    logged model's name, which failed the lineage at its first checkpoint."""
    name = "lr0.0001.v2"
    root = tmp_path / "runs"
    sets = crash_overrides(tmp_path, str(root), "iterations=1")
    run = ["run", "--config", str(PRESET), *(x for s in sets for x in ("--set", s))]
    proc = cli(*run, "--lineage", name, tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = storage.read_state(storage.lineage_paths(str(root), name))
    assert state is not None and state.next_iteration == 2 and state.lineage == name
    stats = cli("buffer", "stats", "--run-root", str(root), "--lineage", name, tmp=tmp_path)
    assert stats.returncode == 0 and json.loads(stats.stdout)["rows"] > 0


# ---------------------------------------------------------------- beside a live run

HOLDER = """
import sys
from replayrl import storage
from replayrl.storage import lease
paths = storage.lineage_paths(sys.argv[1], sys.argv[2])
with lease.held(paths, owner=lease.inline_owner(), ttl_s=60) as holder:
    holder.hold()
    print(lease.read(paths).owner, flush=True)
    sys.stdin.read()
"""


def test_maintenance_beside_a_holder_of_the_lease_refuses_or_only_reads(lineage):
    """A process holding the lineage's lease (what a live run does from open to exit):
    vacuum and repair refuse with one line naming it, writing nothing, not even a new
    fencing epoch (which would stop the live run); dry runs and the read-only commands run
    and change nothing; once the holder is gone, vacuum runs."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, lineage.root, lineage.name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        owner = holder.stdout.readline().strip()
        assert owner.startswith("inline:") and f":{holder.pid}:" in owner
        before = lineage.files()
        taken = (lineage.dir / "lease.json").read_bytes()
        for args in (["vacuum", "--grace-s", "0"], ["repair"]):
            proc = cli(*lineage.buffer(*args), tmp=lineage.tmp)
            refused(proc, f"is being advanced by run '{owner}'", "stops before writing anything")
        for args in (
            ["vacuum", "--grace-s", "0", "--dry-run"],
            ["repair", "--dry-run"],
            ["stats"],
            ["check"],
            ["inspect", "--limit", "2"],
        ):
            proc = cli(*lineage.buffer(*args), tmp=lineage.tmp)
            assert proc.returncode == 0, (args, proc.stderr[-2000:])
        assert lineage.files() == before
        assert (lineage.dir / "lease.json").read_bytes() == taken
        assert holder.poll() is None
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    assert cli(*lineage.buffer("vacuum", "--grace-s", "0"), tmp=lineage.tmp).returncode == 0


@pytest.mark.slow
def test_maintenance_beside_a_live_run_leaves_the_run_unharmed(lineage):
    """A real run extending the lineage by six iterations; vacuum and repair in the middle
    of it are refused naming it, and the run ends as it would have alone."""
    run = subprocess.Popen(
        [sys.executable, "-m", "replayrl.cli.main", *lineage.run_args("iterations=8")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "REPLAYRL_LOG_FILE": str(lineage.tmp / "run.log")},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            held = lease.read(lineage.paths)
            if held is not None and f":{run.pid}:" in held.owner:
                break
            assert run.poll() is None and time.monotonic() < deadline, "the run took no lease"
            time.sleep(0.2)
        for args in (["vacuum", "--grace-s", "0"], ["repair"]):
            proc = cli(*lineage.buffer(*args), tmp=lineage.tmp)
            refused(proc, f"is being advanced by run '{held.owner}'")
        assert run.poll() is None, "the run ended before the maintenance commands were tried"
        _, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, err[-3000:]
    state = storage.read_state(lineage.paths)
    assert state is not None and state.next_iteration == 9 and state.policy_version == 8
    assert cli(*lineage.buffer("check"), tmp=lineage.tmp).returncode == 0


# ---------------------------------------------------------------- edge values of settings


def _knobs(kind: str) -> list[str]:
    return [
        f"{name}.{f.name}" if name else f.name
        for name, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if str(f.type) in (kind, f"{kind} | None")
    ]


def test_every_int_knob_refuses_an_integer_beyond_64_bits():
    """Python's ints have no limit, numpy's, torch's and Arrow's do: `buffer.capacity=1e23`
    loaded, and rollout.max_new_tokens=10**23 failed torch at the first generation."""
    ints = _knobs("int")
    assert len(ints) > 20
    for key in ints:
        for value in (2**63, -(2**63) - 1, 10**23):
            with pytest.raises(ReplayRLError, match=f"^{re.escape(key)} must be"):
                load_config(PRESET, overrides=[f"{key}={value}"])


def test_every_float_knob_refuses_a_value_beyond_float32():
    """train.lr=1e300 loaded and failed torch's optimizer at the first step."""
    floats = _knobs("float")
    assert len(floats) > 20
    for key in floats:
        with pytest.raises(ReplayRLError, match=f"^{re.escape(key)} must be"):
            load_config(PRESET, overrides=[f"{key}=1e300"])


EDGE_SETTINGS = {
    "max_new_tokens beyond 64 bits (was torch's TypeError)": "rollout.max_new_tokens=" + "9" * 23,
    "lr beyond float32 (was torch's RuntimeError)": "train.lr=1e300",
    "capacity beyond 64 bits (was loaded)": "buffer.capacity=" + "9" * 23,
    "eval every beyond 64 bits (was loaded)": "eval.every=" + "9" * 23,
    "lr 0 (already refused)": "train.lr=0",
    "capacity -1 (already refused)": "buffer.capacity=-1",
    "positive bias nan (already refused)": "buffer.positive_bias=nan",
}


@pytest.mark.parametrize("setting", list(EDGE_SETTINGS.values()), ids=list(EDGE_SETTINGS))
def test_an_edge_value_of_a_setting_is_refused_at_load_of_an_existing_lineage(lineage, setting):
    before = lineage.files()
    proc = cli(*lineage.run_args(setting), tmp=lineage.tmp)
    refused(proc, f"{setting.split('=')[0]} must be")
    assert lineage.files() == before  # the epoch too: refused before the lease is taken


def test_a_vacuum_grace_longer_than_any_file_keeps_every_file(lineage):
    """delta-rs panics (a PanicException, past every `except Exception`) on a grace of about
    10^15 hours or more, and Python's ceil overflows on 1e300 / 3600: a grace longer than
    any file's age is one that keeps every file."""
    before = lineage.files(epoch=False)  # vacuum takes the lease: a new fencing epoch
    for grace in ("1e19", "1e300"):
        proc = cli(*lineage.buffer("vacuum", "--grace-s", grace), tmp=lineage.tmp)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert json.loads(proc.stdout) == {"rollouts": [], "usage": []}
    after = lineage.files(epoch=False)
    assert {k: v for k, v in after.items() if "_delta_log" not in k} == {
        k: v for k, v in before.items() if "_delta_log" not in k
    }


@pytest.mark.slow
def test_a_run_with_a_vacuum_grace_of_centuries_compacts_and_keeps_every_file(tmp_path):
    """buffer.vacuum_grace_s = 1e30 (a legal setting) through the bin-pack's vacuum and the
    one after every full checkpoint: it was an OverflowError after the first commit."""
    root = tmp_path / "runs"
    sets = crash_overrides(tmp_path, str(root), "iterations=2", "buffer.vacuum_grace_s=1e30")
    proc = cli(
        "run", "--config", str(PRESET), *(x for s in sets for x in ("--set", s)), tmp=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [name] = [p.name for p in root.iterdir() if (p / "state.json").exists()]
    paths = storage.lineage_paths(str(root), name)
    state = storage.read_state(paths)
    assert state is not None and state.next_iteration == 3
    from deltalake import DeltaTable

    from replayrl.buffer.table import ReplayBuffer

    buf = ReplayBuffer(paths.buffer)
    assert buf.check() == []
    # the bin-pack replaced the first iterations' files; with this grace none was deleted,
    # so every version still reads back
    latest = buf._open(buf.rollouts_uri).version()
    rows = [DeltaTable(buf.rollouts_uri, version=v).count() for v in range(latest + 1)]
    assert latest >= 2 and rows[0] == 32 and rows[-1] == 64, rows
    for v in range(latest + 1):
        assert DeltaTable(buf.rollouts_uri, version=v).to_pyarrow_table().num_rows == rows[v]
