"""A damaged transaction log of the replay buffer, through the real CLI: a commit entry
(`_delta_log/<version>.json`) truncated, overwritten or deleted, the whole `_delta_log/`
gone, a checkpoint of the log unreadable or deleted, `_last_checkpoint` garbled, in the
rollouts table and in the usage table.

Each ends in one line naming the file and the fix, a non-zero exit, nothing else touched
(state.json, checkpoints, data files); `replayrl buffer repair` sets the damage aside where
a readable version is left (the table reads as the version before the damage; a damaged
checkpoint of the log or `_last_checkpoint` costs nothing), and the lineage then resumes.
Where no version can be read (the first entry gone, the log deleted) nothing is moved and
the line says what can bring the rows back (a backup) or what is left (a new lineage).

At the edge itself (the last tests): errors of delta-rs, pyarrow and botocore become one
ReplayRLError naming the object, and an exception that is none of theirs (a bug) is not
dressed up as one.

The lineage (3 iterations, full checkpoints after iterations 2 and 3) is made once per
module and copied per test: its rollouts log has versions 0-9 (the last full checkpoint
pairs with version 7; 8 and 9 are the vacuum after it), its usage log versions 0-5."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from fault_helpers import PRESET, cli, crash_config, crash_overrides, ok, one_error_line

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer

pytestmark = pytest.mark.integration

# The loop of the module's lineage; a resume runs one more iteration.
LOOP = ("iterations=3", "train.checkpoint_every=2")


@dataclass
class Lineage:
    tmp: Path
    name: str

    @property
    def root(self) -> Path:
        return self.tmp / "runs"

    @property
    def paths(self) -> storage.LineagePaths:
        return storage.lineage_paths(str(self.root), self.name)

    @property
    def state_file(self) -> Path:
        return Path(self.paths.state)

    def table(self, name: str) -> Path:
        return Path(self.paths.buffer) / name

    def log(self, name: str) -> Path:
        return self.table(name) / "_delta_log"

    def entry(self, name: str, version: int) -> Path:
        return self.log(name) / f"{version:020d}.json"

    def buffer(self, command: str, *extra: str) -> subprocess.CompletedProcess:
        return cli("buffer", command, "--run-root", str(self.root), "--lineage", self.name, *extra)

    def resume(self, iterations: int = 4) -> subprocess.CompletedProcess:
        sets = crash_overrides(self.tmp, str(self.root), *LOOP, f"iterations={iterations}")
        return cli("run", "--config", str(PRESET), *[a for s in sets for a in ("--set", s)])

    def files(self) -> dict[str, bytes]:
        """Every file of the lineage, by path, but its lease and lock files, with state.json
        less its fencing epoch (a command that takes the lease raises it): what a refusal
        must keep as it was."""
        out = {}
        for p in sorted(self.root.rglob("*")):
            if not p.is_file() or p.name.endswith(".lock") or p.name == "lease.json":
                continue
            data = p.read_bytes()
            if p == self.state_file:
                state = json.loads(data)
                state.pop("epoch", None)
                data = json.dumps(state, sort_keys=True).encode()
            out[str(p.relative_to(self.root))] = data
        return out

    def rows(self, version: int | None = None) -> list[dict]:
        buf = ReplayBuffer(self.paths.buffer)
        return buf.read(version=version).sort_by("rollout_id").to_pylist()


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Lineage:
    from replayrl.engine.inline import run_inline

    tmp = tmp_path_factory.mktemp("delta-log")
    cfg = crash_config(tmp, str(tmp / "runs"), *LOOP)
    run_inline(cfg)
    made = Lineage(tmp, cfg.lineage)
    state = json.loads(made.state_file.read_text())
    assert state["checkpoint"]["rollouts_version"] == 7 and state["next_iteration"] == 4
    assert max(int(p.stem) for p in made.log("rollouts").glob("*.json")) == 9
    assert max(int(p.stem) for p in made.log("usage").glob("*.json")) == 5
    return made


@pytest.fixture
def lineage(made: Lineage, tmp_path: Path) -> Lineage:
    """A copy of the module's lineage with a tracking store of its own."""
    copy = Lineage(tmp_path, made.name)
    shutil.copytree(made.root, copy.root)
    [db] = made.tmp.glob("mlflow-*.db")
    uri = next(s for s in crash_overrides(tmp_path, str(copy.root)) if s.startswith("tracking."))
    shutil.copy(db, uri.split("sqlite:///", 1)[1])
    state = json.loads(copy.state_file.read_text())
    state["tracking_uri"] = uri.split("=", 1)[1]
    copy.state_file.write_text(json.dumps(state, indent=2, sort_keys=True))
    return copy


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garble(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 4)


def checkpoint_the_log(lineage: Lineage, table: str = "rollouts") -> Path:
    """A checkpoint of the table's log at its latest version (delta-rs writes one every 100
    commits), and its file."""
    DeltaTable(str(lineage.table(table))).create_checkpoint()
    [checkpoint] = lineage.log(table).glob("*.checkpoint.parquet")
    return checkpoint


def assert_refused_and_kept(lineage: Lineage, before: dict[str, bytes], *needles: str) -> None:
    """`buffer stats` and a resume each end in one line with `needles`; no file changed."""
    one_error_line(lineage.buffer("stats"), *needles)
    one_error_line(lineage.resume(), *needles)
    assert lineage.files() == before


# ---------------------------------------------------------------- a readable version is left


@pytest.mark.slow
@pytest.mark.parametrize(
    "table,version,damage,problem",
    [
        ("rollouts", 9, truncate, "is not valid JSON at line 1"),
        ("rollouts", 9, garble, "is not text"),
        ("usage", 5, truncate, "is not valid JSON at line 1"),
    ],
    ids=["rollouts-truncated", "rollouts-garbage", "usage-truncated"],
)
def test_a_damaged_newest_log_entry_is_named_then_set_aside_and_the_lineage_resumes(
    lineage, table, version, damage, problem
):
    checkpointed = lineage.rows(version=7)
    damage(lineage.entry(table, version))
    before = lineage.files()
    entry = f"_delta_log/{version:020d}.json"
    assert_refused_and_kept(
        lineage, before, entry, problem, "replayrl buffer repair", f"version {version - 1}"
    )

    listed = ok(lineage.buffer("repair", "--dry-run"))
    assert [json.loads(x)["path"] for x in listed.stdout.splitlines()] == [entry]
    assert lineage.files() == before
    ok(lineage.buffer("repair"))
    [kept] = (Path(lineage.paths.buffer) / "quarantine" / table).glob(
        f"_delta_log.*/{version:020d}.json"
    )
    assert kept.read_bytes() == before[str(lineage.entry(table, version).relative_to(lineage.root))]
    ok(lineage.buffer("check"))
    # What the checkpoint paired with is all there: the lost commit was the vacuum after it.
    assert lineage.rows() == checkpointed
    ok(lineage.resume())
    assert json.loads(lineage.state_file.read_text())["next_iteration"] == 5


@pytest.mark.slow
@pytest.mark.parametrize("damage", [truncate, Path.unlink], ids=["truncated", "deleted"])
def test_a_damaged_entry_inside_the_log_rolls_the_table_back_to_the_version_before_it(
    lineage, damage
):
    damage(lineage.entry("rollouts", 5))
    before = lineage.files()
    assert_refused_and_kept(
        lineage, before, "_delta_log/00000000000000000005.json", "version 4", "the 4 after it"
    )
    listed = ok(lineage.buffer("repair", "--dry-run")).stdout.splitlines()
    assert [json.loads(x)["path"] for x in listed][:5] == [
        f"_delta_log/{v:020d}.json" for v in range(5, 10)
    ]
    assert lineage.files() == before
    ok(lineage.buffer("repair"))
    # The entries before the damage are untouched (the data files version 4 named were
    # vacuumed after later versions dropped them: repair drops them too, in a commit of its
    # own).
    after = lineage.files()
    assert all(
        after[k] == before[k]
        for k in before
        if k.endswith(tuple(f"{v:020d}.json" for v in range(5)))
    )
    # The entries after the damage are kept for forensics, with the data files they added.
    quarantine = Path(lineage.paths.buffer) / "quarantine" / "rollouts"
    kept = sorted(p.name for p in quarantine.glob("_delta_log.*/*.json"))
    assert kept == [f"{v:020d}.json" for v in range(6 if damage is Path.unlink else 5, 10)]
    ok(lineage.buffer("check"))
    ok(lineage.resume())
    assert json.loads(lineage.state_file.read_text())["next_iteration"] == 5


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage,named",
    [
        (lambda lineage: checkpoint_the_log(lineage).unlink(), "_last_checkpoint names"),
        (lambda lineage: truncate(checkpoint_the_log(lineage)), ".checkpoint.parquet"),
    ],
    ids=["checkpoint-deleted", "checkpoint-truncated"],
)
def test_a_damaged_checkpoint_of_the_log_is_set_aside_losing_nothing(lineage, damage, named):
    rows = lineage.rows()
    damage(lineage)
    before = lineage.files()
    assert_refused_and_kept(lineage, before, named, "nothing is lost", "replayrl buffer repair")
    ok(lineage.buffer("repair"))
    ok(lineage.buffer("check"))
    assert DeltaTable(str(lineage.table("rollouts"))).version() == 9
    assert lineage.rows() == rows
    ok(lineage.resume())


@pytest.mark.slow
def test_a_garbled_last_checkpoint_hint_is_reported_by_check_and_set_aside(lineage):
    """delta-rs reads past a `_last_checkpoint` it cannot parse (it lists the log instead),
    so reads go on; `buffer check` still names it and repair moves it."""
    checkpoint_the_log(lineage)
    garble(lineage.log("rollouts") / "_last_checkpoint")
    rows = lineage.rows()
    check = lineage.buffer("check")
    assert check.returncode == 2 and "Traceback" not in check.stderr
    [found] = [json.loads(x) for x in check.stdout.splitlines()]
    assert found["path"] == "_delta_log/_last_checkpoint" and "not valid JSON" in found["problem"]
    ok(lineage.buffer("repair"))
    ok(lineage.buffer("check"))
    assert lineage.rows() == rows


# ---------------------------------------------------------------- no readable version


@pytest.mark.slow
@pytest.mark.parametrize(
    "table,damage,needles",
    [
        (
            "rollouts",
            lambda lineage: lineage.entry("rollouts", 0).unlink(),
            ["_delta_log/00000000000000000000.json is missing", "no version of the table"],
        ),
        (
            "rollouts",
            lambda lineage: shutil.rmtree(lineage.log("rollouts")),
            ["but no Delta log", "rollouts/_delta_log/"],
        ),
        (
            "usage",
            lambda lineage: shutil.rmtree(lineage.log("usage")),
            ["but no Delta log", "usage/_delta_log/"],
        ),
    ],
    ids=["first-entry-deleted", "rollouts-log-deleted", "usage-log-deleted"],
)
def test_a_log_no_version_can_be_read_from_is_refused_and_nothing_is_moved(
    lineage, table, damage, needles
):
    damage(lineage)
    before = lineage.files()
    fix = ["from a backup", "new --lineage"]
    # Today a deleted log made the resume start the table anew, the buffer's rows lost.
    one_error_line(lineage.resume(), *needles, *fix)
    one_error_line(lineage.buffer("repair"), *needles, *fix)
    assert lineage.files() == before
    check = lineage.buffer("check")
    assert check.returncode == 2 and "Traceback" not in check.stderr
    assert any(json.loads(x)["table"] == table for x in check.stdout.splitlines())


@pytest.mark.slow
def test_log_entries_deleted_back_past_the_checkpoint_refuse_the_rewind(lineage):
    """The newest entries gone, down to the version the last full checkpoint pairs with: the
    log reads (as version 6) but a rewind cannot reach version 7. (Entries after that
    version gone are no loss: the rewind drops them anyway, and the lineage resumes.)"""
    for version in (7, 8, 9):
        lineage.entry("rollouts", version).unlink()
    before = lineage.files()
    line = one_error_line(lineage.resume(), "version 7", "ends at version 6", "from a backup")
    assert "new --lineage" in line
    assert lineage.files() == before


# ---------------------------------------------------------------- at the edge itself


def test_the_storage_edge_translates_library_errors_and_lets_bugs_through():
    import botocore.exceptions
    from deltalake.exceptions import DeltaError

    from replayrl.errors import ReplayRLError
    from replayrl.storage.s3 import is_library_error, retry

    def raising(exc: BaseException):
        def fn():
            raise exc

        return fn

    edge = dict(action="read", uri="s3://b/k", endpoint=None, deadline_s=0)
    for exc in (
        pa.ArrowInvalid("Parquet magic bytes not found in footer"),
        DeltaError("Kernel error: Json error"),
        botocore.exceptions.ClientError({"Error": {"Code": "InternalError"}}, "GetObject"),
        OSError("Generic S3 error"),
    ):
        assert is_library_error(exc)
        with pytest.raises(ReplayRLError, match="Cannot read 's3://b/k'"):
            retry(raising(exc), **edge)
    for bug in (TypeError("unsupported operand"), AttributeError("no attribute"), KeyError("k")):
        assert not is_library_error(bug)
        with pytest.raises(type(bug)):
            retry(raising(bug), **edge)


def test_a_commit_that_keeps_losing_the_race_is_one_error_and_keeps_the_rows(tmp_path):
    from deltalake.exceptions import CommitFailedError
    from fault_helpers import rows

    from replayrl.errors import ReplayRLError

    buf = ReplayBuffer(str(tmp_path / "buf"))
    buf.append(rows(1), iteration=1)

    def lose(table, props):
        raise CommitFailedError("a concurrent transaction won")

    with pytest.raises(ReplayRLError, match="lost the race with another writer"):
        buf._commit(buf.rollouts_uri, lose, action="delete used rows from")
    assert buf.read().num_rows == 8


def test_the_mirror_trusts_nothing_across_a_log_entry_that_is_not_text(tmp_path):
    """A log entry before the table's latest checkpoint is never read by delta-rs, but the
    mirror reads the entries between two versions it syncs; one that is not text means
    'decode every added row', not a UnicodeDecodeError."""
    from fault_helpers import rows

    from replayrl.buffer.mirror import BufferMirror

    buf = ReplayBuffer(str(tmp_path / "buf"))
    for it in (1, 2, 3):
        buf.append(rows(it), iteration=it)
    table = buf._open(buf.rollouts_uri)
    garble(tmp_path / "buf" / "rollouts" / "_delta_log" / f"{1:020d}.json")
    mirror = BufferMirror(buf, columns=["reward"])
    assert mirror._written_iterations(table, first=1, last=2) is None


def test_the_buffer_itself_names_a_damaged_log_entry_and_repair_rolls_it_back(tmp_path):
    """The same, in one process and without a lineage (the fast tier's look at it): reads
    name the entry; check lists it; repair moves it and the rows of the versions before
    it read as they did."""
    from fault_helpers import rows

    from replayrl.errors import ReplayRLError

    buf = ReplayBuffer(str(tmp_path / "buf"))
    for it in (1, 2, 3):
        buf.append(rows(it), iteration=it)
    kept = buf.read(version=1).to_pylist()
    truncate(tmp_path / "buf" / "rollouts" / "_delta_log" / f"{2:020d}.json")
    fresh = ReplayBuffer(str(tmp_path / "buf"))
    with pytest.raises(ReplayRLError, match=r"00000000000000000002\.json is not valid JSON"):
        fresh.read()
    listed = fresh.check()
    assert [d.path for d in listed] == [f"_delta_log/{2:020d}.json"]
    assert fresh.repair(dry_run=True) == listed
    assert fresh.repair() == listed
    assert fresh.check() == [] and fresh.read().to_pylist() == kept
    fresh.append(rows(2), iteration=2)  # the lost iteration is written again as usual
    assert fresh.read().num_rows == 16
