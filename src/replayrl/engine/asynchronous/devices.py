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

from collections import Counter
from collections.abc import MutableMapping
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
