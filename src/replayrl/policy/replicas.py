"""`training.Replicas` of whole models, one DistributedDataParallel replica per process
(`DataParallel`): what `replayrl.policy.distributed` ("ddp") and the trainer groups step with,
and what `replayrl.policy.sharded.FullyShardedReplicas` ("fsdp") builds on.
"""

from __future__ import annotations

import contextlib

import torch


class DataParallel:
    """`training.Replicas` of one DistributedDataParallel `module` (a wrapped
    `TokenPolicyLoss`) per process, over the default torch.distributed process group, which
    accelerate (`train_on_batches`) or the asynchronous trainer group has started. With
    `world` 1 there is no group, and `module` is the unwrapped `TokenPolicyLoss`."""

    def __init__(self, module: torch.nn.Module, *, world: int, device: torch.device):
        self.module, self.world, self.device = module, world, device

    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return t.tolist()

    def all_max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        if self.world > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.module.no_sync() if self.world > 1 else contextlib.nullcontext()

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        # DDP has already averaged the gradients: every rank sees the global norm.
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
