"""What the asynchronous roles leave on their local disk: a worker or the evaluator keeps only
the cached copies of the published versions it may still load (real downloads from a real S3
server, the tiny model), a dropped copy is never half-read, and checkpoint temp folders are
made under the scratch root ($REPLAYRL_CACHE), not the system's /tmp."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import tiny_config
from async_helpers import Role, async_cfg, end, publish, start_segment, wait_for

from replayrl import storage
from replayrl.config import default_cache_dir, temp_root
from replayrl.engine.asynchronous import board
from replayrl.engine.asynchronous.roles import evaluator_loop, worker_loop

pytestmark = pytest.mark.integration


def cached_on_disk(cfg, paths) -> list[int]:
    """Published versions with a cached copy, found by walking the cache folder itself."""
    root = storage.cached_copies_dir(paths.root, default_cache_dir(cfg), weights_only=True)
    found = set()
    for shard in root.rglob("model.safetensors"):
        entry = shard.parent
        if entry.name.startswith(".") or entry.parent.name.startswith("."):
            continue
        found.add(int(entry.parent.name[1:]))
    return sorted(found)


def test_a_worker_keeps_only_the_version_it_runs_and_the_newest(s3_root, tmp_path):
    cfg = async_cfg(s3_root, tmp_path)
    paths, segment = start_segment(cfg, roles=["trainer", "evaluator"])
    weights = storage.checkpoint_local_dir(
        paths.checkpoint(0), tmp_path / "copy", weights_only=True
    )
    worker = Role(worker_loop, cfg, paths, worker=0, segment_id=segment.id, threads=None)
    worker.start()
    try:
        wait_for(lambda: board.read_worker(paths, 0).batches >= 1, worker, what="a first batch")
        assert cached_on_disk(cfg, paths) == [0]
        for g in (2, 4, 6, 8):
            publish(paths, g, weights)
            # The stalled trainer catches up: no row waits unused, the worker goes on.
            buffer_version = board.read_worker(paths, 0).recent_appends[-1][0]
            board.write_trainer(paths, board.TrainerStatus(buffer_version=buffer_version))
            wait_for(
                lambda g=g: board.read_worker(paths, 0).policy_version == g,
                worker,
                what=f"a batch made with v{g}",
            )
            # Loaded v{g}: the copies of the versions before it are gone from the disk.
            assert cached_on_disk(cfg, paths) == [g]
    finally:
        end(paths, segment, worker)
    assert board.read_worker(paths, 0).batches >= 5


def test_the_evaluator_keeps_only_the_versions_it_has_still_to_evaluate(s3_root, tmp_path):
    cfg = async_cfg(s3_root, tmp_path, "eval.num_prompts=4")
    paths, segment = start_segment(cfg, roles=["trainer", "worker0"])
    weights = storage.checkpoint_local_dir(
        paths.checkpoint(0), tmp_path / "copy", weights_only=True
    )
    evaluator = Role(evaluator_loop, cfg, paths, segment_id=segment.id, threads=None)
    evaluator.start()
    try:
        wait_for(lambda: board.read_eval(paths, 0) is not None, evaluator, what="v0 evaluated")
        for g in (2, 4, 6, 8):
            publish(paths, g, weights)
        wait_for(lambda: board.read_eval(paths, 8) is not None, evaluator, what="v8 evaluated")
    finally:
        end(paths, segment, evaluator)
    assert [v for v in (0, 2, 4, 6, 8) if board.read_eval(paths, v)] == [0, 4, 8]
    # Versions 2 and 6 are not due: never downloaded. v0, v4 and v8 dropped once evaluated.
    assert cached_on_disk(cfg, paths) == []


def test_a_dropped_copy_is_gone_in_one_step_and_a_download_in_progress_stays(s3_root, tmp_path):
    uri = f"{s3_root}/checkpoints/v000001"
    source = tmp_path / "source"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"w" * 1000)
    (source / "config.json").write_text("{}")
    storage.write_checkpoint(source, uri)
    cache = tmp_path / "cache"
    entry = storage.checkpoint_local_dir(uri, cache, weights_only=True)
    folder = entry.parent
    assert folder == storage.cached_copies_dir(uri, cache, weights_only=True)
    # What a crash mid-drop leaves (renamed aside, half removed) and a concurrent download.
    crashed = folder / f".{entry.name}.dropped-0123abcd"
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"w" * 10)
    partial = folder / f".{entry.name}.tmp-xyz"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"w" * 10)

    assert storage.drop_cached_copies(uri, cache, weights_only=True) == 1
    assert sorted(p.name for p in folder.iterdir()) == [partial.name]
    # A new read downloads a verified copy again; the partial is still not used.
    again = storage.checkpoint_local_dir(uri, cache, weights_only=True)
    assert (again / "model.safetensors").read_bytes() == b"w" * 1000
    partial.rename(tmp_path / "done")  # the download finished elsewhere
    assert storage.drop_cached_copies(uri, cache, weights_only=True) == 1
    assert not folder.exists()
    # A copy left half deleted in place is refused against the marker and fetched again.
    entry = storage.checkpoint_local_dir(uri, cache, weights_only=True)
    (entry / "model.safetensors").unlink()
    entry = storage.checkpoint_local_dir(uri, cache, weights_only=True)
    assert (entry / "model.safetensors").read_bytes() == b"w" * 1000
    # A local checkpoint is never copied, so there is nothing to drop.
    local = tmp_path / "local" / "v000001"
    storage.write_checkpoint(source, str(local))
    assert storage.drop_cached_copies(str(local), cache) == 0
    assert (storage.checkpoint_local_dir(str(local), cache) / "config.json").exists()


def test_checkpoint_temp_folders_are_made_under_the_scratch_root(s3_root, tmp_path, monkeypatch):
    from replayrl.engine.resources import Trainer
    from replayrl.policy.models import load_policy

    monkeypatch.delenv("REPLAYRL_CACHE", raising=False)
    assert temp_root() == Path(tempfile.gettempdir())  # off-cluster
    scratch = tmp_path / "scratch"
    monkeypatch.setenv("REPLAYRL_CACHE", str(scratch))  # what an accelerator pod sets
    assert temp_root() == scratch / "tmp" and temp_root().is_dir()

    model, tokenizer = load_policy(tiny_config.ensure_warm_start())
    trainer = Trainer(model, tokenizer, None, settings=None, version=0)
    staged = []

    def before_write():
        staged.extend(p for p in (scratch / "tmp").iterdir() if (p / "model.safetensors").exists())

    uri = f"{s3_root}/published/v000000002"
    trainer.save(uri, before_write=before_write, weights_only=True)
    assert [p.name.startswith("replayrl-ckpt-") for p in staged] == [True]
    assert not list((scratch / "tmp").iterdir())  # removed once uploaded
    assert storage.is_complete(uri)
