"""How published weights reach the asynchronous engine's workers (`asynchronous.weight_transfer`).

`broadcast` (the default): the trainer (rank 0) hosts a weight group
(`replayrl.policy.weight_broadcast`: a TCPStore, and per generation a gloo group on the CPU or
an NCCL group on GPUs, built from that store, apart from the trainers' own data-parallel
group) and says where it meets in the board's `weights.json`. At each publication it sends
the weights in buckets (bfloat16 on GPUs) *before* it announces the version; a worker's receiver
thread stages them while the worker generates, and between batches the worker applies a
staged version only when the board's pointer names exactly that publication (same version,
same publication time: the token sent with it). So `LATEST.json` stays the one source of
truth: a stale trainer's broadcast is never applied, a version is announced only once every
worker in the group acknowledged it (or the send timed out and the group was dropped), and
rows stay tagged with the version the worker's engine holds when it generates them.

Files stay the fallback, always written: a worker outside the group (a restarted or late
one, one whose receive timed out) loads the pointer's version from its weights-only files,
as with `files`; the evaluator always reads the files; a resumed trainer starts from them.

Why not vLLM's own weight transfer (`WeightTransferConfig(backend="nccl"|"ipc")`; read in
vllm-project/vllm: `vllm/distributed/weight_transfer/base.py` (`WeightTransferEngine`:
init_transfer_engine, start_weight_update, update_weights -> receive_weights,
finish_weight_update; the trainer side `TrainerWeightTransferEngine.trainer_init` /
`send_weights` over a `VLLMWeightSyncClient`), `nccl_engine.py` (`NCCLWeightTransferEngine`:
a `StatelessProcessGroup` plus `PyNcclCommunicator`, `receive_weights` loading each packed
buffer into the model as it arrives) and `ipc_engine.py`): its receive *is* the engine's
weight update, a blocking call into the engine that runs concurrently with the trainer's
broadcast, so a worker that owns its engine in-process (the `LLM` class, whose `generate`
blocks) cannot receive while it generates, and every worker would stall for every send; it
is NCCL/CUDA only, so nothing of it runs (or is tested) on the CPU; and a PyNccl group has
no timeout or re-forming for a member that is stopped mid-send (the collective hangs). What
it ends in, the engine's in-place reload, is what we use: a staged version is applied
through `VLLMBackend.load_weights` (vLLM's `reload_weights`), or copied into the
transformers model in place.

This module knows the board and the task's resources; the transport knows neither.
"""

from __future__ import annotations

import logging
import os
import socket

from replayrl.config import RunConfig
from replayrl.engine import children
from replayrl.engine.asynchronous import board
from replayrl.engine.resources import TaskResources, device, weights_only_dtype
from replayrl.policy.weight_broadcast import Delivery, Receiver, Sender
from replayrl.storage import LineagePaths

log = logging.getLogger(__name__)


def broadcasting(cfg: RunConfig) -> bool:
    return cfg.asynchronous.weight_transfer == "broadcast"


def _host() -> str:
    """An address of this host the workers can reach: its name's address (a pod's IP on
    Kubeflow), else the loopback (one machine)."""
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
    return address


class TrainerWeights:
    """Trainer rank 0's side: the weight group's sender, announced on the board."""

    def __init__(self, cfg: RunConfig, paths: LineagePaths, *, segment_id: str):
        a = cfg.asynchronous
        self.sender = Sender(
            members=a.workers,
            timeout_s=a.weight_timeout_s,
            bucket_bytes=int(a.weight_bucket_mib * 2**20),
            host=_host(),
            device=device(),
            # What a weights-only copy is loaded in (bfloat16 on GPUs; float32 on the CPU,
            # as its files load there): a version is the same weights by either path.
            dtype=weights_only_dtype(cfg, device()),
        )
        host, port = self.sender.address
        board.write_weight_group(
            paths, board.WeightGroup(host=host, port=port, segment_id=segment_id, pid=os.getpid())
        )

    def send(self, version: int, named_tensors, *, published_at: float) -> Delivery:
        # A send to a stopped worker waits up to weight_timeout_s: not a stall of the trainer.
        with children.beating():
            delivery = self.sender.send(version, named_tensors, token=repr(published_at))
        if delivery.error is not None:
            log.warning(
                "weights v%d reached workers %s of %s (%s): the others load the files",
                version,
                list(delivery.acked),
                list(delivery.members),
                delivery.error,
            )
        return delivery

    def close(self) -> None:
        self.sender.close()


class WorkerWeights:
    """A worker's side: its receiver thread, and applying what it staged."""

    def __init__(self, cfg: RunConfig, paths: LineagePaths, *, worker: int, segment_id: str):
        def address():
            group = board.read_weight_group(paths)
            if group is None or group.segment_id != segment_id:
                return None
            return group.host, group.port

        self.receiver = Receiver(
            member=worker,
            address=address,
            timeout_s=cfg.asynchronous.weight_timeout_s,
            device=device(),
        ).start()

    def apply(self, resources: TaskResources, pointer: board.Published) -> bool:
        """Give `resources` the pointer's version from the staged broadcast, in place: True
        when it did, False when nothing staged is that very publication (the caller loads
        the files)."""
        staged = self.receiver.take(version=pointer.version, token=repr(pointer.published_at))
        if staged is None:
            return False
        try:
            resources.load_weights_at(pointer.version, staged.named_tensors)
        except Exception as e:  # noqa: BLE001 - a mismatch must not stop the worker: files
            log.warning(
                "staged weights v%d not applied (%s): loading the files", pointer.version, e
            )
            return False
        return True

    def received_seconds(self) -> float:
        return self.receiver.stats.receive_seconds

    def close(self) -> None:
        self.receiver.close()
