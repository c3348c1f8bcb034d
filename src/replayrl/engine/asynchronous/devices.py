"""Which GPUs each role of the local asynchronous engine uses, and what shares them.

`assign_devices` is a pure function of the machine's GPU count, the number of workers W and
trainer ranks T (`asynchronous.workers`, `asynchronous.trainers`):

- the trainer's T ranks get GPUs 0 .. T-1, one each (its group needs one GPU per rank);
- the W workers, then the evaluator, each build a vLLM engine; they go round-robin over the
  GPUs the trainer left (T .. N-1), so with N >= T + W + 1 every role has a GPU of its own;
- when the trainer took every GPU (N == T, e.g. one GPU), they go round-robin over all of
  them and share them with the trainer, which trains while they generate.

Each role's `Placement` says which GPU(s) it may see (set as `CUDA_VISIBLE_DEVICES` in its
process before CUDA starts, so every role sees its GPU as `cuda:0`), how many vLLM engines
share that GPU and whether a trainer rank trains on it, from which
`engine_share.memory_share` computes the engine's share of that GPU. The supervisor sets
both in the environment of the role's process (`apply`); the role's resources read the
sharing back (`engine_share.gpu_sharing_from_env`) when they build the engine. Without
GPUs nothing is set.

Numbers in `CUDA_VISIBLE_DEVICES` are indices into the GPUs this process sees: when the
supervisor itself runs with `CUDA_VISIBLE_DEVICES=2,3`, index 0 is GPU 2.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from replayrl.errors import ReplayRLError
from replayrl.policy.engine_share import SHARING_ENV

_VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Placement:
    """Where one role runs. gpus: indices of the GPUs it sees (empty without GPUs);
    engines_on_gpu: vLLM engines on its GPU, its own included (0 for the trainer);
    trainer_on_gpu: a trainer rank trains on its GPU (always True for the trainer)."""

    gpus: tuple[int, ...]
    engines_on_gpu: int
    trainer_on_gpu: bool


def assign_devices(gpus: int, *, workers: int, trainers: int) -> dict[tuple[str, int], Placement]:
    """The placement of every role: ("trainer", 0), ("worker", w) for w < workers and
    ("evaluator", 0); see the module docstring. `gpus` 0 places everything on the CPU."""
    if workers < 1 or trainers < 1:
        raise ValueError(f"need at least one worker and one trainer, not {workers}, {trainers}")
    generating = [("worker", w) for w in range(workers)] + [("evaluator", 0)]
    if gpus <= 0:
        cpu = Placement(gpus=(), engines_on_gpu=0, trainer_on_gpu=False)
        return {("trainer", 0): cpu, **{role: cpu for role in generating}}
    if trainers > gpus:
        raise ReplayRLError(
            f"asynchronous.trainers={trainers} needs {trainers} GPUs (one per trainer rank), but "
            f"this machine shows {gpus}. Lower asynchronous.trainers."
        )
    free = list(range(trainers, gpus)) or list(range(gpus))
    gpu_of = {role: free[i % len(free)] for i, role in enumerate(generating)}
    engines = Counter(gpu_of.values())
    placements = {
        ("trainer", 0): Placement(
            gpus=tuple(range(trainers)), engines_on_gpu=engines[0], trainer_on_gpu=True
        )
    }
    for role, gpu in gpu_of.items():
        placements[role] = Placement(
            gpus=(gpu,), engines_on_gpu=engines[gpu], trainer_on_gpu=gpu < trainers
        )
    return placements


def apply(placement: Placement, environ: MutableMapping[str, str]) -> None:
    """Set a role's placement in `environ` (its process's environment, before CUDA starts):
    `CUDA_VISIBLE_DEVICES` mapped through the one already there, and `SHARING_ENV`. Nothing
    without GPUs."""
    if not placement.gpus:
        return
    seen = environ.get(_VISIBLE_ENV)
    physical = [d.strip() for d in seen.split(",")] if seen else None
    ids = [physical[g] if physical is not None else str(g) for g in placement.gpus]
    environ[_VISIBLE_ENV] = ",".join(ids)
    environ[SHARING_ENV] = f"{placement.engines_on_gpu},{int(placement.trainer_on_gpu)}"


def engines_beside_trainer(environ: Mapping[str, str] | None = None) -> int:
    """The vLLM engines that share the GPUs of this trainer process (its `Placement`'s
    `engines_on_gpu`, read back from `SHARING_ENV`); 0 when none do or nothing set it."""
    value = (os.environ if environ is None else environ).get(SHARING_ENV, "")
    try:
        return max(int(value.split(",")[0]), 0) if value else 0
    except ValueError:
        return 0


@contextlib.contextmanager
def trainer_load_lock(environ: Mapping[str, str] | None = None):
    """While the trainer loads its model onto GPUs it shares with vLLM engines (fewer GPUs
    than roles, e.g. one), hold those GPUs' start lock (`policy.start_lock`): vLLM sizes an
    engine's KV cache from the change in the device's free memory during its start, so a
    trainer's load meanwhile would be charged to the engine (or, freed, trip its check).
    The load waits for an engine start under way, and an engine start waits for the load.
    Nothing to hold on the CPU or on GPUs of the trainer's own."""
    import torch

    if not torch.cuda.is_available() or engines_beside_trainer(environ) == 0:
        yield
        return
    from replayrl.engine import children
    from replayrl.policy import start_lock

    keys = start_lock.cuda_device_keys(torch.cuda.device_count())
    # Waiting for an engine's start (minutes at 7B) is a wait by design, not a stall.
    with children.beating(), start_lock.hold(keys, what="the trainer loading its model"):
        yield
