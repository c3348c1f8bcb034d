"""Gradient steps on several processes through `accelerate`: DDP by default, FSDP selectable.

`train_on_batches` takes a local checkpoint directory, the batches already sampled from the
buffer (one pyarrow table of rollout rows per gradient step, each the *global* batch B) and
an output directory. It starts `num_processes` workers (the `spawn` start method: delta-rs
is not fork-safe), each loads the checkpoint and its optimizer state, takes a contiguous
shard of every batch, and steps; rank 0 writes the trained model, tokenizer and optimizer
state to the output directory in the same layout as `models.save_policy`. With one process
it runs in the caller's process (on the GPU when there is one).

Same global batch, same result: the loss is a token mean over the whole global batch, so
each rank scales its local token sum by `world_size / global_tokens` before backward; DDP's
gradient average then equals the gradient of the single-process loss (up to float summation
order). Gradient clipping runs on the synchronised gradients, so it sees the global norm.

This module knows nothing about the buffer, storage or trackers: it reads and writes local
directories, and publishing the checkpoint (COMPLETE marker, S3) is the caller's job.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from replayrl.errors import ReplayRLError
from replayrl.train import StepSettings, StepStats, batch_loss, make_optimizer

MODES = ("none", "ddp", "fsdp")
_STATS_FILE = "stats.json"


def check_mode(mode: str, num_processes: int) -> None:
    if mode not in MODES:
        raise ReplayRLError(f"train.distributed must be one of {', '.join(MODES)}; got '{mode}'.")
    if num_processes < 1:
        raise ReplayRLError(f"train.num_processes must be >= 1; got {num_processes}.")
    if mode == "none" and num_processes > 1:
        raise ReplayRLError(
            f"train.num_processes={num_processes} needs train.distributed=ddp or fsdp; "
            "set one, or set train.num_processes=1."
        )


def shard_rows(rows: pa.Table, *, rank: int, world_size: int) -> pa.Table:
    """Rank `rank`'s contiguous share of a global batch (sizes differ by at most one row).

    Example: 5 rows on 2 ranks -> rank 0 gets rows 0..2, rank 1 gets rows 3..4.
    """
    if rows.num_rows < world_size:
        raise ReplayRLError(
            f"A batch of {rows.num_rows} rows cannot be split over {world_size} processes; "
            f"raise train.batch_size to at least {world_size} or use fewer processes."
        )
    size, extra = divmod(rows.num_rows, world_size)
    # The first `extra` ranks take one row more.
    return rows.slice(rank * size + min(rank, extra), size + (rank < extra))


def make_accelerator(*, mode: str, cpu: bool):
    """An `accelerate.Accelerator` for `mode` in the current process's distributed env.

    `cpu=True` forces CPU (gloo between processes); otherwise the GPU when there is one.
    """
    from accelerate import Accelerator

    plugin = None
    if mode == "fsdp":
        from accelerate.utils import FullyShardedDataParallelPlugin

        # FULL_STATE_DICT: rank 0 gathers whole tensors, so the checkpoint is the plain
        # Hugging Face layout whatever the number of processes that wrote it.
        plugin = FullyShardedDataParallelPlugin(
            state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=False
        )
    return Accelerator(cpu=cpu, fsdp_plugin=plugin)


def _global_sum(accelerator, values: list[float]) -> list[float]:
    """Elementwise sum of `values` over all processes (float64, so counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="sum")
    return t.tolist()


def distributed_gradient_step(
    *, accelerator, model, optimizer, rows: pa.Table, pad_id: int, settings: StepSettings
) -> StepStats:
    """One optimizer step on this rank's shard `rows` of a global batch; stats are global.

    Equals `train.gradient_step` on the whole global batch (same loss, clip and stats).
    """
    # this rank's rows only
    batch, out = batch_loss(model=model, rows=rows, pad_id=pad_id, settings=settings)
    rewards = rows.column("reward").to_numpy(zero_copy_only=False)
    local_tokens = out.num_tokens
    global_tokens, clip_sum, ratio_sum, adv_sum, reward_sum, num_rows = _global_sum(
        accelerator,
        [
            local_tokens,
            out.clip_fraction * local_tokens,
            out.mean_ratio * local_tokens,
            float(batch["advantages"].sum()),
            float(np.sum(rewards)),
            rows.num_rows,
        ],
    )
    # Local token sum over the global token count, times world size: DDP averages gradients
    # over ranks, which turns this into the gradient of the global token mean.
    scale = local_tokens * accelerator.num_processes / max(global_tokens, 1.0)
    loss = out.loss * scale
    optimizer.zero_grad(set_to_none=True)
    accelerator.backward(loss)
    if settings.grad_clip > 0:
        grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), settings.grad_clip))
    else:
        # max_norm=inf measures the (global, sharding-aware) norm without clipping.
        grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), float("inf")))
    optimizer.step()
    (global_loss,) = _global_sum(accelerator, [float(loss.detach()) / accelerator.num_processes])
    tokens = max(global_tokens, 1.0)
    return StepStats(
        loss=global_loss,
        clip_fraction=clip_sum / tokens,
        # An empty mask means "still on-policy" (1.0), as in `losses`.
        mean_ratio=ratio_sum / tokens if global_tokens else 1.0,
        grad_norm=grad_norm,
        num_tokens=int(global_tokens),
        mean_advantage=adv_sum / max(num_rows, 1.0),
        mean_reward=reward_sum / max(num_rows, 1.0),
    )


def _save(accelerator, model, optimizer, tokenizer, out_dir: Path, mode: str) -> None:
    """Rank 0 writes the HF layout plus the optimizer state (`training_state`: whole
    tensors keyed by parameter name, in safetensors shards)."""
    from replayrl.models import MAX_SHARD_SIZE
    from replayrl.training_state import named_optimizer_state, write_optimizer_state

    state = accelerator.get_state_dict(model)  # gathers FSDP shards; a no-op copy for DDP
    if mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        optim_state = get_optimizer_state_dict(
            model, optimizer.optimizer, options=StateDictOptions(full_state_dict=True)
        )
    else:
        optim_state = named_optimizer_state(optimizer, accelerator.unwrap_model(model))
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(
            out_dir, state_dict=state, safe_serialization=True, max_shard_size=MAX_SHARD_SIZE
        )
        tokenizer.save_pretrained(out_dir)
        write_optimizer_state(optim_state, out_dir, max_shard_size=MAX_SHARD_SIZE)
    accelerator.wait_for_everyone()


def _run(
    *,
    checkpoint_dir: Path,
    out_dir: Path,
    batches: list[pa.Table],
    settings: StepSettings,
    mode: str,
    cpu: bool,
    seed: int,
) -> list[StepStats]:
    """The body every process runs, inside its distributed environment."""
    from replayrl.models import load_policy
    from replayrl.training_state import (
        LEGACY_OPTIMIZER_FILE,
        load_training_state,
        read_optimizer_state,
    )

    torch.manual_seed(seed)
    accelerator = make_accelerator(mode=mode, cpu=cpu)
    model, tokenizer = load_policy(checkpoint_dir)
    make = dict(lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas)
    if mode == "fsdp":
        # FSDP flattens and shards parameters: the optimizer must see the sharded ones, and
        # the saved (whole-tensor, name-keyed) optimizer state is scattered after prepare.
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(make_optimizer(model, **make))
        named = read_optimizer_state(checkpoint_dir)
        legacy = Path(checkpoint_dir) / LEGACY_OPTIMIZER_FILE
        if named is None and legacy.exists():
            named = torch.load(legacy, weights_only=True)
        if named is not None:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_optimizer_state_dict,
            )

            set_optimizer_state_dict(
                model,
                optimizer.optimizer,
                named,
                options=StateDictOptions(full_state_dict=True),
            )
    else:
        optimizer = make_optimizer(model, **make)
        load_training_state(optimizer, model, checkpoint_dir)
        model, optimizer = accelerator.prepare(model, optimizer)
    rank, world = accelerator.process_index, accelerator.num_processes
    stats = [
        distributed_gradient_step(
            accelerator=accelerator,
            model=model,
            optimizer=optimizer,
            rows=shard_rows(rows, rank=rank, world_size=world),
            pad_id=tokenizer.pad_token_id,
            settings=settings,
        )
        for rows in batches
    ]
    _save(accelerator, model, optimizer, tokenizer, Path(out_dir), mode)
    accelerator.end_training()
    return stats


def _worker(rank: int, world_size: int, port: int, kwargs: dict, stats_path: str) -> None:
    # accelerate reads the rendezvous from the environment, as `torchrun` would set it.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if kwargs["cpu"]:
        # Ranks share the cores; without a cap each would start one thread per core.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    stats = _run(**kwargs)
    if rank == 0:
        Path(stats_path).write_text(json.dumps([asdict(s) for s in stats]))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_on_batches(
    *,
    checkpoint_dir: Path,
    out_dir: Path,
    batches: list[pa.Table],
    settings: StepSettings,
    mode: str = "ddp",
    num_processes: int = 1,
    cpu: bool = False,
    seed: int,
) -> list[StepStats]:
    """Gradient steps on `batches` starting from `checkpoint_dir`; writes `out_dir`.

    `num_processes` workers (GPUs, or CPU processes with `cpu=True`) each take a shard of
    every global batch. One process runs here, in the caller's process. A worker that fails
    raises here (torch.multiprocessing re-raises it); `out_dir` may then hold a partial
    checkpoint, which the caller discards (it publishes only complete ones).
    Returns one `StepStats` per batch, computed over the global batch.
    """
    check_mode(mode, num_processes)
    if not cpu and num_processes > max(torch.cuda.device_count(), 1):
        raise ReplayRLError(
            f"train.num_processes={num_processes} but this machine has "
            f"{torch.cuda.device_count()} GPU(s); lower it to the number of GPUs."
        )
    kwargs = dict(
        checkpoint_dir=Path(checkpoint_dir),
        out_dir=Path(out_dir),
        batches=list(batches),
        settings=settings,
        mode="ddp" if mode == "none" else mode,
        cpu=cpu,
        seed=seed,
    )
    if num_processes == 1:
        from accelerate.state import AcceleratorState, GradientState

        try:
            return _run(**kwargs)
        finally:
            # accelerate keeps its state in process-wide singletons; clear them so the next
            # call in this process may pick another mode or device.
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="replayrl-dist-") as tmp:
        stats_path = str(Path(tmp) / _STATS_FILE)
        mp.start_processes(
            _worker,
            args=(num_processes, _free_port(), kwargs, stats_path),
            nprocs=num_processes,
            join=True,
            start_method="spawn",
        )
        return [StepStats(**s) for s in json.loads(Path(stats_path).read_text())]
