"""Arrow schemas of the replay buffer's two tables, deterministic rollout ids, validation.

`ROLLOUT_SCHEMA` is one row per sampled completion; `USAGE_SCHEMA` is one row per use of a
rollout in a gradient step. `validate_rollouts` / `validate_usage` cast a table to its schema
and reject malformed data with a `ReplayRLError` that names the column (and the rollout)
at fault, so a bad batch never reaches storage.

This module knows nothing about where the tables live (see `replayrl.buffer.table`), how rows are
generated, or which rows the buffer keeps (see `replayrl.buffer.retention`). It imports pyarrow only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from replayrl.errors import ReplayRLError

if TYPE_CHECKING:
    import numpy as np

ROLLOUT_SCHEMA = pa.schema(
    [
        # Deterministic from (lineage, iteration, prompt index, sample index): see `rollout_id`.
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("lineage", pa.string()),
        pa.field("iteration", pa.int64()),
        # Version of the policy that sampled the row, v: the row was created at gradient
        # step v·S (S = train.steps_per_iteration); ages in gradient steps: replayrl.core.staleness.
        pa.field("policy_version", pa.int64()),
        pa.field("prompt_id", pa.string()),
        # Rows of one prompt's G samples share a group_id (group-normalised advantages).
        pa.field("group_id", pa.string()),
        pa.field("prompt", pa.string()),
        pa.field("completion", pa.string()),
        pa.field("prompt_token_ids", pa.list_(pa.int32())),
        pa.field("completion_token_ids", pa.list_(pa.int32())),
        # log pi_behaviour(token) of each sampled completion token, same length as
        # completion_token_ids; the GRPO ratio's denominator.
        pa.field("behavior_logprobs", pa.list_(pa.float32())),
        pa.field("reward", pa.float32()),
        pa.field("correct", pa.bool_()),
        # Fixed when the rollout is generated, never recomputed at use (as in the paper,
        # App. 10.2: the advantage and the behaviour policy belong to the generating policy).
        pa.field("advantage", pa.float32()),
        pa.field("finish_reason", pa.string()),  # "stop" | "length"
        pa.field("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

USAGE_SCHEMA = pa.schema(
    [
        pa.field("lineage", pa.string()),
        pa.field("iteration", pa.int64()),
        # k, the step of the iteration (0 .. S-1) that used the row: with the policy version
        # v the iteration trains, the use was at global gradient step v·S + k.
        pa.field("train_step", pa.int64()),
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("policy_version_at_use", pa.int64()),
        pa.field("rollout_policy_version", pa.int64()),
    ]
)

FINISH_REASONS = ("stop", "length")

# sha256 hex prefix length: 80 bits, so a collision among even 1e9 rows is ~1e-6 likely.
_ROLLOUT_ID_HEX_CHARS = 20


def usage_rows(
    *,
    lineage: str,
    iteration: int,
    train_step: int | Sequence[int] | np.ndarray,
    rollout_id: Sequence[str] | pa.Array | pa.ChunkedArray,
    policy_version_at_use: int,
    rollout_policy_version: Sequence[int] | np.ndarray | pa.Array | pa.ChunkedArray,
) -> pa.Table:
    """One usage row per use of a rollout, in `USAGE_SCHEMA`: every engine logs its uses
    through this. `train_step`, `rollout_id` and `rollout_policy_version` hold one entry per
    use (or, for `train_step`, one int for all); `iteration` and `policy_version_at_use` are
    the same for every use of one record (an iteration; an asynchronous gradient step)."""
    n = len(rollout_id)
    steps = [train_step] * n if isinstance(train_step, int) else train_step
    return pa.table(
        {
            "lineage": [lineage] * n,
            "iteration": [iteration] * n,
            "train_step": steps,
            "rollout_id": rollout_id,
            "policy_version_at_use": [policy_version_at_use] * n,
            "rollout_policy_version": rollout_policy_version,
        }
    ).cast(USAGE_SCHEMA)


def rollout_id(*, lineage: str, iteration: int, prompt_index: int, sample_index: int) -> str:
    """Deterministic id of one completion, so a retried generation writes the same ids.

    >>> rollout_id(lineage="demo", iteration=0, prompt_index=0, sample_index=0) == rollout_id(
    ...     lineage="demo", iteration=0, prompt_index=0, sample_index=0)
    True
    """
    key = f"{lineage}/{iteration}/{prompt_index}/{sample_index}".encode()
    return hashlib.sha256(key).hexdigest()[:_ROLLOUT_ID_HEX_CHARS]


def _cast_to(table: pa.Table, schema: pa.Schema, *, what: str) -> pa.Table:
    """Select and cast `table`'s columns to `schema`, naming the first column that does not fit."""
    missing = [name for name in schema.names if name not in table.column_names]
    if missing:
        raise ReplayRLError(
            f"{what} table is missing column(s) {missing}: build rows with every column of "
            f"replayrl.buffer.schema.{what.upper()}_SCHEMA ({', '.join(schema.names)})"
        )
    extra = [name for name in table.column_names if name not in schema.names]
    if extra:
        raise ReplayRLError(
            f"{what} table has unknown column(s) {extra}: drop them; the buffer stores exactly "
            f"the columns of replayrl.buffer.schema.{what.upper()}_SCHEMA"
        )
    columns = []
    for field in schema:
        column = table.column(field.name)
        try:
            column = column.cast(field.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise ReplayRLError(
                f"{what} column {field.name!r} has type {column.type}, which does not cast to "
                f"{field.type}: fix the producer of that column: {e}"
            ) from e
        if not field.nullable and column.null_count:
            raise ReplayRLError(
                f"{what} column {field.name!r} has {column.null_count} null value(s): every row "
                f"needs a {field.name} (use replayrl.buffer.schema.rollout_id(...))"
            )
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)


def validate_rollouts(table: pa.Table) -> pa.Table:
    """Return `table` cast to `ROLLOUT_SCHEMA` (columns in schema order), or raise.

    Raises `ReplayRLError` naming the column for: a missing or unknown column, a column that
    does not cast, a null `rollout_id`, duplicate `rollout_id`s, a `behavior_logprobs` list
    whose length differs from `completion_token_ids` (naming the first such rollout), NaN in
    `reward` or `advantage` (saying how many), or a `finish_reason` outside "stop"/"length".
    """
    table = _cast_to(table, ROLLOUT_SCHEMA, what="rollout")
    ids = table.column("rollout_id")
    n_unique = len(pc.unique(ids))
    if n_unique != table.num_rows:
        counts = pc.value_counts(ids)
        dup = [v["values"] for v in counts.to_pylist() if v["counts"] > 1][:3]
        raise ReplayRLError(
            f"rollout column 'rollout_id' has {table.num_rows - n_unique} duplicate(s), e.g. "
            f"{dup}: derive ids with replayrl.buffer.schema.rollout_id(lineage=, iteration=, "
            f"prompt_index=, sample_index=) so each completion gets its own"
        )
    n_logprobs = pc.fill_null(pc.list_value_length(table.column("behavior_logprobs")), -1)
    n_tokens = pc.fill_null(pc.list_value_length(table.column("completion_token_ids")), -1)
    mismatch = pc.not_equal(n_logprobs, n_tokens)
    if pc.any(mismatch).as_py():
        first = pc.index(mismatch, True).as_py()
        raise ReplayRLError(
            f"rollout column 'behavior_logprobs' of rollout_id {ids[first].as_py()!r} has "
            f"{n_logprobs[first].as_py()} entries but 'completion_token_ids' has "
            f"{n_tokens[first].as_py()} (-1 = null): store one behaviour log-prob per "
            f"completion token"
        )
    for name in ("reward", "advantage"):
        n_nan = pc.sum(pc.is_nan(table.column(name))).as_py() or 0
        if n_nan:
            raise ReplayRLError(
                f"rollout column {name!r} has {n_nan} NaN value(s): a reward function that "
                f"cannot score a completion must return 0 (and count it), and a group with "
                f"zero reward variance needs a finite advantage"
            )
    reasons = table.column("finish_reason")
    bad_reason = pc.invert(pc.is_in(reasons, value_set=pa.array(FINISH_REASONS)))
    if pc.any(bad_reason).as_py():
        first = pc.index(bad_reason, True).as_py()
        raise ReplayRLError(
            f"rollout column 'finish_reason' is {reasons[first].as_py()!r} for rollout_id "
            f"{ids[first].as_py()!r}: use one of {list(FINISH_REASONS)}"
        )
    return table


def validate_usage(table: pa.Table) -> pa.Table:
    """Return `table` cast to `USAGE_SCHEMA` (columns in schema order), or raise
    `ReplayRLError` naming the missing, unknown or uncastable column or a null `rollout_id`."""
    return _cast_to(table, USAGE_SCHEMA, what="usage")
