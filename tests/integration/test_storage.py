"""Local storage: checkpoints count only when complete; state.json advances by compare-and-swap."""

from __future__ import annotations

import pytest

from replayrl import storage
from replayrl.errors import ReplayRLError
from replayrl.storage import LineageState

pytestmark = pytest.mark.integration


def test_only_marked_checkpoints_are_complete(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "lin")
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"x" * 10)
    storage.write_checkpoint(src, paths.checkpoint(1))
    # a crashed writer of v2: files but no marker
    partial = tmp_path / "lin" / "checkpoints" / "v000002"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"half")
    assert storage.complete_versions(paths) == [1]
    with pytest.raises(ReplayRLError, match="incomplete"):
        storage.checkpoint_local_dir(paths.checkpoint(2), tmp_path / "cache")
    # the retry publishes into a sub-folder of its own; the crashed attempt's file is
    # never read, and pruning deletes it once a newer checkpoint is the lineage's
    storage.write_checkpoint(src, paths.checkpoint(2))
    assert storage.complete_versions(paths) == [1, 2]
    local = storage.checkpoint_local_dir(paths.checkpoint(2), tmp_path / "cache")
    assert local.parent == partial and (local / "model.safetensors").read_bytes() == b"x" * 10
    assert (partial / "model.safetensors").read_bytes() == b"half"


def test_prune_keeps_newest_and_protected(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "lin")
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("1")
    for v in range(5):
        storage.write_checkpoint(src, paths.checkpoint(v))
    storage.prune_checkpoints(paths, keep=2, protect={0, 4})
    assert storage.complete_versions(paths) == [0, 3, 4]


def test_state_compare_and_swap(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "lin")
    s0 = LineageState(lineage="lin", arm="replay", seed=0, config_hash="h")
    storage.advance_state(paths, s0, expected_next_iteration=None)
    with pytest.raises(ReplayRLError, match="another run"):
        storage.advance_state(paths, s0, expected_next_iteration=None)
    s1 = LineageState(lineage="lin", arm="replay", seed=0, config_hash="h", next_iteration=2)
    storage.advance_state(paths, s1, expected_next_iteration=1)
    with pytest.raises(ReplayRLError, match="expected next iteration 1, found 2"):
        storage.advance_state(paths, s1, expected_next_iteration=1)
    assert storage.read_state(paths).next_iteration == 2


def test_unreadable_state_is_a_clear_error(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "lin")
    (tmp_path / "lin").mkdir()
    (tmp_path / "lin" / "state.json").write_text("{not json")
    with pytest.raises(ReplayRLError, match="unreadable"):
        storage.read_state(paths)


def test_bad_lineage_names_and_roots():
    with pytest.raises(ReplayRLError, match="not valid"):
        storage.lineage_paths("/tmp", "../escape")
    with pytest.raises(ReplayRLError, match="Unsupported run root"):
        storage.normalize_root("gs://bucket/x")
