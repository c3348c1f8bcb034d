"""Sharded training (FSDP2, `torch.distributed.fsdp.fully_shard`): the policy's parameters,
gradients and AdamW state split over the processes of a group, and its checkpoints.

`shard_policy` wraps each decoder layer and then the whole `TokenPolicyLoss` in `fully_shard`
over a one-dimensional mesh of every rank (across nodes a 2-D one, replicated across nodes
and sharded within each: HSDP, where "each rank" below is each rank of a node): at rest each rank keeps 1/world of every parameter
(float32, a DTensor), of its gradient and of the AdamW moments made over those shards. A
layer's full weights exist only while it runs (all-gathered before its forward and again in
backward, freed after); the root group (embeddings, final norm, output layer) stays gathered
from the loss's forward to its backward, so the chunked output layer of `loss_kernels` reads
the whole projection. Gradients are reduce-scattered (averaged) after every micro-batch, so no
rank ever holds a whole model's gradient. The step itself is `training.gradient_step` with
`FullyShardedReplicas`: the token mean over the *global* batch, as one process takes it.

Precision: `dtype="bfloat16"` gathers parameters in bf16 and reduces gradients in float32
(`MixedPrecisionPolicy`), under the same bf16 autocast as one process; the master weights and
the AdamW moments stay float32 shards. `dtype="float32"` gathers and reduces float32.

Checkpoints (`save_sharded`), next to what one process writes:

    model.safetensors (+ index)       the weights gathered to rank 0 (full state dict), in
                                      the usual Hugging Face layout: `from_pretrained` and
                                      vLLM read them unchanged
    optimizer.dcp.metadata,           AdamW's state as torch.distributed.checkpoint (DCP)
    optimizer.dcp.__<rank>_0.distcp   wrote it, one file per rank holding that rank's shards;
                                      a flat folder (the checkpoint store copies files, not
                                      folders), so DCP's ".metadata" and "__r_0.distcp" are
                                      renamed with the prefix "optimizer.dcp." and linked
                                      back under their own names to be read
    rng_state.*                       rank 0's RNG states

Across nodes no disk is shared: every rank writes its files into a folder of its own
(`own_folder`), and its caller uploads them (DCP spreads the replicated shards over all
ranks: each "__<rank>_0.distcp" is needed).

Loading (`load_sharded_state`) takes either optimizer format: a DCP state on any world size
(DCP reshards it), or the single-file state one process writes (each rank takes its shards of
the full tensors). `training_state.load_training_state` reads a DCP state on one process.
This module knows nothing about the buffer, storage or trackers.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import replace
from pathlib import Path

import torch

from replayrl.errors import ReplayRLError
from replayrl.policy.loss_kernels import TokenPolicyLoss
from replayrl.policy.replicas import DataParallel
from replayrl.policy.training import StepSettings
from replayrl.policy.training_state import DCP_PREFIX, dcp_folder, has_dcp_optimizer


class FullyShardedReplicas(DataParallel):
    """`training.Replicas` of one fully sharded `TokenPolicyLoss` per rank (`shard_policy`)
    over the default process group."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        # Reduce-scatter after every micro-batch: the sum of the averaged shards is the
        # average of the sums, and no rank keeps an unsharded gradient between micro-batches.
        return contextlib.nullcontext()

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return 0.0
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(total, DTensor):  # each rank's shards' norm: the global one needs all
            total = total.full_tensor()
        if not math.isinf(max_norm):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)


def decoder_layers(policy: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's list of layers (Qwen2, Llama, Mistral... keep it at `base_model.layers`)."""
    layers = getattr(policy.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ReplayRLError(
            f"train.distributed=fsdp shards a decoder layer by layer, and "
            f"{type(policy).__name__} has no `base_model.layers`; use train.distributed=ddp."
        )
    return layers


def shard_policy(
    policy: torch.nn.Module,
    settings: StepSettings,
    *,
    device: torch.device,
    world: int,
    nodes: int = 1,
) -> FullyShardedReplicas:
    """Shard `policy` in place over every rank of the default process group (each decoder
    layer, then the loss module as the root) and return this rank's replicas. `policy`'s
    parameters become DTensor shards on `device`: build the optimizer after this.

    `nodes` > 1 (ranks node by node, as torchrun numbers them): hybrid sharding (HSDP), a
    2-D mesh that replicates across nodes and shards within each node, so the per-step
    all-gathers and reduce-scatters stay on a node's links and only the gradient all-reduce
    of each shard crosses nodes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if nodes > 1:
        if world % nodes:
            raise ReplayRLError(
                f"{world} trainer ranks do not split evenly over {nodes} nodes; "
                "asynchronous.trainers must be a multiple of asynchronous.trainer_nodes."
            )
        mesh = init_device_mesh(
            device.type, (nodes, world // nodes), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device.type, (world,))
    if settings.dtype == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    for layer in decoder_layers(policy):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    root = TokenPolicyLoss(policy, settings)
    # The root receives the batch dict: FSDP2 would cast every floating tensor of it to
    # param_dtype (cast_forward_inputs defaults to True), the behaviour log-probs and the
    # advantages too, and the loss's ratio would be computed from bf16 log-probs. The layers
    # keep the cast (their hidden states run in bf16).
    fully_shard(root, mesh=mesh, mp_policy=replace(mp, cast_forward_inputs=False))
    return FullyShardedReplicas(root, world=world, device=device)


# ---------------------------------------------------------------- checkpoints


def save_sharded(
    policy: torch.nn.Module,
    tokenizer,
    optimizer: torch.optim.Optimizer | None,
    directory: Path,
    *,
    rank: int,
    own_folder: bool = False,
) -> None:
    """Every rank calls this (it gathers): rank 0 writes the full weights and the tokenizer
    in the Hugging Face layout and its RNG states; every rank writes its optimizer shards
    (DCP). `optimizer` None: the weights and tokenizer only. All ranks have finished
    writing when it returns. `own_folder`: `directory` is this rank's own (ranks on other
    nodes do not see it), and each rank's files stay in its own; else every rank writes
    into rank 0's."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from replayrl.policy.models import save_policy
    from replayrl.policy.training_state import write_rng_state

    directory = Path(directory)
    full = gather_full_state(policy)
    if rank == 0:
        save_policy(policy, tokenizer, directory, state_dict=full)
        if optimizer is not None:
            write_rng_state(directory)
    del full
    if optimizer is not None:
        write_dcp_optimizer(
            get_optimizer_state_dict(policy, optimizer),
            directory,
            rank=rank,
            own_folder=own_folder,
        )
    _barrier()


def gather_full_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The sharded `policy`'s whole weights, gathered on the CPU of rank 0 (float32, the
    names one process's checkpoint has); every rank calls it (it gathers), the others get an
    empty dict. What a checkpoint writes, and what the generation engine is given between
    checkpoints."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(
        policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    # A tied weight (the output layer sharing the embeddings) is gathered under both its
    # names, as two tensors; keep the name one process's checkpoint has.
    names = {n for n, _ in policy.named_parameters(remove_duplicate=False)}
    tied = names - {n for n, _ in policy.named_parameters()}
    return {k: v for k, v in full.items() if k not in tied}


def broadcast_from_rank0(
    policy: torch.nn.Module, full: dict[str, torch.Tensor] | None, *, device: torch.device
) -> None:
    """Fill the sharded `policy` from rank 0's whole state dict `full` (taken before it was
    sharded; None on the other ranks, whose `policy` was built on the meta device by
    `models.policy_skeleton` and is allocated on `device` here). Every rank calls it: each
    receives only its shards (`set_model_state_dict(..., broadcast_from_rank0=True)`), and
    the buffers no state dict holds (the rotary frequencies) are broadcast as they are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if full is None:
        policy.to_empty(device=device)
    set_model_state_dict(
        policy,
        full or {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    for buffer in policy.buffers():
        torch.distributed.broadcast(buffer, src=0)


def write_dcp_optimizer(
    state: dict, directory: Path, *, rank: int, own_folder: bool = False
) -> None:
    """DCP-save a name-keyed optimizer state (sharded or whole) as flat files
    "optimizer.dcp.*" in `directory` (collective when a process group is up). `own_folder`:
    each rank writes into (and renames in) its own `directory`, as ranks on several nodes
    must (rank 0's holds the metadata, every rank's its "__<rank>_0.distcp"); else into
    rank 0's."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    staging = directory / f".dcp-staging-{os.getpid()}"
    if not own_folder:
        # Every rank must write into one folder: rank 0 names it and tells the others.
        names = [str(staging)]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(names, src=0)
        staging = Path(names[0])
    if rank == 0 or own_folder:
        staging.mkdir(parents=True, exist_ok=True)
    _barrier()
    dcp.save({"optimizer": state}, checkpoint_id=str(staging))
    _barrier()
    if rank == 0 or own_folder:
        for f in staging.iterdir():
            f.rename(directory / (DCP_PREFIX + f.name.removeprefix(".")))
        staging.rmdir()
    _barrier()


def load_sharded_state(
    policy: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path
) -> bool:
    """Load the optimizer state of the checkpoint in `directory` into the sharded `policy`'s
    `optimizer` (this rank's shards) and restore the RNG states; False when it has none.
    Every rank calls this."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from replayrl.policy.training_state import (
        LEGACY_OPTIMIZER_FILE,
        read_optimizer_state,
        restore_rng_state,
        tuples_like,
    )

    directory = Path(directory)
    if has_dcp_optimizer(directory):
        state = get_optimizer_state_dict(policy, optimizer)  # this rank's shards, to fill
        with dcp_folder(directory) as folder:
            dcp.load({"optimizer": state}, checkpoint_id=folder)
        set_optimizer_state_dict(policy, optimizer, state)
    elif (named := read_optimizer_state(directory)) is not None:
        # One process's full state: every rank reads it and keeps its shards.
        template = optimizer.state_dict()["param_groups"]
        named["param_groups"] = [
            tuples_like(g, mine) for g, mine in zip(named["param_groups"], template, strict=True)
        ]
        set_optimizer_state_dict(
            policy, optimizer, named, options=StateDictOptions(full_state_dict=True)
        )
    elif (directory / LEGACY_OPTIMIZER_FILE).exists():
        raise ReplayRLError(
            f"Checkpoint '{directory}' holds its optimizer state in the old optimizer.pt "
            "format, which train.distributed=fsdp does not read; resume one iteration with "
            "train.distributed=none or ddp (it rewrites the state), then switch."
        )
    else:
        return False
    restore_rng_state(directory)
    return True


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
