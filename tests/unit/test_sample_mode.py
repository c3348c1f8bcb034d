"""buffer.sample_mode: sampling with or without replacement across batches, for every arm.
The draw itself (`sampling.epoch_draw`, the asynchronous trainer's `pass_batch`) and what
the config makes of the knob."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from replayrl.buffer.sampling import draw, epoch_draw
from replayrl.config import load_config
from replayrl.engine.asynchronous.trainer import pass_batch
from replayrl.errors import ReplayRLError

pytestmark = pytest.mark.unit


def test_epoch_draw_uses_every_row_once_before_any_twice():
    out = epoch_draw(np.random.default_rng(0), 10, batch_size=4, num_batches=6)  # (6, 4)
    flat = out.reshape(-1)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert all(len(set(batch)) == 4 for batch in out)  # batches 3 and 5 straddle two passes


def test_epoch_draw_within_one_pass_is_the_on_policy_draw_it_replaces():
    # The on-policy arm drew one permutation cut into batches; its lineages keep their draws.
    old = np.random.default_rng(7).permutation(12)[:12].reshape(3, 4)
    got = draw(12, batch_size=4, num_batches=3, seed=7, mode="epoch", replace=False, where="t")
    assert (got == old).all()
    with pytest.raises(ReplayRLError, match="needs batch_size"):
        draw(3, batch_size=4, num_batches=1, seed=0, mode="epoch", replace=False, where="t")


def test_uniform_draws_recur_across_batches_and_epoch_ones_do_not():
    uni = draw(8, batch_size=4, num_batches=2, seed=3, mode="uniform", replace=False, where="t")
    ep = draw(8, batch_size=4, num_batches=2, seed=3, mode="epoch", replace=False, where="t")
    assert len(set(ep.reshape(-1))) == 8
    # Some seed makes the uniform mode repeat a row across the two batches.
    assert any(
        len(
            set(
                draw(
                    8, batch_size=4, num_batches=2, seed=s, mode="uniform", replace=False, where="t"
                ).reshape(-1)
            )
        )
        < 8
        for s in range(20)
    ), uni


def test_async_passes_draw_each_buffer_row_once_per_pass():
    rows = pa.table({"rollout_id": [f"r{i}" for i in range(10)], "x": list(range(10))})
    drawn: set[str] = set()
    rng = np.random.default_rng(0)
    batches = [pass_batch(rows, drawn, 4, rng).column("rollout_id").to_pylist() for _ in range(5)]
    flat = [rid for batch in batches for rid in batch]
    assert sorted(flat[:10]) == sorted(rows.column("rollout_id").to_pylist())
    assert len(set(flat[10:20])) == 10
    assert all(len(set(batch)) == 4 for batch in batches)
    # A row that left the buffer leaves the pass; new rows join it.
    drawn.clear()
    first = pass_batch(rows, drawn, 4, rng).column("rollout_id").to_pylist()
    newer = pa.table({"rollout_id": [f"s{i}" for i in range(6)], "x": list(range(6))})
    second = pass_batch(newer, drawn, 4, rng).column("rollout_id").to_pylist()
    assert not drawn & set(first) and set(second) <= drawn


def test_the_knob_for_every_arm(tmp_path):
    base = ["train.batch_size=16", "rollout.prompts_per_iteration=8"]
    replay = load_config(overrides=[*base, "buffer.sample_mode=epoch"], arm="replay")
    assert replay.buffer.sampling("replay") == "epoch"
    default = load_config(overrides=base, arm="replay")
    assert default.buffer.sampling("replay") == "uniform"
    assert load_config(overrides=base, arm="on-policy").buffer.sampling("on-policy") == "epoch"
    # null is the old behaviour: lineages keep their hash; epoch is another lineage.
    assert load_config(overrides=[*base, "buffer.sample_mode=uniform"]).config_hash() != (
        replay.config_hash()
    )
    assert default.config_hash() == load_config(overrides=base).config_hash()
    plain = load_config(overrides=[*base, "buffer.sample_mode=epoch"], arm="replay-plain")
    assert plain.buffer.sampling("replay-plain") == "epoch"
    with pytest.raises(ReplayRLError, match="on-policy arm uses each row exactly once"):
        load_config(overrides=[*base, "buffer.sample_mode=uniform"], arm="on-policy")
    with pytest.raises(ReplayRLError, match="contradicts buffer.sample_with_replacement"):
        load_config(
            overrides=[*base, "buffer.sample_mode=epoch", "buffer.sample_with_replacement=true"]
        )
    with pytest.raises(ReplayRLError, match='"uniform", "epoch" or null'):
        load_config(overrides=[*base, "buffer.sample_mode=sometimes"])
