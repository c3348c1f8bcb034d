"""Publishing weights-only copies (issue 38 item 2): bfloat16 copies, and background saves
to the real SeaweedFS S3 server whose failures surface from `wait()` and leave no marker."""

from __future__ import annotations

import threading

import pytest
import torch

from replayrl import storage
from replayrl.engine.resources import Trainer, host_snapshot
from replayrl.errors import ReplayRLError
from replayrl.policy.models import load_policy
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer
from replayrl.storage import objects, transfer


def _trainer(seed: int = 3) -> Trainer:
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=seed)
    return Trainer(model, build_byte_tokenizer(), None, settings=None, version=5)


def _weight_bytes(uri: str) -> int:
    files = storage.read_manifest(uri).files
    return sum(f.size for name, f in files.items() if name.endswith(".safetensors"))


def test_a_bf16_copy_is_half_the_bytes_and_loads_the_same_bf16_weights(tmp_path):
    trainer = _trainer()
    full, half = str(tmp_path / "v1"), str(tmp_path / "v2")
    trainer.save(full, weights_only=True)  # on the CPU: float32, the generation dtype there
    trainer.save(half, weights_only=True, dtype=torch.bfloat16)
    ratio = _weight_bytes(half) / _weight_bytes(full)
    assert 0.49 < ratio < 0.52, ratio
    local = storage.checkpoint_local_dir(half, tmp_path / "cache", weights_only=True)
    loaded, _ = load_policy(local, dtype=torch.bfloat16)
    want = host_snapshot(trainer.model, torch.bfloat16)
    got = loaded.state_dict()
    assert want.keys() <= got.keys()
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], tensor), name
    # The trainer's own weights are untouched float32 masters.
    assert next(trainer.model.parameters()).dtype == torch.float32


def test_a_background_save_returns_before_its_upload_and_then_verifies(
    s3_root, tmp_path, monkeypatch
):
    trainer = _trainer()
    want = {k: v.clone() for k, v in host_snapshot(trainer.model, torch.bfloat16).items()}
    gate, started = threading.Event(), threading.Event()
    real = transfer._put_file

    def held(*args, **kwargs):  # the first upload waits until the test lets it go
        started.set()
        assert gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(transfer, "_put_file", held)
    uri = f"{s3_root}/published/v000000006"
    publication = trainer.save(uri, weights_only=True, background=True, dtype=torch.bfloat16)
    # Training goes on while the copy uploads: the weights change under it.
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)
    assert started.wait(60)
    assert not publication.done()
    assert not storage.is_complete(uri)  # nothing visible before its marker
    gate.set()
    publication.wait(timeout_s=120)
    assert publication.done() and storage.is_complete(uri)
    local = storage.checkpoint_local_dir(uri, tmp_path / "cache", weights_only=True)  # sha256s
    got = load_policy(local, dtype=torch.bfloat16)[0].state_dict()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name  # the snapshot's, not the changed ones


def test_a_failed_background_upload_surfaces_from_wait_and_leaves_no_marker(
    s3_root, tmp_path, monkeypatch
):
    from botocore.exceptions import ClientError

    calls = []
    real = transfer._put_file

    def failing(manager, item, uri):
        calls.append(item.name)
        if item.name.endswith(".safetensors"):  # the store refuses the weights
            raise ClientError(
                {"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "UploadPart"
            )
        return real(manager, item, uri)

    monkeypatch.setattr(transfer, "_put_file", failing)
    uri = f"{s3_root}/published/v000000007"
    publication = _trainer().save(uri, weights_only=True, background=True)
    with pytest.raises(ReplayRLError) as e:
        publication.wait(timeout_s=120)
    message = str(e.value)
    assert "\n" not in message and "model.safetensors" in message and "credentials" in message
    assert publication.done() and not storage.is_complete(uri)
    assert "model.safetensors" in calls
    with pytest.raises(ReplayRLError, match="incomplete|gone"):
        storage.checkpoint_local_dir(uri, tmp_path / "cache", weights_only=True)


def test_a_multipart_upload_in_parallel_streams_hashes_the_bytes_it_sent(
    s3_root, tmp_path, monkeypatch
):
    import hashlib
    import os

    monkeypatch.setattr(transfer, "UPLOAD_PART_BYTES", 5 << 20)  # S3's smallest part
    src = tmp_path / "src"
    src.mkdir()
    blobs = {"a.safetensors": os.urandom((23 << 20) + 7), "b.json": b"{}"}  # 5 parts, 1 PUT
    for name, blob in blobs.items():
        (src / name).write_bytes(blob)
    digests = transfer.upload_dir(src, f"{s3_root}/files")
    for name, blob in blobs.items():
        assert digests[name] == objects.Digest(len(blob), hashlib.sha256(blob).hexdigest())
        assert objects.read_bytes(f"{s3_root}/files/{name}") == blob


@pytest.mark.slow
def test_sharded_trainers_publish_a_bf16_copy_in_the_background_while_they_train(tmp_path):
    """T = 2 FSDP trainers (gloo): the weights-only copy is the gathered weights in bf16,
    published from a thread while the group takes its next step."""
    from pathlib import Path

    from rollout_rows import sampled_rows

    from replayrl.config import load_config
    from replayrl.engine.steps import step_settings
    from replayrl.engine.trainer_group import TrainerGroup
    from replayrl.policy.training import make_optimizer
    from replayrl.storage import paths_of

    preset = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
    cfg = load_config(
        preset,
        overrides=[
            f"storage.run_root={tmp_path / 'runs'}",
            "asynchronous.enabled=true",
            "asynchronous.trainers=2",
            "train.distributed=fsdp",
            "train.batch_size=4",
            "train.lr=1e-2",
        ],
    )
    paths, s = paths_of(cfg), step_settings(cfg)
    model, tokenizer = build_tiny_model(vocab_size=VOCAB_SIZE, seed=11), build_byte_tokenizer()
    optimizer = make_optimizer(model, lr=s.lr, weight_decay=s.weight_decay, betas=s.betas)
    Trainer(model, tokenizer, optimizer, settings=s, version=0).save(paths.checkpoint(0))
    rows = sampled_rows(model, tokenizer, num_samples=1).slice(0, 4)
    group = TrainerGroup.start(cfg, None, checkpoint_version=0, world=2)
    try:
        group.train([rows], seed=1)
        want = {k: v.to(torch.bfloat16) for k, v in dict(group.named_weights()).items()}
        uri = paths.checkpoint(1)
        publication = group.save(uri, weights_only=True, background=True, dtype=torch.bfloat16)
        group.train([rows], seed=2)  # the weights move on while the copy is written
        publication.wait(timeout_s=120)
    finally:
        group.close()
    local = storage.checkpoint_local_dir(uri, tmp_path / "cache", weights_only=True)
    got = load_policy(local, dtype=torch.bfloat16)[0].state_dict()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
