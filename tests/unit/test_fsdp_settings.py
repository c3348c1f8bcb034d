"""What train.distributed=fsdp needs without processes: the config accepts it (and says when
to use it), and AdamW's state is allocated when the trainer loads, with the same steps as
when the first step allocates it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from replayrl.config import load_config
from replayrl.errors import ReplayRLError
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import VOCAB_SIZE
from replayrl.policy.training import allocate_optimizer_state, make_optimizer
from replayrl.policy.training_state import DCP_PREFIX
from replayrl.storage.checkpoints import is_training_state

pytestmark = pytest.mark.unit
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


def test_fsdp_is_a_distributed_mode_and_the_errors_say_when_to_use_it():
    cfg = load_config(PRESET, overrides=["train.distributed=fsdp", "train.num_processes=2"])
    assert cfg.train.distributed == "fsdp"
    with pytest.raises(ReplayRLError, match="'none', 'ddp' or 'fsdp'"):
        load_config(PRESET, overrides=["train.distributed=zero"])
    with pytest.raises(ReplayRLError, match="do not fit one GPU") as e:
        load_config(PRESET, overrides=["train.num_processes=2"])
    assert "fits one GPU" not in str(e.value)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_one_process_group_beside_the_vllm_engine_is_refused_at_load(mode):
    vllm = ["rollout.backend=vllm", f"train.distributed={mode}"]
    with pytest.raises(ReplayRLError, match="train.distributed=none, or train.num_processes >= 2"):
        load_config(PRESET, overrides=[*vllm, "train.num_processes=1"])
    assert load_config(PRESET, overrides=[*vllm, "train.num_processes=2"]).train.num_processes == 2
    # The transformers backend holds no process group; a group of one is fine there.
    assert load_config(PRESET, overrides=[f"train.distributed={mode}"]).train.distributed == mode


def test_adamw_state_exists_before_the_first_step_and_changes_no_step():
    model = build_tiny_model(vocab_size=VOCAB_SIZE, hidden_size=32, num_layers=1, seed=3)
    lazy_model = copy.deepcopy(model)
    eager = make_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
    lazy = torch.optim.AdamW(lazy_model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
    params = list(model.parameters())
    assert all(eager.state[p]["exp_avg"].shape == p.shape for p in params)
    assert all(float(eager.state[p]["step"]) == 0 for p in params)
    assert not lazy.state
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for a, b in zip(params, lazy_model.parameters(), strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        eager.step()
        lazy.step()
    for a, b in zip(params, lazy_model.parameters(), strict=True):
        assert torch.equal(a, b)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(eager.state[a][key], lazy.state[b][key])
    allocate_optimizer_state(eager)  # leaves existing state alone
    assert float(eager.state[params[0]]["step"]) == 3


def test_dcp_files_are_training_state_that_weights_only_copies_leave_out():
    for name in (DCP_PREFIX + "metadata", DCP_PREFIX + "__1_0.distcp"):
        assert is_training_state(name)


def test_the_asynchronous_trainers_shard_with_fsdp_only_when_there_are_several():
    on = ["asynchronous.enabled=true", "train.batch_size=8"]
    cfg = load_config(PRESET, overrides=[*on, "asynchronous.trainers=2", "train.distributed=fsdp"])
    assert cfg.train.distributed == "fsdp"
    with pytest.raises(ReplayRLError, match="asynchronous.trainers >= 2"):
        load_config(PRESET, overrides=[*on, "train.distributed=fsdp"])
    with pytest.raises(ReplayRLError, match="none .* or\\s+fsdp"):
        load_config(PRESET, overrides=[*on, "train.distributed=ddp", "train.num_processes=2"])
