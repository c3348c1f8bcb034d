"""Realistic synthetic rollout rows (`replayrl.buffer.schema.ROLLOUT_SCHEMA`), built vectorised so
a million rows take seconds, and the cached million-row Delta table under bench/.data/.

Rows look like the CPU demo's and a small math run's: prompts and completions of a few to
tens of tokens, one behaviour log-prob per completion token, G samples per prompt sharing a
group. Nothing here is a model's output; only the shapes and sizes matter to the buffer.
"""

from __future__ import annotations

import hashlib
import shutil
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa

from replayrl.buffer.schema import ROLLOUT_SCHEMA

SAMPLES_PER_PROMPT = 8


def _lists(lengths: np.ndarray, values: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _ids(lineage: str, start: int, n: int) -> pa.Array:
    # Same shape as replayrl.buffer.schema.rollout_id (20 hex chars), without hashing a million keys
    # one at a time: a per-block digest plus the row number keeps them unique.
    head = hashlib.sha256(lineage.encode()).hexdigest()[:8]
    return pa.array([f"{head}{i:012x}" for i in range(start, start + n)])


def rollout_rows(
    *, first_iteration: int, iterations: int, rows_per_iteration: int, seed: int, lineage="bench"
) -> pa.Table:
    """`iterations * rows_per_iteration` rows, iteration numbers from `first_iteration`."""
    rng = np.random.default_rng(seed)
    n = iterations * rows_per_iteration
    iteration = np.repeat(
        np.arange(first_iteration, first_iteration + iterations), rows_per_iteration
    )
    start = first_iteration * rows_per_iteration
    prompt_index = (np.arange(n) % rows_per_iteration) // SAMPLES_PER_PROMPT
    prompt_len = rng.integers(4, 33, size=n // SAMPLES_PER_PROMPT + 1).repeat(SAMPLES_PER_PROMPT)[
        :n
    ]
    completion_len = rng.integers(2, 41, size=n)
    prompt_tokens = rng.integers(0, 256, size=int(prompt_len.sum()), dtype=np.int32)
    completion_tokens = rng.integers(0, 256, size=int(completion_len.sum()), dtype=np.int32)
    logprobs = -rng.exponential(1.0, size=int(completion_len.sum())).astype(np.float32)
    reward = (rng.random(n) < 0.4).astype(np.float32)
    group = pa.array(
        [f"g{it}-{p}" for it, p in zip(iteration.tolist(), prompt_index.tolist(), strict=True)]
    )
    prompt_text = pa.array(["12 + 34 ="] * n)
    columns = {
        "rollout_id": _ids(lineage, start, n),
        "lineage": pa.array([lineage] * n).dictionary_encode().cast(pa.string()),
        "iteration": pa.array(iteration, pa.int64()),
        "policy_version": pa.array(iteration, pa.int64()),
        "prompt_id": group,
        "group_id": group,
        "prompt": prompt_text,
        "completion": pa.array([" 46"] * n),
        "prompt_token_ids": _lists(prompt_len, prompt_tokens),
        "completion_token_ids": _lists(completion_len, completion_tokens),
        "behavior_logprobs": _lists(completion_len, logprobs),
        "reward": pa.array(reward),
        "correct": pa.array(reward > 0.5),
        "advantage": pa.array((reward - reward.mean()).astype(np.float32)),
        "finish_reason": pa.array(np.where(rng.random(n) < 0.9, "stop", "length").tolist()),
        "created_at": pa.array(
            [datetime(2026, 1, 1, tzinfo=UTC)] * n, pa.timestamp("us", tz="UTC")
        ),
    }
    return pa.Table.from_pydict(columns).cast(ROLLOUT_SCHEMA)


def cached_buffer(*, rows: int, rows_per_iteration: int):
    """A `ReplayBuffer` of `rows` rows under bench/.data/, built once and reused.

    Written as a compacted buffer looks: a few large commits (so a few large files) of
    whole iterations, the layout `compact`'s bin-pack leaves.
    """
    from deltalake import write_deltalake

    from bench._common import DATA_DIR
    from replayrl.buffer.table import ROW_GROUP_ROWS, ReplayBuffer, writer_properties

    root = DATA_DIR / f"buffer-{rows}-{rows_per_iteration}-rg{ROW_GROUP_ROWS}"
    done = root / "COMPLETE"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        iterations = rows // rows_per_iteration
        per_commit = max(1, min(iterations, 200_000 // rows_per_iteration))
        for first in range(0, iterations, per_commit):
            chunk = rollout_rows(
                first_iteration=first,
                iterations=min(per_commit, iterations - first),
                rows_per_iteration=rows_per_iteration,
                seed=first,
            )
            write_deltalake(
                str(root / "rollouts"), chunk, mode="append", writer_properties=writer_properties()
            )
        done.write_text("ok\n")
    return ReplayBuffer(str(root))
