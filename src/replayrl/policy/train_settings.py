"""What one gradient step reads of a run's config: `step_settings(cfg, device=...)` turns the
`train` section and the rollout temperature into `training.StepSettings`, with train.dtype
resolved for the device the trainer runs on.

Imports the config and the trainer only (no pyarrow, deltalake or MLflow), so a GPU check on
an image without the buffer's libraries (bench/gpu_train_smoke.py) steps with the settings
the engine's trainer gets from the same config. Knows nothing about rows, storage or engines.
"""

from __future__ import annotations

from replayrl.config import RunConfig
from replayrl.policy.training import StepSettings, resolve_dtype


def step_settings(cfg: RunConfig, *, device: str) -> StepSettings:
    """The loss, optimizer and memory settings of one gradient step, from `train` and the
    rollout temperature (the behaviour log-probs were taken at it); `train.dtype` resolved
    for `device` ("cuda" or "cpu": "auto" is bfloat16 on CUDA, float32 on the CPU, and
    bfloat16 on the CPU is refused with a ReplayRLError)."""
    tr = cfg.train
    return StepSettings(
        loss_name=tr.loss,
        clip_eps=tr.clip_eps,
        is_cap=tr.is_cap,
        temperature=cfg.rollout.temperature,
        grad_clip=tr.grad_clip,
        lr=tr.lr,
        weight_decay=tr.weight_decay,
        betas=(tr.adam_beta1, tr.adam_beta2),
        micro_batch_size=tr.micro_batch_size,
        micro_batch_tokens=tr.micro_batch_tokens,
        logprob_chunk_tokens=tr.logprob_chunk_tokens,
        dtype=resolve_dtype(tr.dtype, device),
    )
