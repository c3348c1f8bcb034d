"""BufferMirror on real Delta tables (local and a real S3 server): after every kind of commit
the buffer makes (appends, a retried iteration, FIFO and positive-bias retention deletes,
bin-pack, vacuum, restore, an older version) its sample equals `ReplayBuffer.sample` for
both modes and several seeds, an append decodes only the new rows, a rewrite decodes none,
and a failed sync leaves the mirror as it was."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from replayrl import storage
from replayrl.buffer.mirror import SEGMENT_ROWS, BufferMirror
from replayrl.buffer.schema import ROLLOUT_SCHEMA, rollout_id
from replayrl.buffer.table import ReplayBuffer
from replayrl.engine.steps import TRAIN_COLUMNS
from replayrl.errors import ReplayRLError

pytestmark = pytest.mark.integration


def make_rows(iteration: int, n_prompts: int = 3, group_size: int = 4, *, salt: int = 0):
    """n_prompts x group_size valid rows of `iteration`; every third row correct. `salt`
    changes every value but the ids (a retried generation that sampled differently)."""
    rows = []
    for p in range(n_prompts):
        for s in range(group_size):
            k = p * group_size + s
            n_tokens = 1 + (k + salt) % 3
            correct = (k + salt) % 3 == 0
            rows.append(
                {
                    "rollout_id": rollout_id(
                        lineage="mirror", iteration=iteration, prompt_index=p, sample_index=s
                    ),
                    "lineage": "mirror",
                    "iteration": iteration,
                    "policy_version": iteration,
                    "prompt_id": f"p{p}",
                    "group_id": f"{iteration}-{p}",
                    "prompt": f"{p} + {p} =",
                    "completion": f" {2 * p + salt}",
                    "prompt_token_ids": [1, 2, p + salt],
                    "completion_token_ids": list(range(salt, salt + n_tokens)),
                    "behavior_logprobs": [-0.5 - salt] * n_tokens,
                    "reward": float(correct),
                    "correct": correct,
                    "advantage": (1.0 if correct else -1.0) + salt,
                    "finish_reason": "stop",
                    "created_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
                }
            )
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)


def assert_same_samples(buffer: ReplayBuffer, mirrors: dict, version: int) -> None:
    """Every mirror's sample equals the buffer's for both modes, two seeds and a few shapes
    (the mirror of one column against the buffer's draw of every column, cut to it)."""
    n = buffer.read(version=version, columns=["rollout_id"]).num_rows
    draws = [
        dict(mode="uniform", batch_size=min(7, n), num_batches=3),
        dict(mode="uniform", batch_size=n + 3, num_batches=2, replace=True),
        dict(mode="epoch", batch_size=max(1, n // 3), num_batches=3),
    ]
    for seed in (0, 7):
        for draw in draws:
            wants = {}
            for key, mirror in mirrors.items():
                columns = None if key is None else list(key)
                args = dict(version=version, seed=seed, **draw)
                if key is None or len(key) > 1:
                    want = wants[key] = buffer.sample(columns=columns, **args)
                else:
                    want = [w.select(columns) for w in wants[None]]
                got = mirror.sample(columns=columns, **args)
                assert mirror.version == version
                assert len(got) == len(want)
                for g, w in zip(got, want, strict=True):
                    assert g.schema.equals(w.schema, check_metadata=True), (g.schema, w.schema)
                    assert g.equals(w), (args, g.to_pylist(), w.to_pylist())


def mirrors_of(buffer: ReplayBuffer, **kwargs) -> dict:
    """Mirrors by the columns they are sampled for: the trainer's, every column (None),
    one column (the keys are kept anyway, but not returned)."""
    return {
        None: BufferMirror(buffer, columns=ROLLOUT_SCHEMA.names, **kwargs),
        tuple(TRAIN_COLUMNS): BufferMirror(buffer, columns=TRAIN_COLUMNS, **kwargs),
        ("reward",): BufferMirror(buffer, columns=["reward"], **kwargs),
    }


def sync_all(mirrors: dict, version: int | None = None) -> list:
    return [m.sync(version) for m in mirrors.values()]


@pytest.mark.parametrize("segment_rows", [SEGMENT_ROWS, 10])
def test_mirror_follows_every_buffer_operation(tmp_path: Path, segment_rows: int):
    buffer = ReplayBuffer(str(tmp_path / "buf"))
    mirrors = mirrors_of(buffer, segment_rows=segment_rows)
    sizes = {0: 3, 1: 2, 2: 3, 3: 1, 4: 3}  # prompts per iteration: 12, 8, 12, 4, 12 rows

    def check(version: int) -> None:
        assert_same_samples(buffer, mirrors, version)

    # Appends: each sync reads the new file only and decodes exactly its rows.
    for it in range(5):
        version = buffer.append(make_rows(it, sizes[it]), iteration=it)
        for report in sync_all(mirrors):
            assert report.version == version and report.files_read == 1
            assert report.rows_decoded == 4 * sizes[it] and report.rows_dropped == 0
        check(version)
    appended = version

    # A retried iteration in the middle: same ids, other values; its rows are decoded again.
    version = buffer.append(make_rows(1, sizes[1], salt=5), iteration=1)
    for report in sync_all(mirrors):
        assert (report.rows_decoded, report.rows_dropped) == (8, 8)
    check(version)
    assert (
        " 5"
        in mirrors[None]
        .sample(version=version, batch_size=48, num_batches=1, seed=0, columns=["completion"])[0]
        .column("completion")
        .to_pylist()
    )
    retried = version

    # FIFO retention: whole old iterations and part of one go; the rewritten file's rows
    # are already held, so nothing is decoded.
    report = buffer.compact(capacity=30, current_policy_version=5, min_files_to_compact=100)
    assert report.rows_deleted == 18
    for sync in sync_all(mirrors):
        assert sync.rows_decoded == 0 and sync.rows_dropped == 18 and sync.rows == 30
    check(report.version)
    fifo = report.version

    # Positive bias: the files of several iterations are rewritten, keeping correct rows.
    buffer.append(make_rows(5, 3), iteration=5)
    sync_all(mirrors)
    report = buffer.compact(
        capacity=20, positive_bias=0.5, current_policy_version=6, min_files_to_compact=100
    )
    assert report.rows_deleted > 0
    for sync in sync_all(mirrors):
        assert sync.rows_decoded == 0 and sync.rows_dropped == report.rows_deleted
        assert sync.files_removed >= 2
    check(report.version)

    # Bin-pack: every file rewritten into one; nothing decoded, nothing dropped.
    for it in (6, 7):
        buffer.append(make_rows(it, 1), iteration=it)
    sync_all(mirrors)
    report = buffer.compact(capacity=1000, current_policy_version=8, min_files_to_compact=2)
    assert report.files_compacted == 3 and report.files_after == 1
    for sync in sync_all(mirrors):
        assert (sync.rows_decoded, sync.rows_dropped) == (0, 0)
        assert (sync.files_added, sync.files_removed, sync.files_read) == (1, 3, 1)
    check(report.version)
    packed = report.version

    # A retry of an iteration inside the packed file: the file is rewritten with the other
    # iterations' rows copied (held, not decoded) and the retried rows written anew.
    version = buffer.append(make_rows(6, 1, salt=3), iteration=6)
    for sync in sync_all(mirrors):
        assert (sync.rows_decoded, sync.rows_dropped, sync.files_removed) == (4, 4, 1)
    check(version)

    # An older pinned version, then back: files both versions share are kept.
    for old in (fifo, retried, appended):
        check(old)
    check(packed)

    # Restore to before the retention: old files come back, their rows are decoded again
    # (a restore may bring back other values under the same ids).
    DeltaTable(buffer.rollouts_uri).restore(retried)
    version = buffer.version()
    for sync in sync_all(mirrors):
        assert sync.version == version and sync.rows == 48 and sync.rows_decoded == 48
    check(version)
    # Restoring the same content again commits a version without file changes.
    DeltaTable(buffer.rollouts_uri).restore(retried)
    assert buffer.version() == version + 1
    version = buffer.version()
    for sync in sync_all(mirrors):
        assert (sync.version, sync.files_read, sync.rows) == (version, 0, 48)
    check(version)

    # Vacuum: two commits without data changes; then a retry of the last iteration.
    buffer.vacuum(grace_s=0)
    version = buffer.version()
    for sync in sync_all(mirrors):
        assert sync.version == version and sync.files_read == 0
    check(version)
    version = buffer.append(make_rows(4, 2, salt=1), iteration=4)
    sync_all(mirrors)
    check(version)
    version = buffer.append(make_rows(8, 3), iteration=8)
    for sync in sync_all(mirrors):
        assert sync.rows_decoded == 12 and sync.rows_dropped == 0
    check(version)


def test_iterations_written_in_any_order(tmp_path: Path):
    """Iterations inserted before, between and inside the mirrored ranges, retried with
    fewer or more rows, across segments of a few rows (so they split and merge)."""
    buffer = ReplayBuffer(str(tmp_path / "buf"))
    mirror = BufferMirror(buffer, columns=["reward", "completion"], segment_rows=9)
    writes = [(5, 1), (9, 2), (1, 1), (7, 1), (6, 2), (3, 1), (8, 1), (2, 3), (6, 1), (4, 2)]
    writes += [(0, 1), (9, 1), (5, 3), (10, 1)]
    for i, (it, prompts) in enumerate(writes):
        version = buffer.append(make_rows(it, prompts, salt=i), iteration=it)
        report = mirror.sync()
        assert report.rows_decoded == 4 * prompts
        segments = mirror._mirror.segments
        assert all(s.num_rows <= 12 for s in segments)  # 9, or one iteration of 12
        n = mirror.num_rows
        for seed in (0, 1):
            args = dict(version=version, batch_size=n, num_batches=1, seed=seed, mode="epoch")
            args["columns"] = ["rollout_id", "iteration", "reward", "completion"]
            want, got = buffer.sample(**args), mirror.sample(**args)
            assert got[0].equals(want[0]), (it, got[0].to_pylist(), want[0].to_pylist())


def test_sample_errors_match_the_buffer(tmp_path: Path):
    buffer = ReplayBuffer(str(tmp_path / "buf"))
    mirror = BufferMirror(buffer, columns=TRAIN_COLUMNS)
    with pytest.raises(ReplayRLError, match="append rows first"):
        mirror.sync()
    assert mirror.version is None and mirror.num_rows == 0
    empty = buffer.append(make_rows(0, 0), iteration=0)
    version = buffer.append(make_rows(1, 2), iteration=1)  # 8 rows
    cases = [
        (dict(version=version, batch_size=2, num_batches=1, mode="x"), "unknown sample mode"),
        (dict(version=version, batch_size=0, num_batches=1), ">= 1"),
        (dict(version=version, batch_size=2, num_batches=1, mode="epoch", replace=True), "contra"),
        (dict(version=version, batch_size=2, num_batches=1, columns=["nope"]), "unknown rollout"),
        (dict(version=version, batch_size=9, num_batches=1), "exceeds the 8 rows"),
        (dict(version=version, batch_size=9, num_batches=1, mode="epoch"), "needs batch_size"),
        (dict(version=empty, batch_size=1, num_batches=1), "holds no rollouts"),
        (dict(version=9, batch_size=1, num_batches=1), "version 9 of .* cannot be loaded"),
    ]
    for args, message in cases:
        kwargs = {"columns": TRAIN_COLUMNS, **args}
        with pytest.raises(ReplayRLError, match=message) as want:
            buffer.sample(seed=0, **kwargs)
        with pytest.raises(ReplayRLError) as got:
            mirror.sample(seed=0, **kwargs)
        assert str(got.value) == str(want.value)
    with pytest.raises(ReplayRLError, match=r"\['completion'\] are not mirrored"):
        mirror.sample(version=version, batch_size=2, num_batches=1, seed=0, columns=["completion"])


def test_failed_sync_leaves_the_mirror_intact(tmp_path: Path):
    buffer = ReplayBuffer(str(tmp_path / "buf"))
    mirror = BufferMirror(buffer, columns=["reward"])
    pinned = buffer.append(make_rows(0), iteration=0)
    buffer.append(make_rows(1), iteration=1)
    report = buffer.compact(
        capacity=12, current_policy_version=2, min_files_to_compact=1, vacuum_grace_s=0
    )
    mirror.sync(report.version)
    draw = dict(version=report.version, batch_size=5, num_batches=2, seed=3, columns=["reward"])
    before = mirror.sample(**draw)
    with pytest.raises(ReplayRLError, match="vacuum"):
        mirror.sync(pinned)  # its file is gone
    assert mirror.version == report.version and mirror.num_rows == 12
    after = mirror.sample(**draw)
    assert [b.to_pylist() for b in after] == [b.to_pylist() for b in before]
    with pytest.raises(ReplayRLError, match="version 99 of .* cannot be loaded"):
        mirror.sync(99)
    assert mirror.version == report.version


def test_mirror_on_s3(s3_root: str):
    root = f"{s3_root}/buffer"
    buffer = ReplayBuffer(root, storage_options=storage.delta_storage_options(root))
    mirror = BufferMirror(buffer, columns=TRAIN_COLUMNS)
    for it in range(4):
        version = buffer.append(make_rows(it), iteration=it)
        report = mirror.sync()
        assert report.version == version and report.rows_decoded == 12
    assert_same_samples(buffer, {tuple(TRAIN_COLUMNS): mirror}, version)
    version = buffer.append(make_rows(3, salt=2), iteration=3)  # a retry
    assert mirror.sync().rows_decoded == 12
    assert_same_samples(buffer, {tuple(TRAIN_COLUMNS): mirror}, version)
    report = buffer.compact(
        capacity=30, positive_bias=0.5, current_policy_version=4, min_files_to_compact=2
    )
    assert report.rows_deleted > 0 and report.files_compacted >= 2
    sync = mirror.sync()
    assert (sync.version, sync.rows, sync.rows_decoded) == (report.version, report.rows_after, 0)
    assert_same_samples(buffer, {tuple(TRAIN_COLUMNS): mirror}, report.version)


def test_mirror_follows_a_buffer_as_large_as_one_iteration(tmp_path: Path):
    """The sweep's N = R point (capacity = one iteration's rows, positive bias): every
    compaction's retention delete cuts through the files it keeps, and delta-rs rewrites them
    with rollout_id as string_view. A sync across such a rewrite reads part of a rewritten
    file (the rows it does not hold) through a filter, which pyarrow cannot apply to a
    string_view column in the scan; the mirror must still equal the buffer."""
    buffer = ReplayBuffer(str(tmp_path / "buf"))
    mirrors = mirrors_of(buffer)
    for it in range(6):
        buffer.append(make_rows(it, 3), iteration=it)
        report = buffer.compact(
            capacity=12,
            positive_bias=0.5,
            current_policy_version=it,
            min_files_to_compact=16,
            vacuum_grace_s=None,
        )
        sync_all(mirrors)
        assert_same_samples(buffer, mirrors, report.version)


# A process that reads the buffer (a whole-table read and a mirror's sync), then exits.
_READ_THEN_EXIT = """
import sys
from replayrl import storage
from replayrl.buffer.mirror import BufferMirror
from replayrl.buffer.table import ReplayBuffer
root = sys.argv[1]
buffer = ReplayBuffer(root, storage_options=storage.delta_storage_options(root))
assert BufferMirror(buffer, columns=["reward"]).sync().rows == int(sys.argv[2])
assert buffer.read(columns=["rollout_id"]).num_rows == int(sys.argv[2])
# The scan under every read, last: nothing of ours runs between it and the exit.
assert buffer._scan(buffer._open(buffer.rollouts_uri), columns=None).num_rows == int(sys.argv[2])
"""


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_process_that_reads_the_buffer_exits_cleanly(tmp_path: Path, where: str, request):
    """Reads went through delta-rs's Python file system handler, which pyarrow's IO threads
    call into: a process that exited just after a read aborted ("terminate called without
    an active exception", exit -6) after doing its work: a CLI command or a KFP task that
    failed at its end (`replayrl buffer inspect`: 55 of 600 runs on a loaded machine;
    a bare delta-rs scan on S3, 52 of 200). Here most of the 12 processes aborted so, on
    either store; every one must exit 0."""
    if where == "s3":
        root = f"{request.getfixturevalue('s3_root')}/buffer"
    else:
        root = str(tmp_path / "buffer")
    buffer = ReplayBuffer(root, storage_options=storage.delta_storage_options(root))
    for it in range(30):  # a file per iteration: many reads in flight
        buffer.append(make_rows(it), iteration=it)
    rows = 30 * 12
    failed = []
    for _ in range(12):
        proc = subprocess.run(
            [sys.executable, "-c", _READ_THEN_EXIT, root, str(rows)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            failed.append((proc.returncode, proc.stderr.strip().splitlines()[-1:]))
    assert not failed, failed
