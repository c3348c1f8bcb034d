"""Storage against a real S3 server: the state compare-and-swap is a conditional write (of
many racing writers exactly one wins), checkpoints carry a size and sha256 manifest, and wrong
credentials or a missing bucket fail at once with the fix (and without the secret)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.errors import ReplayRLError
from replayrl.storage import LineageState

pytestmark = pytest.mark.integration


def state(next_iteration: int, *, seed: int = 0) -> LineageState:
    return LineageState(
        lineage="lin", arm="replay", seed=seed, config_hash="h", next_iteration=next_iteration
    )


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "runs")
    return request.getfixturevalue("s3_root")


def test_compare_and_swap(root):
    paths = storage.lineage_paths(root, "lin")
    storage.advance_state(paths, state(1), expected_next_iteration=None)
    with pytest.raises(ReplayRLError, match="another run"):
        storage.advance_state(paths, state(1, seed=5), expected_next_iteration=None)
    storage.advance_state(paths, state(2), expected_next_iteration=1)
    with pytest.raises(ReplayRLError, match="expected next iteration 1, found 2"):
        storage.advance_state(paths, state(2, seed=7), expected_next_iteration=1)
    if storage.is_s3(root):
        # a retry of a swap that landed (its answer was lost on the way back) succeeds
        storage.advance_state(paths, state(2), expected_next_iteration=1)
    assert storage.read_state(paths) == state(2)


def test_racing_writers_exactly_one_wins(root):
    paths = storage.lineage_paths(root, "lin")
    storage.advance_state(paths, state(1), expected_next_iteration=None)
    for round_ in range(1, 4):
        barrier = threading.Barrier(8)
        won, lost = [], []

        def writer(i: int, round_: int = round_, barrier=barrier, won=won, lost=lost) -> None:
            barrier.wait()
            try:
                storage.advance_state(
                    paths, state(round_ + 1, seed=i), expected_next_iteration=round_
                )
                won.append(i)
            except ReplayRLError as e:
                assert "another run" in str(e)
                lost.append(i)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(lost) == 7, (won, lost)
        assert storage.read_state(paths) == state(round_ + 1, seed=won[0])


def test_fence_stops_writers_of_committed_iterations(root):
    paths = storage.lineage_paths(root, "lin")
    storage.check_iteration_open(paths, iteration=1)  # no lineage yet: nothing to protect
    storage.advance_state(paths, state(3), expected_next_iteration=None)
    storage.check_iteration_open(paths, iteration=3)
    with pytest.raises(ReplayRLError, match="Iteration 2 .* already committed"):
        storage.check_iteration_open(paths, iteration=2)


def test_checkpoint_manifest_catches_truncation(root, tmp_path):
    paths = storage.lineage_paths(root, "lin")
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"w" * 1000)
    (src / "config.json").write_text("{}")
    (src / "COMPLETE").write_text("a stale marker must not be published first")
    storage.write_checkpoint(src, paths.checkpoint(1))
    local = storage.checkpoint_local_dir(paths.checkpoint(1), tmp_path / "cache")
    assert (local / "model.safetensors").read_bytes() == b"w" * 1000
    # damage the published checkpoint: the reader names the file and the fix
    files = storage.checkpoint_files_uri(paths.checkpoint(1))
    storage.write_bytes_atomic(storage.join(files, "model.safetensors"), b"w" * 10)
    with pytest.raises(
        ReplayRLError, match=r"model.safetensors' is damaged: it has 10 bytes .* lists 1000"
    ):
        storage.checkpoint_local_dir(paths.checkpoint(1), tmp_path / "cache2")


def test_generation_and_evaluation_copies_leave_the_training_state_behind(s3_root, tmp_path):
    """A weights-only copy of a full checkpoint on S3 downloads neither the optimizer nor
    the RNG state (the sharded safetensors format, and the pickles of older checkpoints);
    the trainer's copy has both."""
    paths = storage.lineage_paths(s3_root, "lin")
    src = tmp_path / "src"
    src.mkdir()
    weight_files = [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    training_files = [
        "optimizer-00001-of-00002.safetensors",
        "optimizer-00002-of-00002.safetensors",
        "optimizer.json",
        "optimizer.pt",
        "optimizer.safetensors.index.json",
        "rng_state.json",
        "rng_state.pt",
        "rng_state.safetensors",
    ]
    for name in weight_files:
        (src / name).write_bytes(b"w" * 1000)
    for name in training_files:
        (src / name).write_bytes(b"o" * 2000)
    storage.write_checkpoint(src, paths.checkpoint(3))
    weights = storage.checkpoint_local_dir(
        paths.checkpoint(3), tmp_path / "cache", weights_only=True
    )
    assert sorted(p.name for p in weights.iterdir()) == weight_files
    # cached: a second weights-only read downloads nothing and still skips them
    assert (
        storage.checkpoint_local_dir(paths.checkpoint(3), tmp_path / "cache", weights_only=True)
        == weights
    )
    full = storage.checkpoint_local_dir(paths.checkpoint(3), tmp_path / "cache")
    assert full != weights
    assert sorted(p.name for p in full.iterdir()) == sorted([*weight_files, *training_files])
    assert (full / "optimizer-00002-of-00002.safetensors").read_bytes() == b"o" * 2000


def test_wrong_secret_fails_at_once_without_leaking_it(s3_root, monkeypatch):
    secret = "WrongSecret-" + "x" * 20
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with pytest.raises(ReplayRLError) as err:
        storage.ensure_writable(s3_root)
    message = str(err.value)
    assert "rejected the credentials" in message and "AWS_SECRET_ACCESS_KEY" in message
    assert secret not in message
    paths = storage.lineage_paths(s3_root, "lin")
    buf = ReplayBuffer(paths.buffer, storage_options=storage.delta_storage_options(paths.buffer))
    with pytest.raises(ReplayRLError, match="rejected the credentials") as err:
        buf.version()
    assert secret not in str(err.value)


def test_unknown_access_key(s3_root, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with pytest.raises(ReplayRLError, match="rejected the credentials"):
        storage.write_bytes_atomic(storage.join(s3_root, "x"), b"1")


def test_missing_bucket_names_it_and_the_fix(s3_env):
    root = "s3://no-such-bucket-here/runs"
    with pytest.raises(ReplayRLError, match="bucket 'no-such-bucket-here' does not exist.*mb"):
        storage.ensure_writable(root)
    with pytest.raises(ReplayRLError, match="does not exist"):
        storage.advance_state(
            storage.lineage_paths(root, "lin"), state(1), expected_next_iteration=None
        )


def test_state_and_objects_need_no_local_disk(s3_root, tmp_path: Path):
    paths = storage.lineage_paths(s3_root, "lin")
    storage.write_bytes_atomic(paths.config, b"a: 1\n")
    assert storage.read_bytes(paths.config) == b"a: 1\n"
    assert storage.exists(paths.config) and not storage.exists(paths.state)
    assert storage.list_dir(paths.root) == ["config.yaml"]
    storage.delete(paths.config)
    assert not storage.exists(paths.config)


def test_an_object_read_while_it_is_rewritten_is_one_whole_version(s3_root):
    """A reader of a record another process rewrites (a worker's status, a lease) gets one
    version or the other, never a mix: pyarrow's S3 stream asked the size (HEAD) and then read
    that many bytes, so a rewrite in between cut or mixed it (about 1 read in 6 here)."""
    uri = f"{s3_root}/record.json"
    versions = (b"short", b"a much longer version of the record " * 8)
    storage.write_bytes_atomic(uri, versions[0])
    stop = threading.Event()

    def rewrite() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            storage.write_bytes_atomic(uri, versions[n % 2])

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    try:
        reads = [storage.read_bytes(uri) for _ in range(300)]
    finally:
        stop.set()
        writer.join(timeout=30)
    assert {versions.index(r) if r in versions else r for r in reads} <= {0, 1}
    assert b"" not in reads
