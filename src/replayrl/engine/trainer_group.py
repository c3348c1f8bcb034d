"""T data-parallel trainers kept alive for a whole task (the synchronous engine's
`train.distributed` with `train.num_processes: T`, `load_trainer`) or segment (the
asynchronous engine's `asynchronous.trainers: T`, `start_trainers`).

The asynchronous trainer role is one process (one Kubeflow task, asking for
`kubernetes.train_gpus` x T accelerators). With `asynchronous.trainers: T > 1` that process is
rank 0 of a group of T replicas: it starts T - 1 follower processes (the `spawn` start method:
delta-rs is not fork-safe) and keeps every job it has alone (sampling from the buffer,
retention, the usage log, publishing, MLflow). Each gradient step it sends the step's global
batch of B rows to the followers; every rank takes its contiguous shard, and the replicas
step together through DistributedDataParallel: `training.gradient_step` with
`replicas.DataParallel` replicas (the token mean over the *global* batch, so the step
equals one trainer's on the whole batch up to float summation order).

Starting: every follower loads the same full checkpoint as rank 0 (so AdamW's moments agree);
DistributedDataParallel then copies rank 0's weights to all, which covers a restarted trainer
that resumed from newer published weights. The synchronous engine's rank 0 also generates
(or hosts the vLLM engine) between training phases: `named_weights` gives the engine the
whole policy (gathered onto rank 0 when sharded), so no checkpoint is needed in between.

With `train.distributed: fsdp` the replicas are sharded instead (`replayrl.policy.sharded`):
rank 0 loads the checkpoint's weights (and the newer published weights, when there are) on
the CPU, the other ranks build the model on the meta device, every rank receives its shards
from rank 0 onto its device, and takes its shards of the AdamW state; no rank ever holds the whole
model's optimizer state or gradients. Saving gathers: rank 0 tells the followers to join
the gather of the weights (and to write their optimizer shards, for a full checkpoint) into
its scratch folder, then publishes that folder as one checkpoint. Failing: a follower that dies makes rank 0 raise
before its next step (or in the step's all-reduce), so the engine restarts the trainer role,
which starts a new group; a follower whose rank 0 died is killed with it (PR_SET_PDEATHSIG,
`replayrl.engine.children`), or exits within a second where that does not exist. One process group
per segment: gloo on CPU, NCCL on GPUs (rank r on GPU r).

Across nodes (`asynchronous.trainer_nodes` > 1, a Kubeflow Trainer TrainJob whose ranks
`replayrl.kfp.trainjob_rank` runs): torchrun starts every rank and they join through env://
(`policy.distributed.join_env_group`, GPU LOCAL_RANK); rank 0 is `TrainerGroup.from_env`
(nothing to spawn) and the others `follow_env`. The same messages reach the followers by
`broadcast_object_list` over a gloo control group of their own (CPU objects, whatever the
default group's backend), and the same `_follow` loop steps on them. Every rank loads the
checkpoint from storage into its own node's cache; with replicas only rank 0 writes
checkpoints (they are identical), so no message names a folder on rank 0's disk. Sharded
trainers across nodes (`train.distributed: fsdp`) are hybrid-sharded (HSDP): a 2-D mesh,
replicated across nodes and sharded within each. A full checkpoint is then written by every
rank (`_publish_part`): each saves into a temp folder of its own node and uploads its own
files into one publication, and rank 0 writes the COMPLETE marker only once it has gathered
every rank's file digests (`storage.checkpoints.complete_parts`), so a checkpoint missing a
shard is never complete. Only ran on gloo on 127.0.0.1 (2 "nodes" x 2 ranks).

This module is rank 0's side (`TrainerGroup`, `start_trainers`, `load_trainer`); what the
other ranks run, and the pieces rank 0 shares with them, is `replayrl.engine.trainer_ranks`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import tempfile
from pathlib import Path

import torch

from replayrl import storage
from replayrl.config import temp_root
from replayrl.engine.trainer_ranks import (
    _broadcast,
    _control_group,
    _device,
    _first_line,
    _follower,
    _join,
    _load_sharded,
    _nodes,
    _publish_part,
    _replicas,
    _save_sharded,
    _step,
)
from replayrl.errors import ReplayRLError
from replayrl.policy.distributed import free_port
from replayrl.policy.replicas import DataParallel
from replayrl.policy.sharded import gather_full_state
from replayrl.policy.training import (
    NonFiniteStepError,
    StepStats,
)

log = logging.getLogger("replayrl")


def _rank0_shards(cfg, version: int, weights: int, *, device, world: int, nodes: int = 1):
    """Rank 0's trainer over shards of checkpoint v{version} with the published weights of
    `weights` (`_load_sharded`; `nodes` > 1: the hybrid mesh), its weights-only copies in the
    generation dtype (what `save` writes for the workers)."""
    from replayrl.engine.resources import weights_only_dtype
    from replayrl.engine.steps import step_settings

    trainer, replicas = _load_sharded(
        cfg,
        version=version,
        weights_version=weights,
        settings=step_settings(cfg),
        device=device,
        world=world,
        rank=0,
        nodes=nodes,
    )
    trainer.copy_dtype = weights_only_dtype(cfg, device.type)
    return trainer, replicas


class TrainerGroup:
    """Rank 0 of `world` data-parallel replicas of `trainer` (a `workers.Trainer`); same
    `train`/`save`/`version`/`model` as the trainer it wraps. Start with `TrainerGroup.start`,
    end with `close()`."""

    def __init__(
        self,
        trainer,
        procs,
        conns,
        replicas: DataParallel,
        *,
        sharded: bool = False,
        checkpoint_version: int = 0,
        control=None,
    ):
        self.trainer = trainer
        self._control = control  # across nodes: the group messages go through (no procs)
        self.checkpoint_version = checkpoint_version  # the full checkpoint the ranks loaded
        self._procs = procs
        self._conns = conns
        self._replicas = replicas
        self.sharded = sharded

    @classmethod
    def start(
        cls,
        cfg,
        trainer,
        *,
        checkpoint_version: int,
        world: int,
        threads: int | None = 1,
        weights_version: int | None = None,
    ) -> TrainerGroup:
        """Start T - 1 followers that load full checkpoint `checkpoint_version` (the one
        `trainer` was loaded from) and join rank 0 (this process).

        Sharded (`train.distributed: fsdp`): `trainer` is None, and every rank, this one
        included, loads its shards of checkpoint `checkpoint_version` with the published
        weights of `weights_version` (default: the checkpoint's own)."""
        gpu = torch.cuda.is_available()
        if gpu and world > torch.cuda.device_count():
            raise ReplayRLError(
                f"asynchronous.trainers={world} but this trainer sees "
                f"{torch.cuda.device_count()} GPU(s): one GPU per trainer rank. Lower "
                "asynchronous.trainers, or give the trainer task more GPUs."
            )
        sharded = cfg.train.distributed == "fsdp"
        weights = checkpoint_version if weights_version is None else weights_version
        ctx = mp.get_context("spawn")
        port = free_port()
        procs, conns = [], []
        data, pid = cfg.to_dict(), os.getpid()
        for rank in range(1, world):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(
                target=_follower,
                args=(
                    data,
                    rank,
                    world,
                    port,
                    checkpoint_version,
                    theirs,
                    threads,
                    gpu,
                    pid,
                    weights,
                ),
                name=f"replayrl-trainer-rank{rank}",
                daemon=True,  # joined or terminated when rank 0 exits normally
            )
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(ours)
        try:
            device = _join(0, world, port, gpu=gpu)
            if sharded:
                trainer, replicas = _rank0_shards(
                    cfg, checkpoint_version, weights, device=device, world=world
                )
            else:
                replicas = _replicas(trainer.model, trainer.settings, device, 0, world)
        except BaseException:
            for p in procs:
                p.terminate()
            raise
        log.info(
            "%d %s trainers (%s)",
            world,
            "sharded (FSDP)" if sharded else "data-parallel",
            "nccl" if gpu else "gloo",
        )
        return cls(
            trainer, procs, conns, replicas, sharded=sharded, checkpoint_version=checkpoint_version
        )

    @classmethod
    def from_env(
        cls, cfg, trainer, *, checkpoint_version: int, weights_version: int | None = None
    ) -> TrainerGroup:
        """Rank 0 of a group torchrun started on several nodes (`join_env_group`, already
        joined; the other ranks run `follow_env`): nothing to spawn or check, messages go
        to the ranks by broadcast over a gloo control group. Tells them to load full
        checkpoint `checkpoint_version` (the one `trainer` was loaded from); DDP then copies
        this rank's weights to all, as on one host.

        Sharded (`train.distributed: fsdp`): `trainer` is None and every rank loads its
        shards of a hybrid mesh (replicated across nodes, sharded within each) from the
        checkpoint with the published weights of `weights_version`, as `start` does on one
        host; a full checkpoint is then written by every rank (`save`)."""
        world = torch.distributed.get_world_size()
        sharded = cfg.train.distributed == "fsdp"
        weights = checkpoint_version if weights_version is None else weights_version
        control = _control_group()
        try:
            _broadcast(("load", checkpoint_version, weights), control)
            device = _device()
            if sharded:
                trainer, replicas = _rank0_shards(
                    cfg,
                    checkpoint_version,
                    weights,
                    device=device,
                    world=world,
                    nodes=_nodes(cfg, world),
                )
            else:
                replicas = _replicas(trainer.model, trainer.settings, device, 0, world)
        except BaseException:
            torch.distributed.destroy_process_group(control)
            raise
        log.info(
            "%d %s trainers on %s nodes (%s)",
            world,
            "hybrid-sharded (HSDP)" if sharded else "data-parallel",
            cfg.asynchronous.trainer_nodes,
            torch.distributed.get_backend(),
        )
        return cls(trainer, [], [], replicas, sharded=sharded,
                   checkpoint_version=checkpoint_version, control=control)  # fmt: skip

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def model(self):
        return self.trainer.model

    @property
    def num_params(self) -> int:
        return self.trainer.num_params  # a shard's parameters count whole (DTensor)

    @property
    def full_model(self):
        """`Trainer.full_model`: rank 0's whole replica, None when sharded."""
        return None if self.sharded else self.trainer.model

    def named_weights(self):
        """`Trainer.named_weights`. Sharded: every rank joins the gather of the whole weights
        onto rank 0's CPU (float32; the model's size on the host while they are used)."""
        if not self.sharded:
            return self.trainer.named_weights()
        self._send(("gather",))
        return list(gather_full_state(self.trainer.model).items())

    def save(
        self,
        uri: str,
        *,
        before_write=None,
        weights_only: bool = False,
        background: bool = False,
        dtype: torch.dtype | None = None,
    ):
        """`Trainer.save`'s checkpoint at `uri`; returns its `storage.Publication`. Sharded:
        every rank joins the gather into a scratch folder of this process, which is then
        published (`storage.write_checkpoint`). A sharded weights-only copy is the whole
        weights gathered onto this process's CPU (the host snapshot), cast to the copy's dtype
        (`Trainer.copy_dtype`) and published like one trainer's, in the background too."""
        if not self.sharded:
            return self.trainer.save(
                uri,
                before_write=before_write,
                weights_only=weights_only,
                background=background,
                dtype=dtype,
            )
        if background and not weights_only:
            raise ValueError("background saves are for weights-only copies")
        if weights_only:
            from replayrl.engine.resources import default_copy_dtype, publish_policy

            trainer = self.trainer
            if trainer._publication is not None:
                trainer._publication.join()  # one in flight: its host copy goes first
            self._send(("gather",))
            full = gather_full_state(trainer.model)
            dtype = dtype or trainer.copy_dtype or default_copy_dtype(trainer.model)
            snapshot = {k: v.to(dtype) for k, v in full.items()}
            del full
            trainer._publication = publish_policy(
                trainer.model,
                trainer.tokenizer,
                uri,
                state_dict=snapshot,
                before_write=before_write,
                background=background,
            )
            return trainer._publication
        if self._control is not None:
            return self._publish_across_nodes(uri, before_write=before_write)
        with tempfile.TemporaryDirectory(prefix="replayrl-ckpt-", dir=temp_root()) as tmp:
            self._send(("save", tmp, weights_only))
            _save_sharded(self.trainer, Path(tmp), rank=0, weights_only=weights_only)
            if before_write is not None:
                before_write()
            storage.write_checkpoint(Path(tmp), uri)
        return storage.Publication.finished(uri)

    def _publish_across_nodes(self, uri: str, *, before_write=None):
        """A sharded full checkpoint across nodes, where no disk is shared: this rank takes
        the publication's folder (it holds the lease: `checkpoints.new_publication`), every
        rank saves and uploads its own files into it (`_publish_part`), and only once every
        rank's Digests are gathered here is the COMPLETE marker written, naming them all
        (`checkpoints.complete_parts`): a checkpoint with a missing shard never counts."""
        from replayrl.storage import checkpoints

        if before_write is not None:
            before_write()
        epoch, folder = checkpoints.new_publication(uri)
        self._send(("publish", uri, folder))
        parts = _publish_part(self.trainer, uri, folder, rank=0, control=self._control)
        checkpoints.complete_parts(uri, folder=folder, epoch=epoch, parts=parts)
        return storage.Publication.finished(uri)

    def _send(self, message) -> None:
        if self._control is not None:
            try:
                _broadcast(message, self._control)
            except (RuntimeError, OSError) as e:  # gloo: a rank's connection closed
                raise ReplayRLError(
                    f"a trainer rank on another node stopped listening ({_first_line(e)}); "
                    "the trainer role stops so the TrainJob fails and is started again."
                ) from None
            return
        self._check_followers()
        for conn in self._conns:
            try:
                conn.send(message)
            except (BrokenPipeError, EOFError, OSError) as e:
                self._check_followers()
                raise ReplayRLError(f"a trainer rank stopped listening: {e}") from e

    def _check_followers(self) -> None:
        for rank, p in enumerate(self._procs, 1):
            if not p.is_alive():
                raise ReplayRLError(
                    f"trainer rank {rank} of {len(self._procs) + 1} died (exit code "
                    f"{p.exitcode}); the trainer role stops so the engine starts the group again."
                )

    def train(self, batches, *, seed: int, iteration: int | None = None) -> list[StepStats]:
        """One gradient step per global batch, on all ranks; the policy becomes
        v{version + 1}. Stats are over the global batch. A non-finite step names `iteration`
        (default version + 1, as `Trainer.train`) and the step (`NonFiniteStepError`),
        refused on every rank alike; after steps that moved the weights the group holds no
        policy version (-1), as `Trainer.train`."""
        stats = []
        for step, rows in enumerate(batches, start=1):
            self._send(("step", rows, seed))
            try:
                stats.append(_step(self._replicas, self.trainer, rows, rank=0, seed=seed))
            except NonFiniteStepError as e:
                at = self.version + 1 if iteration is None else iteration
                if step > 1:
                    self.trainer.version = -1
                raise e.at(iteration=at, step=step) from None
        self.trainer.version += 1
        return stats

    def close(self) -> None:
        """Stop the followers and leave the process group (across nodes: the control group;
        the default one is its joiner's, `join_env_group`'s caller, to leave)."""
        if self._control is not None:
            control, self._control = self._control, None
            try:
                _broadcast(("stop",), control)
            except (RuntimeError, OSError) as e:
                log.warning("the other trainer ranks did not hear stop: %s", _first_line(e))
            torch.distributed.destroy_process_group(control)
            return
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, EOFError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def sharded(cfg) -> bool:
    """Whether the asynchronous trainers shard the policy (FSDP) rather than replicate it."""
    return cfg.train.distributed == "fsdp" and cfg.asynchronous.trainers > 1


def start_trainers(
    cfg,
    trainer,
    *,
    checkpoint_version: int,
    threads: int | None = 1,
    weights_version: int | None = None,
):
    """`trainer` itself for one trainer, else a `TrainerGroup` of `asynchronous.trainers`
    (sharded ones load themselves: `trainer` is None, see `TrainerGroup.start`). In a rank
    torchrun started (a TrainJob's, `replayrl.kfp.trainjob_rank`: the default process group
    is joined already), rank 0 of that group (`TrainerGroup.from_env`)."""
    world = cfg.asynchronous.trainers
    if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() != world:
            raise ReplayRLError(
                f"asynchronous.trainers={world} but torchrun started "
                f"{torch.distributed.get_world_size()} ranks; the TrainJob runs "
                "trainer_nodes x (trainers / trainer_nodes) processes."
            )
        return TrainerGroup.from_env(
            cfg, trainer, checkpoint_version=checkpoint_version, weights_version=weights_version
        )
    if world == 1:
        return trainer
    return TrainerGroup.start(
        cfg,
        trainer,
        checkpoint_version=checkpoint_version,
        world=world,
        threads=threads,
        weights_version=weights_version,
    )


def close_trainers(trainers) -> None:
    if isinstance(trainers, TrainerGroup):
        trainers.close()


def load_trainer(cfg, paths, *, version: int, settings):
    """The synchronous engine's trainer holding v{version}, alive for the task: a `Trainer`
    in this process (`train.distributed: none`), else a `TrainerGroup` of
    `train.num_processes` ranks with this process as rank 0 (DDP replicas, or FSDP shards
    whose weights only rank 0 reads). Close it with `close_trainers`."""
    from replayrl.engine.resources import Trainer

    tr = cfg.train
    if tr.distributed == "none":
        return Trainer.load(cfg, paths, version=version, settings=settings)
    gpus = torch.cuda.device_count()
    if gpus and tr.num_processes > gpus:
        raise ReplayRLError(
            f"train.num_processes={tr.num_processes} but this machine has {gpus} GPU(s); "
            "lower it to the number of GPUs."
        )
    trainer = None
    if tr.distributed == "ddp":
        trainer = Trainer.load(cfg, paths, version=version, settings=settings)
    return TrainerGroup.start(cfg, trainer, checkpoint_version=version, world=tr.num_processes)
