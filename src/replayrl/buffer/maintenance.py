"""Keeping the replay buffer's tables in shape: retention, bin-packing, vacuum, restore,
check and repair. `ReplayBuffer.compact`, `vacuum`, `restore`, `check` and `repair`
delegate to the functions of the same names here.

`compact` applies retention (`replayrl.buffer.retention`) in one delete commit, bin-packs
small files of both tables (`pack_and_vacuum`) and vacuums old ones; a crash mid-way leaves
every row in place or deleted as one commit, and the next compact finishes the job.
`restore` brings both tables back to the versions a checkpoint pairs with (the engines'
rewind). `check` and `repair` find damaged data files and set them aside
(`replayrl.buffer.repair`).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable

from replayrl.buffer.delta import (
    READ_ERRORS,
    STORAGE_ERRORS,
    sql_str,
    writer_properties,
)
from replayrl.buffer.repair import DamagedFile, damaged_files, quarantine
from replayrl.buffer.retention import retention_parts
from replayrl.errors import ReplayRLError

if TYPE_CHECKING:
    from replayrl.buffer.table import ReplayBuffer

# Columns retention needs; compact never reads prompts, completions or token ids.
RETENTION_COLUMNS = ["iteration", "rollout_id", "policy_version", "correct"]
# Stands for a null policy_version: older than any real one.
_NO_POLICY_VERSION = -(2**62)
# The longest vacuum grace delta-rs is given, in hours (1000 years): every file is younger,
# so a longer grace keeps exactly the same files, and delta-rs panics (PanicException, past
# any `except Exception`) on a grace of about 10^15 hours or more.
MAX_GRACE_HOURS = 1000 * 365 * 24


@dataclass(frozen=True)
class CompactReport:
    """What one `compact` did. `version` is the rollouts table version to pin for training."""

    version: int
    rows_before: int
    rows_after: int
    rows_deleted: int
    files_before: int
    files_after: int
    files_compacted: int  # data files rewritten by the bin-pack; 0 when it was skipped
    files_vacuumed: int  # rollouts data files removed from storage by vacuum
    usage_files_compacted: int
    usage_files_vacuumed: int
    seconds: float
    # The rows kept only for the positive bias (correct rows older than the FIFO part):
    # how many, and their generating policy versions' oldest and mean (None and NaN when
    # there are none).
    bias_rows: int = 0
    bias_oldest_policy_version: int | None = None
    bias_mean_policy_version: float = math.nan

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


# ---- compact ----------------------------------------------------------------------------


def delete_predicate(
    *, iteration: np.ndarray, rollout_id: np.ndarray, correct: np.ndarray, keep: np.ndarray
) -> str:
    """One SQL predicate matching exactly the rows with keep=False, kept short: whole
    iterations as `iteration IN (...)`; an iteration whose incorrect rows all go (positive
    bias) as `(iteration = k AND (correct IS NULL OR NOT correct))`; other partly dropped
    iterations list the shorter of the dropped ids (`IN`) and the kept ids (`NOT IN`).

    Args:
        iteration: (rows,) int. rollout_id: (rows,) str. correct: (rows,) bool, null as
            False. keep: (rows,) bool, from `retained_mask`.
    """
    whole: list[int] = []
    partial: list[str] = []
    for it in np.unique(iteration[~keep]):
        in_iteration = iteration == it  # (rows,)
        dropped = in_iteration & ~keep  # (rows,)
        kept = in_iteration & keep  # (rows,)
        if not kept.any():
            whole.append(int(it))
        elif np.array_equal(dropped, in_iteration & ~correct):
            partial.append(f"(iteration = {int(it)} AND (correct IS NULL OR NOT correct))")
        else:
            listed, op = (dropped, "IN") if dropped.sum() <= kept.sum() else (kept, "NOT IN")
            ids = ", ".join(sql_str(str(r)) for r in rollout_id[listed])
            partial.append(f"(iteration = {int(it)} AND rollout_id {op} ({ids}))")
    clauses = ([f"iteration IN ({', '.join(map(str, whole))})"] if whole else []) + partial
    return " OR ".join(clauses)


def _check_compact_args(
    *, target_file_bytes: int, min_files_to_compact: int, vacuum_grace_s: float | None
) -> None:
    if vacuum_grace_s is not None and not vacuum_grace_s >= 0:  # NaN too
        raise ReplayRLError(f"vacuum_grace_s must be >= 0 seconds, got {vacuum_grace_s}")
    if target_file_bytes < 1 or min_files_to_compact < 1:
        raise ReplayRLError(
            "target_file_bytes and min_files_to_compact must be >= 1, got "
            f"{target_file_bytes} and {min_files_to_compact}"
        )


def _retention(
    keys: pa.Table,
    *,
    capacity: int,
    positive_bias: float,
    max_staleness: int | None,
    current_policy_version: int,
) -> tuple[str | None, np.ndarray, np.ndarray]:
    """What retention does to the rows whose `RETENTION_COLUMNS` are `keys`: the delete
    predicate of the rows it drops (None: it drops none), the (rows,) bool mask of the rows
    kept only for the positive bias, and those rows' generating policy versions."""
    iteration = keys.column("iteration").to_numpy()  # (rows,)
    rollout_ids = keys.column("rollout_id").to_numpy()  # (rows,) str objects
    correct = keys.column("correct").fill_null(False).to_numpy()  # (rows,)
    # Dense ranks order like the id strings but let numpy sort integers, not objects.
    id_rank = pc.rank(keys.column("rollout_id"), tiebreaker="dense").to_numpy()  # (rows,)
    try:
        policy_version = keys.column("policy_version").fill_null(_NO_POLICY_VERSION).to_numpy()
        fifo, bias = retention_parts(
            iteration=iteration,
            tiebreak=id_rank,
            policy_version=policy_version,
            correct=correct,
            capacity=capacity,
            positive_bias=positive_bias,
            max_staleness=max_staleness,
            current_policy_version=current_policy_version,
        )
    except ValueError as e:
        raise ReplayRLError(f"invalid buffer retention setting: {e}") from e
    keep = fifo | bias  # (rows,)
    bias_versions = policy_version[bias & (policy_version > _NO_POLICY_VERSION)]  # (bias rows,)
    predicate = None
    if not keep.all():
        predicate = delete_predicate(
            iteration=iteration, rollout_id=rollout_ids, correct=correct, keep=keep
        )
    return predicate, bias, bias_versions


def compact(
    buf: ReplayBuffer,
    *,
    capacity: int,
    positive_bias: float,
    max_staleness: int | None,
    current_policy_version: int,
    target_file_bytes: int,
    min_files_to_compact: int,
    vacuum_grace_s: float | None,
) -> CompactReport:
    """`ReplayBuffer.compact`: retention in one delete commit, then `pack_and_vacuum` of
    both tables."""
    _check_compact_args(
        target_file_bytes=target_file_bytes,
        min_files_to_compact=min_files_to_compact,
        vacuum_grace_s=vacuum_grace_s,
    )
    start = time.perf_counter()
    table = buf._open(buf.rollouts_uri)
    files_before = len(table.file_uris())
    keys = buf._scan(table, columns=RETENTION_COLUMNS)
    predicate, bias, bias_versions = _retention(
        keys,
        capacity=capacity,
        positive_bias=positive_bias,
        max_staleness=max_staleness,
        current_policy_version=current_policy_version,
    )
    try:
        if predicate is not None:
            # By key: redone after a concurrent append, it deletes exactly these rows.
            buf._commit(
                buf.rollouts_uri,
                lambda t, props: t.delete(
                    predicate, writer_properties=writer_properties(), commit_properties=props
                ),
                action="apply retention to",
            )
        files_compacted, files_vacuumed = pack_and_vacuum(
            buf,
            buf.rollouts_uri,
            target_file_bytes=target_file_bytes,
            min_files_to_compact=min_files_to_compact,
            vacuum_grace_s=vacuum_grace_s,
        )
        usage_compacted = usage_vacuumed = 0
        if buf._latest_version(buf.usage_uri) is not None:
            usage_compacted, usage_vacuumed = pack_and_vacuum(
                buf,
                buf.usage_uri,
                target_file_bytes=target_file_bytes,
                min_files_to_compact=min_files_to_compact,
                vacuum_grace_s=vacuum_grace_s,
            )
        final = buf._open(buf.rollouts_uri)
        rows_after = final.count()
        files_after = len(final.file_uris())
    except READ_ERRORS as e:
        raise _compact_error(buf, e) from e
    return CompactReport(
        version=final.version(),
        rows_before=keys.num_rows,
        rows_after=rows_after,
        rows_deleted=keys.num_rows - rows_after,
        files_before=files_before,
        files_after=files_after,
        files_compacted=files_compacted,
        files_vacuumed=files_vacuumed,
        usage_files_compacted=usage_compacted,
        usage_files_vacuumed=usage_vacuumed,
        seconds=time.perf_counter() - start,
        bias_rows=int(bias.sum()),
        bias_oldest_policy_version=int(bias_versions.min()) if bias_versions.size else None,
        bias_mean_policy_version=(float(bias_versions.mean()) if bias_versions.size else math.nan),
    )


def _compact_error(buf: ReplayBuffer, e: BaseException) -> ReplayRLError:
    """The error of a failed compact: damaged files of either table, or the store."""
    damage = buf._damage_error(buf._open(buf.rollouts_uri), e, action="compact")
    if damage is None and buf._latest_version(buf.usage_uri) is not None:
        damage = buf._damage_error(buf._open(buf.usage_uri), e, action="compact")
    if damage is not None:
        return damage
    return buf._explain(
        e,
        action="compact",
        uri=buf.root_uri,
        hint="Rows not yet deleted stay in place and the next compact deletes them "
        "(rerun it, or check the store is writable)",
    )


def pack_and_vacuum(
    buf: ReplayBuffer,
    uri: str,
    *,
    target_file_bytes: int,
    min_files_to_compact: int,
    vacuum_grace_s: float | None,
) -> tuple[int, int]:
    """Bin-pack small files of table `uri` when there are enough, then vacuum files
    unreferenced for longer than the grace period (`vacuum_table`). Returns (files
    rewritten, files vacuumed)."""
    files_compacted = 0
    if len(buf._open(uri).file_uris()) >= min_files_to_compact:
        metrics: dict = {}

        def pack(table: DeltaTable, props: CommitProperties | None) -> None:
            metrics.update(
                table.optimize.compact(
                    target_size=target_file_bytes,
                    writer_properties=writer_properties(),
                    commit_properties=props,
                )
            )

        buf._commit(uri, pack, action="bin-pack")
        files_compacted = int(metrics.get("numFilesRemoved", 0))
    if vacuum_grace_s is None:
        return files_compacted, 0
    return files_compacted, len(vacuum_table(buf, uri, grace_s=vacuum_grace_s, dry_run=False))


def vacuum_table(
    buf: ReplayBuffer, uri: str, *, grace_s: float, dry_run: bool, keep: list[int] | None = None
) -> list[str]:
    """Delete (list, when `dry_run`) the data files of table `uri` no version newer than
    `grace_s` references, except every file of the versions in `keep` (whatever the grace:
    the version a rewind restores). delta-rs records a vacuum as commits around its deletes;
    those go through the buffer's fenced commit (`ReplayBuffer._commit`), so a stale owner's
    vacuum is refused before it deletes anything."""
    removed: list[str] = []

    def vacuum(table: DeltaTable, props: CommitProperties | None) -> None:
        kept = [v for v in keep or [] if v is not None and v <= table.version()]
        # delta-rs counts retention in whole hours: round up, so no file goes sooner than asked.
        hours = MAX_GRACE_HOURS if grace_s >= MAX_GRACE_HOURS * 3600.0 else grace_s / 3600.0
        removed[:] = table.vacuum(
            retention_hours=math.ceil(hours),
            dry_run=dry_run,
            enforce_retention_duration=False,
            keep_versions=kept or None,
            commit_properties=props,
        )

    if dry_run:
        vacuum(buf._open(uri), None)
    else:
        buf._commit(uri, vacuum, action="vacuum")
    return list(removed)


# ---- vacuum and restore ------------------------------------------------------------------


def _tables(buf: ReplayBuffer) -> list[tuple[str, DeltaTable]]:
    """(name, latest snapshot) of each of `buf`'s tables that exists."""
    return [
        (uri.rsplit("/", 1)[-1], buf._open(uri))
        for uri in (buf.rollouts_uri, buf.usage_uri)
        if buf._latest_version(uri) is not None
    ]


def vacuum(
    buf: ReplayBuffer,
    *,
    grace_s: float,
    dry_run: bool,
    keep_versions: dict[str, int | None] | None = None,
) -> dict[str, list[str]]:
    """`ReplayBuffer.vacuum`: the data files no version newer than `grace_s` references
    deleted (listed only when `dry_run`), per table, except those of the version
    `keep_versions` names per table ("rollouts", "usage")."""
    if not grace_s >= 0:  # NaN too
        raise ReplayRLError(f"grace_s must be >= 0 seconds, got {grace_s}")
    out = {}
    try:
        for uri in (buf.rollouts_uri, buf.usage_uri):
            if buf._latest_version(uri) is not None:
                name = uri.rsplit("/", 1)[-1]
                keep = (keep_versions or {}).get(name)
                out[name] = vacuum_table(
                    buf,
                    uri,
                    grace_s=grace_s,
                    dry_run=dry_run,
                    keep=None if keep is None else [keep],
                )
    except STORAGE_ERRORS as e:
        raise buf._explain(e, action="vacuum", uri=buf.root_uri) from e
    return out


def restore(buf: ReplayBuffer, *, rollouts_version: int | None, usage_version: int | None) -> bool:
    """`ReplayBuffer.restore`: each table back to its version (None: no rows) in one
    commit, unless it already holds exactly those files. True when anything changed."""
    changed = False
    for uri, version in (
        (buf.rollouts_uri, rollouts_version),
        (buf.usage_uri, usage_version),
    ):
        latest = buf._latest_version(uri)
        if latest is None or latest == version:
            continue
        table = buf._open(uri)
        try:
            if version is None:
                if table.file_uris():
                    buf._commit(
                        uri, lambda t, props: t.delete(commit_properties=props), action="empty"
                    )
                    changed = True
                continue
            target = DeltaTable(uri, version=version, storage_options=buf.storage_options)
            if set(target.file_uris()) == set(table.file_uris()):
                continue

            def restore_to(t: DeltaTable, props: CommitProperties | None, v: int = version) -> None:
                t.restore(v, commit_properties=props)

            buf._commit(uri, restore_to, action=f"restore version {version} of")
            changed = True
        except STORAGE_ERRORS as e:
            raise buf._explain(
                e,
                action=f"restore version {version} of",
                uri=uri,
                hint="Its data files may have been vacuumed (buffer.vacuum_grace_s); the "
                "table is unchanged",
            ) from e
    return changed


# ---- health and repair -------------------------------------------------------------------


def check(buf: ReplayBuffer) -> list[DamagedFile]:
    """`ReplayBuffer.check`: damaged data files of the latest version of either table."""
    try:
        return [
            d
            for name, table in _tables(buf)
            for d in damaged_files(table, name=name, storage_options=buf.storage_options)
        ]
    except STORAGE_ERRORS as e:
        raise buf._explain(e, action="check", uri=buf.root_uri) from e


def repair(buf: ReplayBuffer, *, dry_run: bool) -> list[DamagedFile]:
    """`ReplayBuffer.repair`: damaged data files moved to `<root>/quarantine/<table>/` and
    dropped from their table."""
    damaged = buf.check()
    if dry_run or not damaged:
        return damaged
    buf.check_fence("repair")
    try:
        for name, table in _tables(buf):
            mine = [d for d in damaged if d.table == name]
            if mine:
                quarantine(
                    root_uri=buf.root_uri,
                    table=table,
                    damaged=mine,
                    storage_options=buf.storage_options,
                )
    except STORAGE_ERRORS as e:
        raise buf._explain(
            e,
            action="repair",
            uri=buf.root_uri,
            hint="Nothing was deleted: files already moved are under quarantine/; rerun repair",
        ) from e
    return damaged
