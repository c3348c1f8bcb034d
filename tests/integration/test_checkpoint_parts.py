"""A checkpoint several writers fill, on the S3 server (the sharded trainer across nodes,
where no disk is shared): each writer uploads its own folder's files into one publication
(`upload_part`), and the lease holder's COMPLETE marker names every writer's files
(`complete_parts`). A writer that failed, or two that wrote one name with other bytes, leave
no marker: the checkpoint before stays current, and no reader trusts the partial folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from replayrl.errors import ReplayRLError
from replayrl.storage import checkpoints, objects

pytestmark = pytest.mark.integration


def _writer(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_a_checkpoint_of_several_writers_is_complete_only_with_every_part(s3_root, tmp_path):
    uri = objects.join(s3_root, "checkpoints/v000001")
    node0 = _writer(tmp_path / "node0", {"model.safetensors": b"w" * 100, "shard0": b"a" * 7})
    node1 = _writer(tmp_path / "node1", {"shard1": b"b" * 9})

    epoch, folder = checkpoints.new_publication(uri)
    parts = [checkpoints.upload_part(d, uri, folder=folder) for d in (node0, node1)]
    assert not checkpoints.is_complete(uri)  # parts alone are no checkpoint
    manifest = checkpoints.complete_parts(uri, folder=folder, epoch=epoch, parts=parts)
    assert manifest.folder == folder
    assert manifest.files is not None
    assert {n: f.size for n, f in manifest.files.items()} == {
        "model.safetensors": 100, "shard0": 7, "shard1": 9
    }  # fmt: skip
    local = checkpoints.checkpoint_local_dir(uri, tmp_path / "cache")  # checked on download
    assert (Path(local) / "shard1").read_bytes() == b"b" * 9

    # A second publication whose writer 1 failed (None): refused, the first stays current.
    epoch, folder = checkpoints.new_publication(uri)
    first = checkpoints.upload_part(node0, uri, folder=folder)
    with pytest.raises(ReplayRLError, match=r"writer\(s\) \[1\] of 2 did not upload"):
        checkpoints.complete_parts(uri, folder=folder, epoch=epoch, parts=[first, None])
    assert checkpoints.read_manifest(uri).write_id == manifest.write_id

    # Two writers with one name of other bytes: refused as well.
    clash = _writer(tmp_path / "clash", {"shard0": b"c" * 7})
    other = checkpoints.upload_part(clash, uri, folder=folder)
    with pytest.raises(ReplayRLError, match="uploaded shard0 with other bytes"):
        checkpoints.complete_parts(uri, folder=folder, epoch=epoch, parts=[first, other])
    assert checkpoints.read_manifest(uri).write_id == manifest.write_id
