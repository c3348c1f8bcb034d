"""What the trainer does only on CUDA (pinned, non-blocking batches in `collate`; the fused
AdamW of `make_optimizer`), seen from the CPU: here nothing changes, and the optimizer's
kernel is this process's choice, never the checkpoint's. The CUDA side itself can only be
checked on a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from test_train import rows_of_unequal_length, settings

from replayrl.policy.batching import collate
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import PAD_TOKEN_ID, VOCAB_SIZE
from replayrl.policy.training import gradient_step, make_optimizer
from replayrl.policy.training_state import load_training_state, save_training_state

pytestmark = pytest.mark.unit


def test_a_batch_for_the_cpu_is_the_host_batch_unpinned():
    rows = rows_of_unequal_length()
    host = collate(rows, pad_id=PAD_TOKEN_ID)
    for device in ("cpu", torch.device("cpu")):
        placed = collate(rows, pad_id=PAD_TOKEN_ID, device=device)
        assert placed.keys() == host.keys()
        for key, value in placed.items():
            assert torch.equal(value, host[key]) and value.dtype == host[key].dtype, key
            assert value.device.type == "cpu" and not value.is_pinned(), key


def test_the_cpu_optimizer_keeps_adamws_default_kernels():
    optimizer = make_optimizer(
        build_tiny_model(vocab_size=VOCAB_SIZE, seed=3),
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.999),
    )
    (group,) = optimizer.param_groups
    assert group["fused"] is None and group["foreach"] is None and not group["capturable"]


def test_a_checkpoint_from_a_fused_optimizer_resumes_with_this_processs_kernel(tmp_path):
    """A checkpoint written by a fused AdamW (as on a GPU; torch's CPU build has one too)
    resumes on the CPU with the CPU's kernel: `load_state_dict` alone would take the saved
    group's `fused: True` over this optimizer's."""
    s = settings("grpo", micro_batch_size=4, logprob_chunk_tokens=16)
    rows = rows_of_unequal_length(seed=1)
    writer = build_tiny_model(vocab_size=VOCAB_SIZE, seed=3)
    fused = torch.optim.AdamW(
        writer.parameters(), lr=s.lr, weight_decay=0.0, betas=s.betas, fused=True
    )
    gradient_step(model=writer, optimizer=fused, rows=rows, pad_id=PAD_TOKEN_ID, settings=s)
    save_training_state(fused, writer, tmp_path, max_shard_size="10MB")

    reader = copy.deepcopy(writer)
    optimizer = make_optimizer(reader, lr=s.lr, weight_decay=0.0, betas=s.betas)
    assert load_training_state(optimizer, reader, tmp_path)
    (group,) = optimizer.param_groups
    assert group["fused"] is None and group["foreach"] is None
    state = optimizer.state[next(reader.parameters())]
    assert state["step"].device.type == "cpu" and float(state["step"]) == 1.0
    assert torch.equal(state["exp_avg"], fused.state[next(writer.parameters())]["exp_avg"])
    gradient_step(model=reader, optimizer=optimizer, rows=rows, pad_id=PAD_TOKEN_ID, settings=s)
    assert float(state["step"]) == 2.0
