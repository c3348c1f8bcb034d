"""Gradient steps on several processes: `accelerate` DistributedDataParallel ("ddp"), or
PyTorch FSDP2 ("fsdp", `replayrl.policy.sharded`).

`train_on_batches` takes a local checkpoint directory, the batches already sampled from the
buffer (one pyarrow table of rollout rows per gradient step, each the *global* batch B) and
an output directory. It starts `num_processes` workers (the `spawn` start method: delta-rs
is not fork-safe), each loads the checkpoint and its optimizer state, takes a contiguous
shard of every batch, and steps; rank 0 writes the trained policy with `models.save_policy`
(the same checkpoint layout as one process). With one process it runs in the caller's
process (on the GPU when there is one).

Same global batch, same result: the loss is a token mean over the whole global batch, so
each rank divides its token sum by the *global* token count and multiplies by the world
size before backward (`training.gradient_step` with `DataParallel` replicas); DDP's
gradient average then equals the gradient of the single-process loss (up to float
summation order). Gradients are all-reduced once per step, after the last micro-batch.
Gradient clipping runs on the synchronised gradients, so it sees the global norm. Under
"ddp" each process holds a whole replica of the model and its optimizer state; under "fsdp"
each holds 1/num_processes of the parameters, gradients and AdamW state (the same
`gradient_step`, with `sharded.FullyShardedReplicas`), and the checkpoint's optimizer state
is written by every rank (torch.distributed.checkpoint) next to the gathered weights.

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
from typing import TYPE_CHECKING

import torch

from replayrl.errors import ReplayRLError
from replayrl.policy.loss_kernels import TokenPolicyLoss
from replayrl.policy.replicas import DataParallel
from replayrl.policy.training import (
    NonFiniteStepError,
    StepSettings,
    StepStats,
    gradient_step,
    make_optimizer,
    prepare_model,
)

if TYPE_CHECKING:  # annotations only: the GPU smoke imports this without pyarrow
    import pyarrow as pa

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


def make_accelerator(*, cpu: bool):
    """An `accelerate.Accelerator` in the current process's distributed env. `cpu=True`
    forces CPU (gloo between processes); otherwise the GPU when there is one."""
    from accelerate import Accelerator

    return Accelerator(cpu=cpu)


def _steps(batches, *, model, optimizer, pad_id, settings, replicas, rank) -> list[StepStats]:
    stats = []
    for step, rows in enumerate(batches, start=1):
        try:
            stats.append(
                gradient_step(
                    model=model,
                    optimizer=optimizer,
                    rows=shard_rows(rows, rank=rank, world_size=replicas.world),
                    pad_id=pad_id,
                    settings=settings,
                    replicas=replicas,
                )
            )
        except NonFiniteStepError as e:
            raise e.at(step=step) from None
    return stats


def _run(*, mode: str = "ddp", rank: int = 0, world: int = 1, port: int = 0, **kwargs):
    """The body of rank `rank` of `world` (rendezvous on 127.0.0.1:`port`; 0 = a free one)."""
    if mode == "fsdp":
        return _run_fsdp(rank=rank, world=world, port=port or free_port(), **kwargs)
    return _run_ddp(**kwargs)  # accelerate reads the rendezvous from the environment


def join_group(*, rank: int, world: int, port: int, gpu: bool) -> torch.device:
    """Join (or, for rank 0, start) the default process group on 127.0.0.1:`port`: NCCL with
    rank r on GPU r, gloo on the CPU. Returns this rank's device."""
    import datetime

    if gpu:
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        "nccl" if gpu else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    return torch.device(f"cuda:{rank}") if gpu else torch.device("cpu")


# How long one collective may wait for the other ranks (a step's all-reduce, the start).
GROUP_TIMEOUT_S = 600.0
# What `torchrun` sets in each rank for env:// rendezvous (from the PET_* variables Kubeflow
# Trainer's torch plugin sets on a TrainJob's pods).
ENV_RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def join_env_group(*, gpu: bool) -> tuple[int, int, int, torch.device]:
    """Join the default process group of ranks started by `torchrun` (several nodes):
    `init_method="env://"` with RANK and WORLD_SIZE, NCCL on GPU LOCAL_RANK of this node
    (not GPU RANK: ranks of other nodes count on), gloo on the CPU. Returns (rank, world,
    local rank, this rank's device). Refuses with one line when a variable is missing or not
    a number, or names a GPU this node does not have."""
    import datetime

    missing = [name for name in ENV_RENDEZVOUS if not os.environ.get(name)]
    if missing:
        raise ReplayRLError(
            f"A trainer rank needs {', '.join(missing)} in its environment (torchrun sets "
            "them, from the PET_* variables of a Kubeflow TrainJob); start it with "
            "`python -m torch.distributed.run`."
        )
    try:
        rank, world, local = (int(os.environ[n]) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError:
        raise ReplayRLError(
            f"RANK, WORLD_SIZE and LOCAL_RANK must be whole numbers; got "
            f"{os.environ['RANK']!r}, {os.environ['WORLD_SIZE']!r}, "
            f"{os.environ['LOCAL_RANK']!r}."
        ) from None
    if not 0 <= rank < world or local < 0:
        raise ReplayRLError(
            f"RANK={rank} LOCAL_RANK={local} WORLD_SIZE={world}: a rank is in [0, WORLD_SIZE) "
            "and LOCAL_RANK >= 0."
        )
    if gpu and local >= torch.cuda.device_count():
        raise ReplayRLError(
            f"LOCAL_RANK={local} but this node sees {torch.cuda.device_count()} GPU(s): one "
            "GPU per rank of a node (the TrainJob's processes per node at most its GPUs)."
        )
    if gpu:
        torch.cuda.set_device(local)
    torch.distributed.init_process_group(
        "nccl" if gpu else "gloo",
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    return rank, world, local, torch.device(f"cuda:{local}") if gpu else torch.device("cpu")


def _run_fsdp(
    *,
    rank: int,
    world: int,
    port: int,
    checkpoint_dir: Path,
    out_dir: Path,
    batches: list[pa.Table],
    settings: StepSettings,
    activation_checkpointing: bool,
    cpu: bool,
    seed: int,
) -> list[StepStats]:
    """The body of every rank under "fsdp" (one alone is a group of one): join the group,
    load, shard, load the optimizer state, step, save, leave the group."""
    from replayrl.policy.models import load_policy
    from replayrl.policy.sharded import load_sharded_state, save_sharded, shard_policy

    torch.manual_seed(seed)
    device = join_group(
        rank=rank, world=world, port=port, gpu=not cpu and torch.cuda.is_available()
    )
    try:
        policy, tokenizer = load_policy(checkpoint_dir)
        prepare_model(policy, activation_checkpointing=activation_checkpointing)
        replicas = shard_policy(policy, settings, device=device, world=world)
        optimizer = make_optimizer(
            policy, lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas
        )
        load_sharded_state(policy, optimizer, checkpoint_dir)
        stats = _steps(
            batches,
            model=policy,
            optimizer=optimizer,
            pad_id=tokenizer.pad_token_id,
            settings=settings,
            replicas=replicas,
            rank=rank,
        )
        save_sharded(policy, tokenizer, optimizer, Path(out_dir), rank=rank)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    return stats


def _run_ddp(
    *,
    checkpoint_dir: Path,
    out_dir: Path,
    batches: list[pa.Table],
    settings: StepSettings,
    activation_checkpointing: bool,
    cpu: bool,
    seed: int,
) -> list[StepStats]:
    """The body every process runs under "ddp", inside its distributed environment."""
    from replayrl.policy.models import load_policy, save_policy
    from replayrl.policy.training_state import load_training_state

    torch.manual_seed(seed)
    accelerator = make_accelerator(cpu=cpu)
    policy, tokenizer = load_policy(checkpoint_dir)
    prepare_model(policy, activation_checkpointing=activation_checkpointing)
    optimizer = make_optimizer(
        policy, lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas
    )
    load_training_state(optimizer, policy, checkpoint_dir)
    module, optimizer = accelerator.prepare(TokenPolicyLoss(policy, settings), optimizer)
    rank, world = accelerator.process_index, accelerator.num_processes
    replicas = DataParallel(module, world=world, device=accelerator.device)
    stats = _steps(
        batches,
        model=policy,
        optimizer=optimizer,
        pad_id=tokenizer.pad_token_id,
        settings=settings,
        replicas=replicas,
        rank=rank,
    )
    if accelerator.is_main_process:
        # Replicas are identical after every step: rank 0's are the trained policy.
        save_policy(policy, tokenizer, Path(out_dir), optimizer=optimizer.optimizer)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return stats


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this rank when the process that started it dies (torch's spawn asks for
    SIGINT, which a rank blocked in a collective never acts on), and exit at once when that
    process is already gone (it died before the request was in place)."""
    import signal

    from torch.multiprocessing import _prctl_pr_set_pdeathsig

    _prctl_pr_set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def _worker(
    rank: int, world_size: int, port: int, kwargs: dict, stats_path: str, parent_pid: int
) -> None:
    _die_with_parent(parent_pid)
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
    stats = _run(**kwargs, rank=rank, world=world_size, port=port)
    if rank == 0:
        Path(stats_path).write_text(json.dumps([asdict(s) for s in stats]))


def free_port() -> int:
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
    activation_checkpointing: bool = False,
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
        mode=mode,
        checkpoint_dir=Path(checkpoint_dir),
        out_dir=Path(out_dir),
        batches=list(batches),
        settings=settings,
        activation_checkpointing=activation_checkpointing,
        cpu=cpu,
        seed=seed,
    )
    if num_processes == 1 and mode == "fsdp":
        return _run(**kwargs)  # a group of one, in this process
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
            args=(num_processes, free_port(), kwargs, stats_path, os.getpid()),
            nprocs=num_processes,
            join=True,
            start_method="spawn",
        )
        return [StepStats(**s) for s in json.loads(Path(stats_path).read_text())]
