"""Rollout rows (Arrow) into training tensors: `collate` pads (prompt + completion)
sequences with masks aligned to next-token targets (and puts them on the trainer's device),
`row_lengths` and
`completion_token_count` size them, and `micro_batches` cuts a batch by rows and padded
tokens. pyarrow is imported inside the functions that need it, so the trainer imports with
torch alone.

`rows` is a pyarrow Table, or any table of the same columns whose `column(name)` has
`to_pylist()` and `to_numpy()`, with `take(indices)` and `num_rows`:
bench/gpu_train_smoke.py steps `training.gradient_step` on such a table of Python lists, on
GPU machines whose image has no pyarrow.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import pyarrow as pa


def collate(
    rows: pa.Table, *, pad_id: int, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """Right-padded (prompt + completion) sequences with masks aligned to next-token targets.

    Worked example: prompt [5, 6], completion [7, 8(eos)], pad 0, longest row 5 tokens:
        input_ids       [5, 6, 7, 8, 0]
        targets         [6, 7, 8, 0]        (input_ids shifted left)
        completion_mask [0, 1, 1, 0]        (targets that are completion tokens)
        logp_behavior   [0, l7, l8, 0]

    device: where the tensors go; None = stay on the CPU. For a CUDA device they are built
    in pinned (page-locked) host memory and copied without blocking the host, so it can go
    on queueing work while the copy runs; the copies are queued on the current stream, so
    the kernels that read them wait for them. (torch's pinned-memory cache keeps a host
    buffer until its copy has finished, whatever becomes of the host tensor.)
    """
    target = None if device is None else torch.device(device)
    pinned = target is not None and target.type == "cuda"
    prompts = rows.column("prompt_token_ids").to_pylist()
    completions = rows.column("completion_token_ids").to_pylist()
    behavior = rows.column("behavior_logprobs").to_pylist()
    n = len(prompts)
    length = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    on_host = dict(pin_memory=pinned)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long, **on_host)  # (B, L)
    attention = torch.zeros((n, length), dtype=torch.long, **on_host)  # (B, L)
    completion_mask = torch.zeros((n, length - 1), dtype=torch.float32, **on_host)  # (B, L-1)
    logp_behavior = torch.zeros((n, length - 1), dtype=torch.float32, **on_host)  # (B, L-1)
    for i, (p, c, lb) in enumerate(zip(prompts, completions, behavior, strict=True)):
        seq = p + c
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        # Target position j predicts input_ids[j + 1]; completion token k sits at len(p) + k.
        start = len(p) - 1
        completion_mask[i, start : start + len(c)] = 1.0
        logp_behavior[i, start : start + len(c)] = torch.tensor(lb, dtype=torch.float32)
    advantages = torch.tensor(
        rows.column("advantage").to_numpy(zero_copy_only=False), dtype=torch.float32
    )  # (B,)
    if pinned:
        advantages = advantages.pin_memory()
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "completion_mask": completion_mask,
        "logp_behavior": logp_behavior,
        "advantages": advantages,
    }
    if target is None:
        return batch
    return {key: value.to(target, non_blocking=pinned) for key, value in batch.items()}


def _is_arrow(rows) -> bool:
    """Whether `rows` is Arrow data (which it cannot be while pyarrow was never imported)."""
    pa = sys.modules.get("pyarrow")
    return pa is not None and isinstance(rows, (pa.Table, pa.RecordBatch))


def _list_lengths(rows, name: str) -> np.ndarray:
    return np.asarray([len(v) for v in rows.column(name).to_pylist()], dtype=np.int64)


def row_lengths(rows: pa.Table) -> np.ndarray:
    """Tokens per row (prompt + completion). Returns (B,) int64."""
    if not _is_arrow(rows):
        return _list_lengths(rows, "prompt_token_ids") + _list_lengths(rows, "completion_token_ids")
    import pyarrow.compute as pc

    prompts = pc.list_value_length(rows.column("prompt_token_ids"))
    completions = pc.list_value_length(rows.column("completion_token_ids"))
    return prompts.to_numpy(zero_copy_only=False).astype(np.int64) + completions.to_numpy(
        zero_copy_only=False
    ).astype(np.int64)


def completion_token_count(rows: pa.Table) -> int:
    """Completion tokens of `rows`: the denominator of the batch's token-mean loss."""
    if not _is_arrow(rows):
        return int(_list_lengths(rows, "completion_token_ids").sum())
    import pyarrow.compute as pc

    return int(pc.sum(pc.list_value_length(rows.column("completion_token_ids"))).as_py() or 0)


def micro_batches(
    lengths: np.ndarray, *, max_rows: int = 0, max_tokens: int = 0
) -> list[np.ndarray]:
    """Row indices of each micro-batch: rows sorted longest first, cut so that a micro-batch
    has at most `max_rows` rows and `max_tokens` padded tokens (rows x its longest row); 0 =
    no limit. A row longer than `max_tokens` forms a micro-batch of its own.

    Example: lengths [3, 9, 4, 8], max_rows 0, max_tokens 16 -> [[1], [3, 2], [0]]
    (rows 9 and 8 would pad to 18 tokens; 8 and 4 pad to 16; a third row, to 24).
    """
    order = np.argsort(-np.asarray(lengths), kind="stable")
    groups: list[list[int]] = []
    longest = 0
    for i in order.tolist():
        if groups:
            rows = len(groups[-1]) + 1
            # Sorted longest first: the group's first row sets its padded length.
            fits_rows = max_rows <= 0 or rows <= max_rows
            fits_tokens = max_tokens <= 0 or rows * longest <= max_tokens
            if fits_rows and fits_tokens:
                groups[-1].append(i)
                continue
        groups.append([i])
        longest = int(lengths[i])
    return [np.asarray(g, dtype=np.int64) for g in groups]
