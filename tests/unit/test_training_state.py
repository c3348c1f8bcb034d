"""Lean checkpoints: weights and optimizer state as safetensors shards (no pickles), exact
resume from them, old pickled checkpoints still read, and weights-only copies loaded in
the generation dtype."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from replayrl import storage
from replayrl.config import load_config
from replayrl.engine.resources import (
    Trainer,
    checkpoint_num_params,
    load_weights_only,
    weights_only_dtype,
)
from replayrl.errors import ReplayRLError
from replayrl.policy.models import load_policy, save_policy
from replayrl.policy.tiny_model import build_tiny_model, supervised_loss
from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer
from replayrl.policy.training import StepSettings
from replayrl.policy.training import make_optimizer as train_optimizer
from replayrl.policy.training_state import (
    LEGACY_OPTIMIZER_FILE,
    LEGACY_RNG_FILE,
    load_training_state,
    restore_rng_state,
    write_rng_state,
)

pytestmark = pytest.mark.unit
PROMPTS = ["12 + 34 =", "5 + 67 =", "99 + 1 ="]
TARGETS = [" 46", " 72", " 100"]


def make_optimizer(model):
    """AdamW with two groups of different lr and weight decay, so state or hyper-parameters
    restored onto the wrong parameters would change the next step."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() > 1]
    no_decay = [p for n, p in named if p.dim() <= 1]
    return torch.optim.AdamW(
        [
            {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3},
            {"params": decay, "weight_decay": 0.1},
        ],
        lr=1e-3,
        betas=(0.9, 0.98),
    )


def step(model, optimizer, tokenizer, k: int) -> None:
    loss = supervised_loss(
        model=model, tokenizer=tokenizer, prompts=PROMPTS[k % 3 :], targets=TARGETS[k % 3 :]
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


@pytest.fixture
def trained(tmp_path):
    """A tiny model after 3 AdamW steps, saved as a full checkpoint in shards of 500 KB."""
    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=5)
    optimizer = make_optimizer(model)
    for k in range(3):
        step(model, optimizer, tokenizer, k)
    save_policy(model, tokenizer, tmp_path / "ckpt", optimizer=optimizer, max_shard_size="500KB")
    return model, optimizer, tokenizer, tmp_path / "ckpt"


def resumed(directory: Path, *, load: bool):
    model, tokenizer = load_policy(directory)
    optimizer = make_optimizer(model)
    if load:
        assert load_training_state(optimizer, model, directory)
    return model, optimizer, tokenizer


def test_resume_from_shards_is_bit_identical(trained):
    """Load weights and optimizer state into a fresh model and optimizer: the next step
    equals the original's next step bit for bit; without the state it does not."""
    model, optimizer, tokenizer, ckpt = trained
    names = sorted(p.name for p in ckpt.iterdir())
    # several shards with an index, for the weights and for the optimizer; no pickles
    assert "model.safetensors.index.json" in names
    assert "optimizer.safetensors.index.json" in names
    assert sum(n.startswith("model-0") for n in names) >= 3
    assert sum(n.startswith("optimizer-0") for n in names) >= 3
    assert not [n for n in names if n.endswith((".pt", ".bin", ".pkl"))]
    # the ledger's parameter count reads the weight shards, not the optimizer's
    assert checkpoint_num_params(ckpt) == sum(p.numel() for p in model.parameters())
    meta = json.loads((ckpt / "optimizer.json").read_text())
    assert meta["param_groups"][0]["lr"] == 3e-3 and meta["param_groups"][1]["betas"] == [0.9, 0.98]
    assert meta["param_groups"][1]["params"][0] == "model.embed_tokens.weight"
    assert meta["state"]["model.embed_tokens.weight"]["step"]["value"] == 3.0

    again, again_opt, _ = resumed(ckpt, load=True)
    assert again_opt.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    fresh, fresh_opt, _ = resumed(ckpt, load=False)
    step(model, optimizer, tokenizer, 3)
    step(again, again_opt, tokenizer, 3)
    step(fresh, fresh_opt, tokenizer, 3)
    want = dict(model.named_parameters())
    for name, p in again.named_parameters():
        assert torch.equal(p, want[name]), name
    assert any(not torch.equal(p, want[n]) for n, p in fresh.named_parameters())


def test_only_training_state_is_left_out_of_weights_only_copies(trained, tmp_path):
    """Every file a full checkpoint adds is training state by `storage`'s rule, and no
    file of a weights-only save is: so the weights-only copy keeps the whole model."""
    model, optimizer, tokenizer, full = trained
    save_policy(model, tokenizer, tmp_path / "weights", max_shard_size="500KB")
    weights = {p.name for p in (tmp_path / "weights").iterdir()}
    added = {p.name for p in full.iterdir()} - weights
    assert {"optimizer.json", "rng_state.json", "rng_state.safetensors"} <= added
    assert all(storage.is_training_state(n) for n in added), added
    assert not [n for n in weights if storage.is_training_state(n)]
    assert storage.is_training_state(LEGACY_OPTIMIZER_FILE)
    assert storage.is_training_state(LEGACY_RNG_FILE)


def draws():
    return (
        torch.rand(4).tolist(),
        np.random.standard_normal(3).tolist(),  # odd count: leaves a cached Gaussian
        [random.random(), random.gauss(0, 1)],
    )


def test_rng_state_round_trips_without_pickle(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    draws()  # leave numpy's and Python's cached Gaussians set
    write_rng_state(tmp_path)
    first = draws()
    assert restore_rng_state(tmp_path)
    assert draws() == first
    assert not restore_rng_state(tmp_path / "none")


def test_old_pickled_checkpoints_still_resume(trained, tmp_path):
    """A checkpoint of the earlier format (optimizer.pt, rng_state.pt) resumes exactly."""
    model, optimizer, tokenizer, _ = trained
    old = tmp_path / "old"
    save_policy(model, tokenizer, old)
    torch.save(optimizer.state_dict(), old / LEGACY_OPTIMIZER_FILE)
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": None}
    rng["python"] = random.getstate()
    torch.save(rng, old / LEGACY_RNG_FILE)
    first = draws()
    again, again_opt, _ = resumed(old, load=True)
    assert draws() == first  # the RNG state came back too
    step(model, optimizer, tokenizer, 3)
    step(again, again_opt, tokenizer, 3)
    want = dict(model.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in again.named_parameters())


def test_optimizer_state_of_another_model_is_refused(trained):
    _, _, _, ckpt = trained
    other = build_tiny_model(vocab_size=VOCAB_SIZE, num_layers=1, seed=0)
    with pytest.raises(ReplayRLError, match="does not fit this model's parameters"):
        load_training_state(make_optimizer(other), other, ckpt)


def test_weights_only_dtype_is_the_generation_dtype():
    cfg = load_config(text="")
    assert weights_only_dtype(cfg, "cpu") == torch.float32
    assert weights_only_dtype(cfg, "cuda") == torch.bfloat16
    vllm = load_config(text="", overrides=["rollout.backend=vllm"])
    assert weights_only_dtype(vllm, "cuda") == torch.bfloat16  # vllm_dtype "auto"
    assert weights_only_dtype(vllm, "cpu") == torch.float32
    exact = load_config(text="", overrides=["rollout.backend=vllm", "rollout.vllm_dtype=float32"])
    assert weights_only_dtype(exact, "cuda") == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_weights_only_copy_and_trainer_load_float32_on_cpu(tmp_path):
    settings = StepSettings(
        loss_name="grpo",
        clip_eps=0.2,
        is_cap=None,
        temperature=1.0,
        grad_clip=1.0,
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.999),
    )
    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=5)
    optimizer = train_optimizer(model, lr=1e-3, weight_decay=0.0, betas=settings.betas)
    step(model, optimizer, tokenizer, 0)
    cfg = load_config(text="", overrides=[f"model.cache_dir={tmp_path / 'cache'}"])
    paths = storage.lineage_paths(str(tmp_path / "runs"), "lin")
    save_policy(model, tokenizer, tmp_path / "ckpt", optimizer=optimizer)
    storage.write_checkpoint(tmp_path / "ckpt", paths.checkpoint(3))
    copy, _ = load_weights_only(cfg, paths, 3)
    trainer = Trainer.load(cfg, paths, version=3, settings=settings)
    want = dict(model.named_parameters())
    for loaded in (copy, trainer.model):
        for name, p in loaded.named_parameters():
            assert p.dtype == torch.float32 and torch.equal(p, want[name]), name
    assert trainer.optimizer.state  # the trainer's copy has the optimizer state


def test_the_weights_index_names_only_weight_files(tmp_path):
    """Engines that glob "*.safetensors" (vLLM) read the weights index; the optimizer's
    safetensors shards must not be in it, even when the weights are one file."""
    import json

    from replayrl.policy.models import save_policy
    from replayrl.policy.tiny_model import build_tiny_model
    from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer
    from replayrl.policy.training import make_optimizer

    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=0)
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999))
    save_policy(model, build_byte_tokenizer(), tmp_path, optimizer=optimizer)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert "model.embed_tokens.weight" in index["weight_map"]
    assert len(list(tmp_path.glob("optimizer*.safetensors"))) >= 1
