"""Checkpoints you can trust, on a local root and on the S3 server: every file is checked
against the sha256 its COMPLETE marker lists, so a flipped byte, a truncated shard or an
unreadable marker is refused with one line naming the file; concurrent readers of one
checkpoint share a verified download and never see it change under them; a stale owner's
publication never replaces a newer owner's nor deletes its files; old markers still read."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from replayrl import storage
from replayrl.config import load_config
from replayrl.engine.inputs import publish_initial_policy
from replayrl.engine.resources import Trainer, load_weights_only
from replayrl.errors import ReplayRLError, StaleOwnerError
from replayrl.policy.models import initial_policy_dir, save_policy
from replayrl.policy.tiny_model import build_tiny_model, supervised_loss
from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer
from replayrl.policy.training import StepSettings, make_optimizer
from replayrl.policy.training_state import load_training_state
from replayrl.storage import fencing, objects, transfer

pytestmark = pytest.mark.integration

SETTINGS = StepSettings(
    loss_name="grpo",
    clip_eps=0.2,
    is_cap=None,
    temperature=1.0,
    grad_clip=1.0,
    lr=1e-3,
    weight_decay=0.0,
    betas=(0.9, 0.999),
)


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "runs")
    return request.getfixturevalue("s3_root")


@pytest.fixture(autouse=True)
def no_fences():
    yield
    fencing._FENCES.clear()


def trained_trainer() -> Trainer:
    """A tiny model after one AdamW step: its optimizer has tensor state to save."""
    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=5, hidden_size=32, num_layers=1)
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0, betas=SETTINGS.betas)
    loss = supervised_loss(model=model, tokenizer=tokenizer, prompts=["1 + 2 ="], targets=[" 3"])
    loss.backward()
    optimizer.step()
    return Trainer(model, tokenizer, optimizer, settings=SETTINGS, version=3)


def config(tmp_path: Path):
    return load_config(text="", overrides=[f"model.cache_dir={tmp_path / 'cache'}"])


def damage(uri: str, name: str, how: str) -> None:
    """Damage file `name` of published checkpoint `uri` where it lies (bypassing storage's
    atomic writes locally, as a disk would)."""
    if how == "marker":
        target = objects.join(uri, "COMPLETE")
        blob = b'{"format": 2, "write_id": '
    else:
        target = objects.join(storage.checkpoint_files_uri(uri), name)
        blob = bytearray(objects.read_bytes(target))
        if how == "flip":
            blob[len(blob) * 2 // 3] ^= 0x01
        else:
            blob = blob[: len(blob) // 2]
        blob = bytes(blob)
    if objects.is_s3(target):
        objects.write_bytes_atomic(target, blob)
    else:
        Path(target).write_bytes(blob)


def one_line_naming(err: pytest.ExceptionInfo, name: str) -> str:
    message = str(err.value)
    assert "\n" not in message and f"{name}'" in message and "v000003" in message, message
    return message


CORRUPTIONS = [
    ("model.safetensors", "flip", True),
    ("optimizer.safetensors", "flip", False),
    ("rng_state.json", "flip", False),
    ("rng_state.safetensors", "flip", False),
    ("model.safetensors", "truncate", True),
    ("COMPLETE", "marker", True),
]


@pytest.mark.parametrize(("name", "how", "weights"), CORRUPTIONS)
def test_damage_is_refused_with_one_line_naming_the_file(root, tmp_path, name, how, weights):
    """Resume and weights-only loads check every file they read; the training state is
    checked by the trainer only (generation never reads it)."""
    paths = storage.lineage_paths(root, "lin")
    uri = paths.checkpoint(3)
    trained_trainer().save(uri)
    Trainer.load(config(tmp_path / "sound"), paths, version=3, settings=SETTINGS)
    damage(uri, name, how)
    cfg = config(tmp_path)  # a cache without a copy made before the damage (that one is sound)
    with pytest.raises(ReplayRLError) as err:
        Trainer.load(cfg, paths, version=3, settings=SETTINGS)
    message = one_line_naming(err, name)
    assert ("sha256" in message) == (how == "flip")
    if weights:
        with pytest.raises(ReplayRLError) as err:
            load_weights_only(cfg, paths, 3)
        one_line_naming(err, name)
    else:
        model, _ = load_weights_only(cfg, paths, 3)
        assert model is not None


def test_a_damaged_cache_entry_is_fetched_again(s3_root, tmp_path):
    paths = storage.lineage_paths(s3_root, "lin")
    trainer = trained_trainer()
    trainer.save(paths.checkpoint(3))
    cache = tmp_path / "cache"
    local = storage.checkpoint_local_dir(paths.checkpoint(3), cache, weights_only=True)
    good = (local / "model.safetensors").read_bytes()
    (local / "model.safetensors").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    again = storage.checkpoint_local_dir(paths.checkpoint(3), cache, weights_only=True)
    assert again == local and (again / "model.safetensors").read_bytes() == good


def test_training_state_without_hashes_is_refused_with_one_line(tmp_path):
    """A checkpoint whose marker has no hashes (format 1), or a file damaged after the check:
    the training state's own reader names the file instead of a traceback."""
    trainer = trained_trainer()
    for name, blob in [
        ("rng_state.json", b"{not json"),
        ("rng_state.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage"),
        ("optimizer.safetensors", b"\x00" * 3),
        ("optimizer.json", b'{"format": 1, "param_groups": 7}'),
    ]:
        ckpt = tmp_path / name
        save_policy(trainer.model, trainer.tokenizer, ckpt, optimizer=trainer.optimizer)
        (ckpt / name).write_bytes(blob)
        optimizer = make_optimizer(trainer.model, lr=1e-3, weight_decay=0.0, betas=SETTINGS.betas)
        before = torch.get_rng_state()
        with pytest.raises(ReplayRLError) as err:
            load_training_state(optimizer, trainer.model, ckpt)
        message = str(err.value)
        assert "\n" not in message and f"{ckpt / name}'" in message, message
        assert torch.equal(torch.get_rng_state(), before)


def publish_format_1(local: Path, uri: str, *, legacy_text: bool = False) -> None:
    """A checkpoint as replayrl wrote it before format 2: files in the version folder, then a
    marker with sizes only (or, older still, the text "complete")."""
    transfer.upload_dir(local, uri)
    sizes = {p.name: p.stat().st_size for p in sorted(local.iterdir())}
    marker = {"format": 1, "write_id": "0123abcd", "files": sizes}
    blob = b"complete\n" if legacy_text else json.dumps(marker).encode()
    objects.write_bytes_atomic(objects.join(uri, "COMPLETE"), blob)


@pytest.mark.parametrize("legacy_text", [False, True])
def test_old_checkpoints_still_load(root, tmp_path, legacy_text):
    paths = storage.lineage_paths(root, "lin")
    trainer = trained_trainer()
    save_policy(trainer.model, trainer.tokenizer, tmp_path / "v3", optimizer=trainer.optimizer)
    publish_format_1(tmp_path / "v3", paths.checkpoint(3), legacy_text=legacy_text)
    cfg = config(tmp_path)
    loaded = Trainer.load(cfg, paths, version=3, settings=SETTINGS)
    copy, _ = load_weights_only(cfg, paths, 3)
    want = dict(trainer.model.named_parameters())
    for model in (loaded.model, copy):
        for name, p in model.named_parameters():
            assert torch.equal(p, want[name]), name
    assert loaded.optimizer.state
    if not legacy_text:  # format 1 is still checked by size
        damage(paths.checkpoint(3), "model.safetensors", "truncate")
        with pytest.raises(ReplayRLError, match="model.safetensors' is damaged"):
            Trainer.load(config(tmp_path / "other"), paths, version=3, settings=SETTINGS)
    # a new publication of the version replaces the old marker; the old files stay unread
    trainer.save(paths.checkpoint(3))
    assert storage.read_manifest(paths.checkpoint(3)).format == 2
    Trainer.load(config(tmp_path / "third"), paths, version=3, settings=SETTINGS)


def made(tag: bytes) -> dict[str, bytes]:
    """The files of a stand-in checkpoint marked `tag`."""
    return {
        "config.json": b'{"tag": "' + tag + b'"}',
        "model.safetensors": tag * 5000,
        "optimizer.safetensors": tag * 100,
    }


def files_of(tmp_path: Path, tag: bytes) -> Path:
    src = tmp_path / f"src-{tag.decode()}"
    if not src.exists():
        src.mkdir()
        for name, blob in made(tag).items():
            (src / name).write_bytes(blob)
    return src


def content(local: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(local.iterdir())}


class StoppedWriter:
    """A publication by this process under fencing `epoch`, stopped (a thread parked at a
    stop point, like the crash trials') after its files are written and before its marker;
    `resume()` lets it go on and returns what it raised (None: it published)."""

    def __init__(self, src: Path, uri: str, *, root: str, epoch: int):
        fencing.install(fencing.Fence(root, epoch))
        self.written, self.go = threading.Event(), threading.Event()
        self.outcome: list[BaseException | None] = []
        upload = transfer.upload_dir

        def paused_upload(local_dir, dest, **kwargs):
            out = upload(local_dir, dest, **kwargs)
            self.written.set()
            self.go.wait(60)
            return out

        def write():
            try:
                storage.write_checkpoint(src, uri)
                self.outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                self.outcome.append(e)
                self.written.set()

        transfer.upload_dir = paused_upload
        try:
            self.thread = threading.Thread(target=write)
            self.thread.start()
            assert self.written.wait(60) and not self.outcome, self.outcome
        finally:
            transfer.upload_dir = upload

    def resume(self) -> BaseException | None:
        self.go.set()
        self.thread.join(60)
        return self.outcome[0]


def test_a_stale_owner_never_replaces_or_deletes_a_newer_publication(root, tmp_path):
    """Owner A (epoch 1) is stopped between writing its files and publishing its marker;
    owner B (epoch 2) takes over and publishes the same version; A resumes: its marker is
    refused, B's checkpoint reads back whole, and B's prune removes A's leftovers."""
    paths = storage.lineage_paths(root, "lin")
    uri = paths.checkpoint(3)
    a = StoppedWriter(files_of(tmp_path, b"a"), uri, root=paths.root, epoch=1)
    fencing.install(fencing.Fence(paths.root, 2))
    storage.write_checkpoint(files_of(tmp_path, b"b"), uri)
    b_manifest = storage.read_manifest(uri)
    assert isinstance(a.resume(), StaleOwnerError)
    assert storage.read_manifest(uri) == b_manifest and b_manifest.epoch == 2
    local = storage.checkpoint_local_dir(uri, tmp_path / "cache")
    assert content(local) == content(files_of(tmp_path, b"b"))

    # A (epoch 1) publishing afresh is refused at the marker too, and B's files stay
    fencing.install(fencing.Fence(paths.root, 1))
    with pytest.raises(StaleOwnerError, match="fencing epoch 2"):
        storage.write_checkpoint(files_of(tmp_path, b"a"), uri)
    folders = [n for n in objects.list_dir(uri) if n.startswith("w-")]
    assert len(folders) == 3 and b_manifest.folder in folders
    fencing.install(fencing.Fence(paths.root, 2))
    storage.prune_checkpoints(paths, keep=2, protect={0, 3})
    assert [n for n in objects.list_dir(uri) if n.startswith("w-")] == [b_manifest.folder]
    local = storage.checkpoint_local_dir(uri, tmp_path / "cache2")
    assert content(local) == content(files_of(tmp_path, b"b"))

    # a lineage fenced past this owner (state.json's epoch) refuses before writing anything
    objects.write_bytes_atomic(objects.join(paths.root, "state.json"), b'{"epoch": 3}')
    with pytest.raises(StaleOwnerError):
        storage.write_checkpoint(files_of(tmp_path, b"c"), paths.checkpoint(4))
    assert not objects.list_dir(paths.checkpoint(4))


def test_a_writer_fenced_while_stopped_publishes_nothing(root, tmp_path):
    """The lineage is fenced past owner A (state.json's epoch) while A is stopped before its
    marker, and no newer checkpoint of that version exists yet: A's marker is still refused."""
    paths = storage.lineage_paths(root, "lin")
    a = StoppedWriter(files_of(tmp_path, b"a"), paths.checkpoint(3), root=paths.root, epoch=1)
    objects.write_bytes_atomic(objects.join(paths.root, "state.json"), b'{"epoch": 2}')
    assert isinstance(a.resume(), StaleOwnerError)
    assert not storage.is_complete(paths.checkpoint(3))


def test_prune_only_deletes_what_is_older_or_superseded(root, tmp_path):
    paths = storage.lineage_paths(root, "lin")
    src = files_of(tmp_path, b"x")
    for v in range(5):
        storage.write_checkpoint(src, paths.checkpoint(v))
    storage.write_checkpoint(src, paths.checkpoint(4))  # republished: one superseded folder
    # a crashed attempt at v2 (no marker of its own) and one at v5 (past the commit)
    transfer.upload_dir(src, objects.join(paths.checkpoint(5), "w-0-0badc0de"))
    objects.delete(objects.join(paths.checkpoint(2), "COMPLETE"))
    kept = storage.read_manifest(paths.checkpoint(4)).folder
    assert storage.prune_checkpoints(paths, keep=1, protect={0, 4}) == [1, 2, 3]
    assert storage.complete_versions(paths) == [0, 4]
    assert [n for n in objects.list_dir(paths.checkpoint(4)) if n.startswith("w-")] == [kept]
    assert objects.list_dir(paths.checkpoint(5)) == ["w-0-0badc0de"]  # not older: kept


def test_concurrent_weight_downloads_never_fail(s3_root, tmp_path):
    """8 readers × 10 rounds load the same version from one shared cache while it is
    republished: each finds a whole, verified copy of some publication, and the copy it
    resolved is still whole after the round (nothing was deleted or replaced under it)."""
    paths = storage.lineage_paths(s3_root, "lin")
    uri = paths.checkpoint(1)
    cache = tmp_path / "cache"
    tags = [bytes([ord("a") + r]) for r in range(10)]
    for tag in tags:
        files_of(tmp_path, tag)
    storage.write_checkpoint(files_of(tmp_path, tags[0]), uri)
    failures: list[str] = []

    for r in range(10):
        barrier = threading.Barrier(9)
        seen: list[tuple[Path, dict[str, bytes]]] = []

        def reader(barrier=barrier, seen=seen) -> None:
            barrier.wait()
            try:
                for _ in range(2):
                    local = storage.checkpoint_local_dir(uri, cache, weights_only=True)
                    files = content(local)
                    tag = files["model.safetensors"][:1]
                    want = made(tag)
                    del want["optimizer.safetensors"]  # training state: not in a weights-only copy
                    assert files == want
                    seen.append((local, files))
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(f"{type(e).__name__}: {e}")

        def publisher(barrier=barrier, r=r) -> None:
            barrier.wait()
            if r % 2:  # every other round the version is republished while readers load it
                storage.write_checkpoint(files_of(tmp_path, tags[r]), uri)

        threads = [threading.Thread(target=reader) for _ in range(8)]
        threads.append(threading.Thread(target=publisher))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures[:3]
        for local, files in seen:
            assert content(local) == files  # still whole after the round
    entries = [p for p in (cache / "s3-weights").rglob("*") if p.name.startswith(".")]
    assert not entries, entries  # no staging folder left behind


def test_a_checkpoint_is_a_model_source(root, tmp_path):
    """The fix the errors suggest, `--set model.source=<checkpoint>`, finds the files the
    marker names (checked, without the training state)."""
    paths = storage.lineage_paths(root, "lin")
    trainer = trained_trainer()
    trainer.save(paths.checkpoint(3))
    cfg = load_config(
        text="",
        overrides=[f"model.cache_dir={tmp_path / 'cache'}", f"model.source={paths.checkpoint(3)}"],
    )
    local = initial_policy_dir(cfg, None)
    assert (local / "config.json").exists()
    other = storage.lineage_paths(root, "other")
    publish_initial_policy(cfg, other, local)
    v0 = storage.checkpoint_local_dir(other.checkpoint(0), tmp_path / "cache")
    assert (v0 / "config.json").exists() and not list(v0.glob("optimizer*"))
    assert not list(v0.glob("rng_state*"))  # the new lineage starts a fresh optimizer
