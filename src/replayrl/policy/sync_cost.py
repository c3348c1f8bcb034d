"""What moving the weights to the asynchronous workers costs: the estimated seconds of one
publication on each path against the seconds between publications (`replayrl plan`'s
`weight sync:` line).

`estimate(cfg, shape, prompt_tokens=512)` returns a `WeightSync`, or None for a config without
workers (the synchronous engines hand weights over in one process). The model:

- one gradient step: `step_tokens x flops_per_token x P / (T x GPU_BF16_FLOPS x MFU)`, with
  `step_tokens` = B rows x (prompt + `COMPLETION_SHARE` x max_new_tokens) and 6 FLOPs per
  parameter and token (forward 2, backward 4), 8 with activation checkpointing (the forward
  again); the interval between publications is `publish_every` of them.
- broadcast (`asynchronous.weight_transfer: broadcast`): the copy's bytes (P x 2 B in bf16)
  / `BROADCAST_BYTES_S` (NVLink within a node, `INTERNODE_BROADCAST_BYTES_S` when W + T
  GPUs span nodes of `GPUS_PER_NODE`), plus `BUCKET_OVERHEAD_S` per bucket of
  `asynchronous.weight_bucket_mib`. It stalls the trainer for all of it.
- files: the host snapshot (`PCIE_BYTES_S`), the safetensors write to the scratch disk
  (`DISK_BYTES_S`), the upload in `transfer.UPLOAD_STREAMS` streams of `S3_STREAM_BYTES_S`,
  then the W workers' downloads side by side, each in `transfer.DOWNLOAD_STREAMS` ranged GETs
  (`transfer.download_dir`), the store shared (`S3_STORE_BYTES_S` in all). Only the snapshot stalls the trainer (the rest runs
  in the background, `Trainer.save(background=True)`); the rest is how stale the workers'
  weights get meanwhile.

Every constant is an estimate from a public figure, named beside it; none was measured on a
cluster here. Knows nothing about storage, engines or trackers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from replayrl.config import RunConfig

# H100 SXM dense bf16 tensor-core peak (NVIDIA H100 datasheet: 989 TFLOPS without sparsity).
GPU_BF16_FLOPS = 989e12
# Model FLOPs utilisation of an FSDP bf16 trainer step: torchtitan reports ~38-40 % for
# Llama 3 8B on H100s; RL steps of short, padded micro-batches do worse, so 35 %.
MFU = 0.35
# Completion tokens of a row, as a share of max_new_tokens (a guess: math rollouts of Qwen2.5
# base models use about half their budget early in training; shorter rows mean shorter steps,
# so a larger share of the interval goes to publishing).
COMPLETION_SHARE = 0.5
# Effective NCCL broadcast bandwidth per GPU within a node (NVLink 4: 450 GB/s each way per
# H100; nccl-tests' broadcast bus bandwidth reaches ~350 GB/s at large messages). Bucketing,
# the cast to bf16 and the receiver's staging copy bring it well down: 100 GB/s assumed.
BROADCAST_BYTES_S = 100e9
# Across nodes: one 400 Gb/s NDR InfiniBand rail per GPU is 50 GB/s on the wire; nccl-tests
# see ~40 GB/s bus bandwidth; 25 GB/s assumed with the same overheads.
INTERNODE_BROADCAST_BYTES_S = 25e9
GPUS_PER_NODE = 8
# Per bucket: a collective's launch and completion, the sender's flatten and the host's sync.
BUCKET_OVERHEAD_S = 0.005
# Pinned device-to-host copy over PCIe Gen5 x16 (64 GB/s on paper, ~25 GB/s measured by
# bandwidthTest-style copies of pinned buffers); Gen4 hosts get about half.
PCIE_BYTES_S = 25e9
# Writing safetensors shards to the pod's scratch volume: one local NVMe's sequential write
# (~2 GB/s; network volumes are slower).
DISK_BYTES_S = 2e9
# One S3 stream: AWS's performance guidelines size one concurrent request per 85-90 MB/s.
S3_STREAM_BYTES_S = 85e6
# What the object store serves in all to the workers downloading at once (a 25 Gb/s NIC of an
# in-cluster SeaweedFS/MinIO node, or AWS's per-prefix limits spread over a few prefixes).
S3_STORE_BYTES_S = 3e9
# Upload streams of one publication: `storage.transfer.UPLOAD_STREAMS` (not imported: the
# policy layer sits beside storage, and this model reads no setting of it).
UPLOAD_STREAMS = 8
# Ranged GETs in flight per worker's download: `storage.transfer.DOWNLOAD_STREAMS`.
DOWNLOAD_STREAMS = 8
# Above this share of the interval the plan warns.
WARN_SHARE = 0.20


@dataclass(frozen=True)
class WeightSync:
    """One publication's estimated seconds on each path, against the interval."""

    copy_bytes: int  # one weights-only copy in the generation dtype
    step_s: float  # one gradient step
    interval_s: float  # publish_every steps
    broadcast_s: float
    files_s: float  # until the workers hold the files
    files_trainer_s: float  # of which the trainer waits (the host snapshot)
    path: str  # asynchronous.weight_transfer

    def share(self, path: str) -> float:
        return (self.broadcast_s if path == "broadcast" else self.files_s) / self.interval_s

    def line(self) -> str:
        """`weight sync: broadcast ~X s (Y% of the ~Z s between publications), files ~A s
        (B%; ...)`."""
        return (
            f"weight sync: broadcast ~{_s(self.broadcast_s)} s ({self.share('broadcast'):.0%} "
            f"of the ~{_s(self.interval_s)} s between publications), files "
            f"~{_s(self.files_s)} s ({self.share('files'):.0%}; the trainer waits "
            f"~{_s(self.files_trainer_s)} s of it, the rest runs in the background)"
        )

    def warning(self) -> str | None:
        """The plan's warning when the chosen path takes over `WARN_SHARE` of the interval."""
        share = self.share(self.path)
        if share <= WARN_SHARE:
            return None
        return (
            f"weight sync: the {self.path} path takes {share:.0%} of the time between "
            f"publications (over {WARN_SHARE:.0%}): publish less often "
            "(asynchronous.publish_every)"
            + (", or use asynchronous.weight_transfer: broadcast" if self.path == "files" else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _s(seconds: float) -> str:
    """Seconds with two significant digits below 10: 0.012, 0.41, 3.6, 36, 210."""
    return f"{seconds:.2g}" if seconds < 10 else f"{seconds:.0f}"


def step_seconds(cfg: RunConfig, num_params: int, *, prompt_tokens: int) -> float:
    """Estimated seconds of one gradient step of the T trainers (see the module docstring)."""
    t = cfg.train
    row_tokens = prompt_tokens + COMPLETION_SHARE * cfg.rollout.max_new_tokens
    flops_per_token = (8 if t.activation_checkpointing else 6) * num_params
    gpus = cfg.asynchronous.trainers if cfg.asynchronous.enabled else 1
    return t.batch_size * row_tokens * flops_per_token / (gpus * GPU_BF16_FLOPS * MFU)


def estimate(cfg: RunConfig, num_params: int, *, prompt_tokens: int) -> WeightSync | None:
    """One publication's cost on each path for `cfg` (None without asynchronous workers)."""
    a = cfg.asynchronous
    if not a.enabled:
        return None
    copy_bytes = (4 if cfg.rollout.vllm_dtype == "float32" else 2) * num_params
    step = step_seconds(cfg, num_params, prompt_tokens=prompt_tokens)
    nodes = math.ceil((a.workers + a.trainers) / GPUS_PER_NODE)
    bandwidth = BROADCAST_BYTES_S if nodes == 1 else INTERNODE_BROADCAST_BYTES_S
    bucket = getattr(a, "weight_bucket_mib", 256.0) * 2**20
    broadcast = copy_bytes / bandwidth + math.ceil(copy_bytes / bucket) * BUCKET_OVERHEAD_S
    snapshot = copy_bytes / PCIE_BYTES_S
    upload = copy_bytes / min(UPLOAD_STREAMS * S3_STREAM_BYTES_S, S3_STORE_BYTES_S)
    download = copy_bytes / min(DOWNLOAD_STREAMS * S3_STREAM_BYTES_S, S3_STORE_BYTES_S / a.workers)
    files = snapshot + copy_bytes / DISK_BYTES_S + upload + download
    return WeightSync(
        copy_bytes=copy_bytes,
        step_s=step,
        interval_s=a.publish_every * step,
        broadcast_s=broadcast,
        files_s=files,
        files_trainer_s=snapshot,
        path=a.weight_transfer,
    )
