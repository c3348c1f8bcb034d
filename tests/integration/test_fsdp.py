"""Sharded training (train.distributed=fsdp, FSDP2): 2 gloo ranks on the CPU end several
steps that move the weights with the same parameters and losses as one process on the same
global batches (GRPO and AsymRE); a 2-rank run killed after its checkpoint resumes to the
same bits as an uninterrupted run; its sharded optimizer state loads on one process.

The reference is the single-process trainer, `training.gradient_step` on whole batches; the
ranks cut their shards into micro-batches and log-prob chunks, reduce-scatter gradients
after every micro-batch and clip on the global norm of their sharded gradients."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from rollout_rows import sampled_rows
from safetensors.torch import load_file

from replayrl.policy.distributed import train_on_batches
from replayrl.policy.models import load_policy, save_policy
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer
from replayrl.policy.training import StepSettings, StepStats, gradient_step, make_optimizer
from replayrl.policy.training_state import load_training_state, named_optimizer_state

pytestmark = pytest.mark.integration
SETTINGS = StepSettings(
    loss_name="grpo",
    clip_eps=0.2,
    is_cap=None,
    temperature=1.0,
    grad_clip=1.0,
    lr=1e-2,  # large enough that 4 steps move weights ~40 x the tolerance
    weight_decay=0.01,
    betas=(0.9, 0.999),
    micro_batch_size=2,  # two micro-batches per shard, gradients reduce-scattered after each
    logprob_chunk_tokens=5,
)
STEPS = 4
# Float32 sums in another order (shards, micro-batches, reduce-scatter) differ by ~1e-10 in
# a gradient; Adam's update lr * m / (sqrt(v) + eps) amplifies that where a coordinate's
# gradient is itself ~eps. Measured after 4 steps at lr 1e-2: at most 4.7e-5 (GRPO) and
# 6.6e-5 (AsymRE), against moves of up to 4.0e-2. The test allows 2e-4, 2% of one lr.
PARAM_ATOL = 0.02 * SETTINGS.lr


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny checkpoint v0 with (fresh) optimizer state, written by one process, and 4
    global batches of 7 real rollouts (odd: the two shards and their token counts differ)."""
    root = tmp_path_factory.mktemp("fsdp")
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=11)
    tokenizer = build_byte_tokenizer()
    optimizer = make_optimizer(model, lr=SETTINGS.lr, weight_decay=0.01, betas=SETTINGS.betas)
    save_policy(model, tokenizer, root / "v0", optimizer=optimizer)
    table = sampled_rows(model, tokenizer, num_samples=4)
    return root, [table.slice(7 * i, 7) for i in range(STEPS)]


def one_process(checkpoint: Path, batches, settings: StepSettings):
    """The single-process trainer on whole batches, from `checkpoint` (any optimizer format)."""
    model, tokenizer = load_policy(checkpoint)
    optimizer = make_optimizer(
        model, lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas
    )
    assert load_training_state(optimizer, model, checkpoint)
    stats = [
        gradient_step(
            model=model,
            optimizer=optimizer,
            rows=rows,
            pad_id=tokenizer.pad_token_id,
            settings=settings,
        )
        for rows in batches
    ]
    return model, optimizer, stats


def fsdp(root: Path, name: str, batches, settings=SETTINGS, *, start="v0", processes=2):
    out = root / name
    stats = train_on_batches(
        checkpoint_dir=root / start,
        out_dir=out,
        batches=batches,
        settings=settings,
        mode="fsdp",
        num_processes=processes,
        cpu=True,
        seed=0,
    )
    return out, stats


def assert_matches(out: Path, stats, reference, *, initial: Path, steps: int) -> float:
    """`out` (and its step stats) within tolerance of the one-process `reference`; returns
    the largest parameter difference. `steps`: the optimizer's step count at the end."""
    model, optimizer, ref_stats = reference
    params, start = load_file(out / "model.safetensors"), load_file(initial / "model.safetensors")
    want = model.state_dict()
    assert params.keys() == start.keys()
    worst = moved = 0.0
    for name, value in params.items():
        worst = max(worst, float((value - want[name]).abs().max()))
        moved = max(moved, float((value - start[name]).abs().max()))
    assert worst <= PARAM_ATOL, worst
    assert moved > 10 * PARAM_ATOL, moved  # the comparison can fail: the steps moved weights
    for got, ref in zip(stats, ref_stats, strict=True):
        assert got.num_tokens == ref.num_tokens
        assert got.loss == pytest.approx(ref.loss, rel=1e-4, abs=1e-6)
        assert got.grad_norm == pytest.approx(ref.grad_norm, rel=1e-4)
        assert got.clip_fraction == pytest.approx(ref.clip_fraction, abs=1e-6)
        assert got.mean_ratio == pytest.approx(ref.mean_ratio, rel=1e-5)
    # The sharded optimizer state, read back on one process, is the reference's.
    loaded, _ = load_policy(out)
    optim = make_optimizer(loaded, lr=SETTINGS.lr, weight_decay=0.01, betas=SETTINGS.betas)
    assert load_training_state(optim, loaded, out)
    got_state = named_optimizer_state(optim, loaded)["state"]
    ref_state = named_optimizer_state(optimizer, model)["state"]
    assert got_state.keys() == ref_state.keys()
    for name, state in ref_state.items():
        assert float(got_state[name]["step"]) == float(state["step"]) == steps
        assert torch.allclose(got_state[name]["exp_avg"], state["exp_avg"], atol=1e-6, rtol=1e-3)
    return worst


@pytest.fixture(scope="module")
def uninterrupted(setup):
    """GRPO, 4 steps on 2 ranks in one run."""
    root, batches = setup
    return fsdp(root, "grpo-2", batches)


@pytest.mark.slow
def test_two_ranks_match_one_process_grpo(setup, uninterrupted):
    root, batches = setup
    out, stats = uninterrupted
    reference = one_process(root / "v0", batches, SETTINGS)
    assert_matches(out, stats, reference, initial=root / "v0", steps=STEPS)
    # The weights are a plain Hugging Face checkpoint.
    model, _ = load_policy(out)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.slow
def test_two_ranks_match_one_process_asymre_with_activation_checkpointing(setup):
    root, batches = setup
    settings = dataclasses.replace(SETTINGS, loss_name="asymre", is_cap=2.0)
    stats = train_on_batches(
        checkpoint_dir=root / "v0",
        out_dir=root / "asymre-2",
        batches=batches,
        settings=settings,
        mode="fsdp",
        num_processes=2,
        activation_checkpointing=True,
        cpu=True,
        seed=0,
    )
    reference = one_process(root / "v0", batches, settings)
    assert_matches(root / "asymre-2", stats, reference, initial=root / "v0", steps=STEPS)


@pytest.mark.slow
def test_one_rank_matches_one_process_and_its_state_loads_without_a_group(setup):
    """FSDP over a group of one (in this process, no spawn): the same path; its DCP
    optimizer state loads on one process without a group."""
    root, batches = setup
    out, stats = fsdp(root, "one", batches[:2], processes=1)
    assert not torch.distributed.is_initialized()  # the group of one is gone again
    reference = one_process(root / "v0", batches[:2], SETTINGS)
    assert_matches(out, stats, reference, initial=root / "v0", steps=2)
    assert sorted(p.name for p in out.glob("optimizer.dcp.*")) == [
        "optimizer.dcp.__0_0.distcp",
        "optimizer.dcp.metadata",
    ]


_KILLED_RUN = """
import sys, pyarrow.parquet as pq
from pathlib import Path
from replayrl.policy.distributed import train_on_batches
from test_fsdp import SETTINGS
def main():
    root = Path(sys.argv[1])
    batches = [pq.read_table(root / f"batch{i}.parquet") for i in range(4)]
    run = dict(settings=SETTINGS, mode="fsdp", num_processes=2, cpu=True, seed=0)
    train_on_batches(checkpoint_dir=root / "v0", out_dir=root / "v1", batches=batches[:2], **run)
    (root / "v1.done").write_text("")
    # The next iteration, far longer than the test waits: killed while its ranks step.
    train_on_batches(checkpoint_dir=root / "v1", out_dir=root / "v2-killed",
                     batches=batches[2:] * 50, **run)
if __name__ == "__main__":
    main()
"""


def _ranks(pid: int) -> list[int]:
    """The training ranks `pid` has spawned (not multiprocessing's resource tracker)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    ranks = []
    for child in children:
        with contextlib.suppress(OSError):
            if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes():
                ranks.append(int(child))
    return ranks


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_a_killed_run_resumes_bit_for_bit_and_its_optimizer_loads_on_one_process(
    setup, uninterrupted, tmp_path
):
    root, batches = setup
    for i, rows in enumerate(batches):
        pq.write_table(rows, tmp_path / f"batch{i}.parquet")
    os.symlink(root / "v0", tmp_path / "v0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path])}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "v1.done").exists() or len(_ranks(proc.pid)) < 2:
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "the run never reached its second iteration"
            time.sleep(0.2)
        ranks = _ranks(proc.pid)
        time.sleep(3)  # into the next iteration
        before = _digests(tmp_path / "v1")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The ranks die with their parent (PR_SET_PDEATHSIG), and the checkpoint is untouched.
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{r}").exists() for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{r}").exists() for r in ranks)
    assert _digests(tmp_path / "v1") == before
    assert not (tmp_path / "v2-killed" / "model.safetensors").exists()

    # Resume on the same world size: the same bits as 4 steps in one run.
    resumed, stats = fsdp(tmp_path, "v2", batches[2:], start="v1")
    whole, whole_stats = uninterrupted
    got, want = load_file(resumed / "model.safetensors"), load_file(whole / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert [s.loss for s in stats] == [s.loss for s in whole_stats[2:]]
    a = _optimizer_on_one_process(resumed)
    b = _optimizer_on_one_process(whole)
    for name, state in b.items():
        for key, value in state.items():
            assert torch.equal(a[name][key], value), (name, key)

    # On another world size (one process): v1's sharded state loads, and the steps after it
    # match the 2-rank run's.
    reference = one_process(tmp_path / "v1", batches[2:], SETTINGS)
    assert_matches(whole, whole_stats[2:], reference, initial=tmp_path / "v1", steps=STEPS)


def _optimizer_on_one_process(checkpoint: Path) -> dict:
    model, _ = load_policy(checkpoint)
    optimizer = make_optimizer(model, lr=SETTINGS.lr, weight_decay=0.01, betas=SETTINGS.betas)
    assert load_training_state(optimizer, model, checkpoint)
    return named_optimizer_state(optimizer, model)["state"]


@pytest.mark.slow
def test_the_asynchronous_trainer_group_shards_through_the_same_path(tmp_path):
    """T = 2 sharded trainers of the asynchronous engine (one follower process): each step
    equals one trainer's on the whole batch; the full checkpoint they publish loads on one
    process (Hugging Face weights, sharded optimizer state)."""
    from replayrl.config import load_config
    from replayrl.engine.resources import Trainer
    from replayrl.engine.steps import step_settings
    from replayrl.engine.trainer_group import TrainerGroup
    from replayrl.storage import checkpoint_local_dir, paths_of

    preset = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
    cfg = load_config(
        preset,
        overrides=[
            f"storage.run_root={tmp_path / 'runs'}",
            "asynchronous.enabled=true",
            "asynchronous.trainers=2",
            "train.distributed=fsdp",
            "train.batch_size=7",
            "train.lr=1e-2",
            "train.micro_batch_size=2",
        ],
    )
    paths, s = paths_of(cfg), step_settings(cfg)
    model, tokenizer = build_tiny_model(vocab_size=VOCAB_SIZE, seed=11), build_byte_tokenizer()
    optimizer = make_optimizer(model, lr=s.lr, weight_decay=s.weight_decay, betas=s.betas)
    Trainer(model, tokenizer, optimizer, settings=s, version=0).save(paths.checkpoint(0))
    table = sampled_rows(model, tokenizer, num_samples=2)
    batches = [table.slice(0, 7), table.slice(7, 7)]
    reference = Trainer.load(cfg, paths, version=0, settings=s)
    group = TrainerGroup.start(cfg, None, checkpoint_version=0, world=2)
    try:
        assert group.sharded
        for step, rows in enumerate(batches, 1):
            want = reference.train([rows], seed=step)[0]
            got = group.train([rows], seed=step)[0]
            assert got.num_tokens == want.num_tokens
            assert got.loss == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
            assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
        assert group.version == reference.version == 2
        group.save(paths.checkpoint(2))
        group.save(paths.checkpoint(3), weights_only=True)
    finally:
        group.close()
    full = checkpoint_local_dir(paths.checkpoint(2), tmp_path / "cache")
    assert (full / "optimizer.dcp.__1_0.distcp").exists()
    weights = checkpoint_local_dir(paths.checkpoint(3), tmp_path / "cache")
    assert not list(weights.glob("optimizer*"))
    loaded = Trainer.load(cfg, paths, version=2, settings=s)
    want = reference.model.state_dict()
    for name, value in loaded.model.state_dict().items():
        assert torch.allclose(value, want[name], atol=PARAM_ATOL, rtol=0), name
    for p, q in zip(loaded.model.parameters(), reference.model.parameters(), strict=True):
        assert float(loaded.optimizer.state[p]["step"]) == 2
        ours, theirs = loaded.optimizer.state[p]["exp_avg"], reference.optimizer.state[q]["exp_avg"]
        assert torch.allclose(ours, theirs, atol=1e-6, rtol=1e-3)


_UNEVEN_RUN = """
import dataclasses, json, sys, pyarrow.parquet as pq
from pathlib import Path
from replayrl.policy.distributed import train_on_batches
from test_fsdp import SETTINGS
def main():
    root = Path(sys.argv[1])
    batches = [pq.read_table(root / f"batch{i}.parquet") for i in range(2)]
    settings = dataclasses.replace(SETTINGS, micro_batch_size=1)
    stats = train_on_batches(checkpoint_dir=root / "v0", out_dir=root / "uneven",
        batches=batches, settings=settings, mode="fsdp", num_processes=2, cpu=True, seed=0)
    (root / "stats.json").write_text(json.dumps([dataclasses.asdict(s) for s in stats]))
if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_ranks_with_different_numbers_of_micro_batches_finish_and_match_one_process(
    setup, tmp_path
):
    """7 rows on 2 ranks, one row per micro-batch: rank 0 cuts 4 micro-batches, rank 1 cuts 3
    (as rows of uneven lengths under a token budget do). FSDP all-gathers in each forward and
    reduce-scatters in each backward, so before the ranks agreed on the count (rank 1 padding
    with a pass that adds nothing) this run waited for ever; it is bounded here."""
    root, batches = setup
    for i, rows in enumerate(batches[:2]):
        pq.write_table(rows, tmp_path / f"batch{i}.parquet")
    os.symlink(root / "v0", tmp_path / "v0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path])}
    proc = subprocess.Popen([sys.executable, "-c", _UNEVEN_RUN, str(tmp_path)], env=env)
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
        proc.wait(timeout=30)
        pytest.fail("2 FSDP ranks with 4 and 3 micro-batches did not finish in 300 s")
    assert proc.returncode == 0
    settings = dataclasses.replace(SETTINGS, micro_batch_size=1)
    reference = one_process(root / "v0", batches[:2], settings)
    stats = [StepStats(**s) for s in json.loads((tmp_path / "stats.json").read_text())]
    assert_matches(tmp_path / "uneven", stats, reference, initial=root / "v0", steps=2)
