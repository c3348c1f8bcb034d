"""What the trainer ranks other than rank 0 run, and the pieces rank 0 shares with them
(`replayrl.engine.trainer_group` is rank 0's side, `TrainerGroup`): joining the group, loading
a rank's replica or shards (`_load_sharded`), one data-parallel step, the follower loop that
steps on rank 0's messages (`_follow`: through a pipe from a spawned follower on one host,
`_follower`; by broadcast over a gloo control group across nodes, `follow_env`), and a rank's
part of a sharded checkpoint (`_save_sharded`, `_publish_part`). See
`replayrl.engine.trainer_group` for how the group works.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import torch

from replayrl import logs, storage
from replayrl.config import temp_root
from replayrl.errors import ReplayRLError
from replayrl.policy.distributed import join_group, shard_rows
from replayrl.policy.loss_kernels import TokenPolicyLoss
from replayrl.policy.replicas import DataParallel
from replayrl.policy.sharded import gather_full_state
from replayrl.policy.training import StepStats, gradient_step

log = logging.getLogger("replayrl")

_POLL_S = 1.0


def _join(rank: int, world: int, port: int, *, gpu: bool) -> torch.device:
    return join_group(rank=rank, world=world, port=port, gpu=gpu)


def _load_sharded(
    cfg,
    *,
    version: int,
    weights_version: int,
    settings,
    device,
    world: int,
    rank: int,
    nodes: int = 1,
):
    """This rank's `Trainer` over shards (and its replicas): checkpoint v{version}'s weights,
    overwritten by the published weights of `weights_version` when newer, sharded onto
    `device`; an optimizer over the shards, with the checkpoint's state (each rank reads
    only its shards of it). Only rank 0 reads the weights, on the CPU: the other ranks build
    the model on the meta device and receive their shards from rank 0
    (`sharded.broadcast_from_rank0`), so a node holds one float32 copy on the host, not one
    per rank (8 x 30 GB at 7B). `nodes` > 1: hybrid sharding, replicated across nodes
    and sharded within each (`sharded.shard_policy`); every rank reads the checkpoint into
    its own node's cache."""
    from replayrl.engine.asynchronous import board
    from replayrl.engine.resources import Trainer, default_cache_dir
    from replayrl.policy.models import load_policy, policy_skeleton
    from replayrl.policy.sharded import broadcast_from_rank0, load_sharded_state, shard_policy
    from replayrl.policy.training import make_optimizer, prepare_model

    paths = storage.paths_of(cfg)
    local = storage.checkpoint_local_dir(paths.checkpoint(version), default_cache_dir(cfg))
    full = None
    if rank == 0:
        model, tokenizer = load_policy(local, dtype=torch.float32)
        if weights_version > version:
            newer = storage.checkpoint_local_dir(
                board.weights_uri(paths, weights_version),
                default_cache_dir(cfg),
                weights_only=True,
            )
            published, _ = load_policy(Path(newer), dtype=torch.float32)
            model.load_state_dict(published.state_dict())
            del published
        # The whole weights, kept (these tensors) past the sharding that replaces them.
        full = model.state_dict()
    else:
        model, tokenizer = policy_skeleton(local, dtype=torch.float32)
    prepare_model(model, activation_checkpointing=cfg.train.activation_checkpointing)
    replicas = shard_policy(model, settings, device=device, world=world, nodes=nodes)
    broadcast_from_rank0(model, full, device=device)
    del full
    optimizer = make_optimizer(
        model, lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas
    )
    load_sharded_state(model, optimizer, local)
    trainer = Trainer(model, tokenizer, optimizer, settings=settings, version=weights_version)
    return trainer, replicas


def _replicas(model: torch.nn.Module, settings, device: torch.device, rank: int, world: int):
    """This rank's replica: its loss module under DDP (whose construction copies rank 0's
    weights)."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None  # this node's GPU, not `rank`
    ddp = DistributedDataParallel(TokenPolicyLoss(model, settings), device_ids=ids)
    return DataParallel(ddp, world=world, device=device)


def _step(replicas: DataParallel, trainer, rows: pa.Table, *, rank: int, seed: int) -> StepStats:
    torch.manual_seed(seed)
    return gradient_step(
        model=trainer.model,
        optimizer=trainer.optimizer,
        rows=shard_rows(rows, rank=rank, world_size=replicas.world),
        pad_id=trainer.tokenizer.pad_token_id,
        settings=trainer.settings,
        replicas=replicas,
    )


def _follower(
    cfg_data: dict,
    rank: int,
    world: int,
    port: int,
    version: int,
    conn,
    threads,
    gpu: bool,
    parent_pid: int,
    weights_version: int | None = None,
) -> None:
    """A follower rank's entry point: load, join, then step on every batch rank 0 sends. It
    dies with rank 0's process (`children.adopt`)."""
    from replayrl.config import config_from_dict
    from replayrl.engine import children
    from replayrl.engine.resources import Trainer
    from replayrl.engine.steps import step_settings

    children.adopt(parent_pid, clean_exit=False)  # SIGTERM (rank 0's exit) ends it at once
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s trainer-rank{rank} %(levelname)s %(message)s"
    )
    logs.install(os.environ)  # a spawned child redacts secrets like its parent
    if threads:
        torch.set_num_threads(threads)
    if gpu:
        torch.cuda.set_device(rank)
    cfg = config_from_dict(cfg_data)
    if cfg.train.distributed == "fsdp":
        device = _join(rank, world, port, gpu=gpu)
        trainer, replicas = _load_sharded(
            cfg,
            version=version,
            weights_version=version if weights_version is None else weights_version,
            settings=step_settings(cfg),
            device=device,
            world=world,
            rank=rank,
        )
    else:
        paths = storage.paths_of(cfg)
        trainer = Trainer.load(cfg, paths, version=version, settings=step_settings(cfg))
        device = _join(rank, world, port, gpu=gpu)
        replicas = _replicas(trainer.model, trainer.settings, device, rank, world)
    try:
        _follow(trainer, replicas, _pipe_receiver(conn, mp.parent_process()), rank=rank)
    finally:
        torch.distributed.destroy_process_group()


def _pipe_receiver(conn, parent):
    """The next message from rank 0 through `conn` (one host); None once rank 0 is gone."""

    def recv():
        while not conn.poll(_POLL_S):
            if parent is not None and not parent.is_alive():
                log.warning("rank 0 is gone: this trainer rank stops")
                return None
        return conn.recv()

    return recv


def _follow(trainer, replicas: DataParallel, recv, *, rank: int, control=None) -> None:
    """A follower's part of every message rank 0 sends (`recv()`: through a pipe on one host,
    a broadcast over the control group across nodes) until "stop" (or None: rank 0 is gone):
    ("step", rows, seed), ("save", folder, weights_only) (sharded), ("gather",) (sharded),
    ("publish", uri, folder) (sharded across nodes: `_publish_part` over `control`)."""
    while True:
        message = recv()
        if message is None or message[0] == "stop":
            return
        if message[0] == "publish":
            _, uri, folder = message
            _publish_part(trainer, uri, folder, rank=rank, control=control)
            continue
        if message[0] == "save":
            _, folder, weights_only = message
            _save_sharded(trainer, Path(folder), rank=rank, weights_only=weights_only)
            continue
        if message[0] == "gather":
            gather_full_state(trainer.model)  # rank 0 keeps the whole weights
            continue
        _, rows, seed = message
        _step(replicas, trainer, rows, rank=rank, seed=seed)


# Across nodes, followers wait for rank 0's next message in a broadcast over a gloo group of
# their own: rank 0 may sample, wait for rows or publish for long between steps (a step's
# all-reduce keeps the default group's GROUP_TIMEOUT_S). A rank 0 that dies closes its
# connections, which ends the wait at once.
CONTROL_TIMEOUT_S = 7 * 24 * 3600.0


def _control_group():
    """The gloo group rank 0's messages go through across nodes (Python objects on the CPU,
    even when the default group is NCCL). Every rank makes it, in the same order."""
    import datetime

    return torch.distributed.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S)
    )


def _broadcast(message, control):
    """Rank 0: send `message` to every rank of `control`. Others: `message` is ignored and
    rank 0's is returned."""
    box = [message]
    torch.distributed.broadcast_object_list(box, src=0, group=control)
    return box[0]


def follow_env(cfg, *, threads: int | None = None) -> None:
    """A rank > 0 of a group torchrun started (`policy.distributed.join_env_group`, already
    joined): receive what rank 0's `TrainerGroup.from_env` loaded, load the same full
    checkpoint from storage (into this node's own cache), and follow rank 0's messages until
    it stops. Replicas (`train.distributed: none`): the weights are replicated, so only
    rank 0 writes checkpoints. Sharded (`fsdp`): this rank's shards of the hybrid mesh
    (`_load_sharded`), and at a full checkpoint it uploads its own shard files
    (`_publish_part`); no message names a folder of rank 0's disk either way."""
    from replayrl.engine.resources import Trainer
    from replayrl.engine.steps import step_settings

    if threads:
        torch.set_num_threads(threads)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    control = _control_group()

    def recv():
        try:
            return _broadcast(None, control)
        except (RuntimeError, OSError) as e:  # gloo: rank 0's connection closed
            raise ReplayRLError(
                f"trainer rank {rank} lost rank 0 ({_first_line(e)}); it stops too, so the "
                "TrainJob fails and is started again."
            ) from None

    try:
        _, version, weights = recv()
        if cfg.train.distributed == "fsdp":
            trainer, replicas = _load_sharded(
                cfg,
                version=version,
                weights_version=weights,
                settings=step_settings(cfg),
                device=_device(),
                world=world,
                rank=rank,
                nodes=_nodes(cfg, world),
            )
        else:
            paths = storage.paths_of(cfg)
            trainer = Trainer.load(cfg, paths, version=version, settings=step_settings(cfg))
            replicas = _replicas(trainer.model, trainer.settings, _device(), rank, world)
        log.info("trainer rank %d of %d follows rank 0 (checkpoint v%d)", rank, world, version)
        _follow(trainer, replicas, recv, rank=rank, control=control)
    finally:
        torch.distributed.destroy_process_group(control)


def _nodes(cfg, world: int) -> int:
    """The nodes a torchrun group spans (`asynchronous.trainer_nodes`), checked against the
    group: every node runs world / nodes ranks, numbered node by node."""
    nodes = cfg.asynchronous.trainer_nodes
    if nodes < 1 or world % nodes:
        raise ReplayRLError(
            f"asynchronous.trainer_nodes={nodes} does not divide the {world} ranks torchrun "
            "started; the TrainJob runs trainer_nodes x (trainers / trainer_nodes) processes."
        )
    return nodes


def _publish_part(trainer, uri: str, folder: str, *, rank: int, control):
    """Every rank's share of a sharded full checkpoint across nodes (no disk is shared): save
    into a temp folder of this rank's own (rank 0: the weights, tokenizer, RNG states and
    DCP metadata; every rank: its "optimizer.dcp.__<rank>_0.distcp"), upload those files into
    publication `folder` of `uri` (`checkpoints.upload_part`), then gather every rank's
    Digests on rank 0 over `control`. Returns them on rank 0 (None for a rank whose upload
    failed: its error is logged there), None elsewhere. A failed upload still joins the
    gather, so rank 0 refuses the checkpoint instead of waiting."""
    from replayrl.storage import checkpoints

    part = None
    with tempfile.TemporaryDirectory(prefix="replayrl-ckpt-", dir=temp_root()) as tmp:
        _save_sharded(trainer, Path(tmp), rank=rank, weights_only=False, own_folder=True)
        try:
            part = checkpoints.upload_part(Path(tmp), uri, folder=folder)
        except Exception as e:  # noqa: BLE001 - reported to rank 0 as a missing part
            log.error("trainer rank %d could not upload its checkpoint files: %s", rank,
                      _first_line(e))  # fmt: skip
    world = torch.distributed.get_world_size(control)
    parts = [None] * world if rank == 0 else None
    torch.distributed.gather_object(part, parts, dst=0, group=control)
    return parts


def _device() -> torch.device:
    """This rank's device in a group joined by `join_env_group` (its current GPU)."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _save_sharded(
    trainer, folder: Path, *, rank: int, weights_only: bool, own_folder: bool = False
) -> None:
    from replayrl.policy.sharded import save_sharded

    save_sharded(
        trainer.model,
        trainer.tokenizer,
        None if weights_only else trainer.optimizer,
        folder,
        rank=rank,
        own_folder=own_folder,
    )
