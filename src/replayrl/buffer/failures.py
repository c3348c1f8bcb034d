"""What a failed read or write of the buffer's Delta tables means, as a `ReplayRLError` that
names the fix. These are `ReplayBuffer`'s `_explain`, `_damage_error`, `_log_error`,
`_log_message`, `_check_present` and `_vanished_error` (`self` is the buffer), used by
`table`, `fenced`, `integrity`, `maintenance` and `mirror`.

`explain_failure` gives wrong credentials, a missing bucket and an unreachable store their own
fix (`replayrl.storage.s3.explain`); `damage_error` tells damaged data files
(`replayrl.buffer.repair.damaged_files`), and files vacuumed from under a pinned version,
from other failures; `log_error` and `log_message` do the same for a damaged transaction
log (`replayrl.buffer.repair.log_damage`); `check_present` and `vanished_error` refuse a
write to a table whose log entry went while this process used it (the run root or the
lineage folder deleted or moved).

Knows nothing about how the tables are opened, read or written (`replayrl.buffer.table`)
and writes nothing to storage: it only looks at it to tell what went wrong.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltalake import DeltaTable

from replayrl.buffer.delta import READ_ERRORS
from replayrl.buffer.repair import (
    QUARANTINE_DIR,
    LogDamage,
    damaged_files,
    log_damage,
    log_entry_exists,
)
from replayrl.errors import ReplayRLError
from replayrl.storage.s3 import classify, explain

if TYPE_CHECKING:
    from replayrl.buffer.table import ReplayBuffer


def explain_failure(
    self: ReplayBuffer, e: BaseException, *, action: str, uri: str, hint: str = ""
) -> ReplayRLError:
    """A ReplayRLError for a delta-rs/pyarrow failure: wrong credentials, a missing bucket
    and an unreachable store get their own fix; anything else keeps `hint`."""
    options = self.storage_options or {}
    secrets = [options.get("AWS_SECRET_ACCESS_KEY", ""), options.get("AWS_SESSION_TOKEN", "")]
    if classify(e) in ("credentials", "bucket", "transient") or not hint:
        return explain(
            e, action=action, uri=uri, endpoint=options.get("AWS_ENDPOINT_URL"), secrets=secrets
        )
    detail = explain(e, action=action, uri=uri, endpoint=None, secrets=secrets)
    return ReplayRLError(f"{detail}. {hint}")


def damage_error(
    self: ReplayBuffer, table: DeltaTable, e: BaseException, *, action: str
) -> ReplayRLError | None:
    """When `e` comes from damaged data files of `table`, an error naming them and the
    fix; None when every file is fine (the failure is something else)."""
    if classify(e) not in ("other", "missing"):
        return None  # credentials, bucket or an unreachable store: checking files cannot help
    try:
        if not log_entry_exists(
            table.table_uri, table.version(), storage_options=self.storage_options
        ):  # not damaged files: the whole table went while this process used it
            return self._vanished_error(table.table_uri.rstrip("/"), table.version(), action=action)
    except READ_ERRORS:
        pass
    try:
        name = table.table_uri.rstrip("/").rsplit("/", 1)[-1]
        damaged = damaged_files(table, name=name, storage_options=self.storage_options)
    except Exception:  # the check itself failed: report the original error instead
        return None
    if not damaged:
        return None
    latest = self._latest_version(table.table_uri)
    if table.version() != latest and all(d.problem == "missing" for d in damaged):
        return ReplayRLError(
            f"cannot {action} version {table.version()} of {table.table_uri}: "
            f"{len(damaged)} of its files were vacuumed (e.g. {damaged[0].path}); pin a newer "
            f"version (from compact()) or raise vacuum_grace_s"
        )
    listed = "; ".join(f"{d.path} {d.problem}" for d in damaged[:3])
    rows = sum(d.rows or 0 for d in damaged)
    return ReplayRLError(
        f"cannot {action} {table.table_uri}: {len(damaged)} data file(s) are damaged "
        f"({listed}). Run `replayrl buffer repair` for this lineage (ReplayBuffer.repair()): "
        f"it moves them to {self.root_uri}/quarantine/ and drops their {rows} row(s) from the "
        f"table; every other row is kept"
    )


def log_error(
    self: ReplayBuffer, uri: str, e: BaseException, *, action: str
) -> ReplayRLError | None:
    """When `e` comes from a damaged transaction log of table `uri`, an error naming the
    damage and the fix; None when the log is fine (the failure is something else)."""
    if classify(e) not in ("other", "missing"):
        return None  # credentials, bucket or an unreachable store: the log cannot be read
    try:
        damage = log_damage(uri, name=self._name(uri), storage_options=self.storage_options)
    except READ_ERRORS:  # the look itself failed: report the original error instead
        return None
    return None if damage is None else ReplayRLError(self._log_message(damage, action=action))


def log_message(self: ReplayBuffer, damage: LogDamage, *, action: str) -> str:
    """What is wrong with a table's log and what can be done, in one sentence or three."""
    uri = f"{self.root_uri}/{damage.table}"
    new_lineage = (
        "or start a new --lineage (this one's checkpoints keep its weights: --set "
        "model.source=<a checkpoint folder>)"
    )
    if damage.data_files:
        return (
            f"cannot {action} {uri}: it holds {damage.data_files} data file(s) but no Delta "
            f"log ({uri}/_delta_log/ is missing or empty), so which rows it holds is "
            f"unknown. Put _delta_log/ back from a backup, {new_lineage}; `replayrl buffer "
            f"repair` cannot rebuild a log"
        )
    faults = [d for d in damage.damaged if "so it goes with it" not in d.problem]
    listed = "; ".join(f"{d.path} {d.problem}" for d in faults[:3])
    if not damage.recoverable:
        return (
            f"cannot {action} {uri}: its Delta log is damaged ({listed}), so no version of "
            f"the table can be read. Put the file(s) back from a backup, {new_lineage}"
        )
    readable, latest = damage.readable_version, damage.latest_version
    later = len(damage.damaged) - len(faults)
    if latest is not None and readable is not None and readable < latest:
        versions = (
            f"version {latest}" if latest == readable + 1 else (f"versions {readable + 1}-{latest}")
        )
        loss = f"; the table then reads as version {readable} again, without what {versions} wrote"
        moved = f"the damaged entry{f' and the {later} after it' if later else ''}"
    else:
        loss = f"; nothing is lost: the table reads as version {readable}, its latest"
        moved = "the damaged shortcut(s) of the log"
    return (
        f"cannot {action} {uri}: its Delta log is damaged ({listed}). Run `replayrl buffer "
        f"repair` for this lineage (ReplayBuffer.repair(); --dry-run lists the files): it "
        f"moves {moved} to {self.root_uri}/{QUARANTINE_DIR}/{damage.table}/{loss}. Or put "
        f"the original file(s) back from a backup"
    )


def check_present(self: ReplayBuffer, uri: str, table: DeltaTable, *, action: str) -> None:
    """Refuse to write to table `uri` when the log entry of the version this process
    loaded is gone: the table (or the run root above it) was deleted or moved while this
    process used it, and delta-rs would write a new table's files into its place."""
    version = table.version()
    try:
        present = log_entry_exists(uri, version, storage_options=self.storage_options)
    except READ_ERRORS as e:
        raise self._explain(e, action=action, uri=uri) from e
    if not present:
        self._latest.pop(uri, None)
        raise self._vanished_error(uri, version, action=action)


def vanished_error(uri: str, version: int, *, action: str) -> ReplayRLError:
    return ReplayRLError(
        f"Cannot {action} {uri}: its Delta log entry for version {version}, there when "
        f"this run loaded it, is gone: the run root or the lineage folder was deleted or "
        f"moved while this run used it. Nothing was written; put it back and rerun the "
        f"same command to resume, or start a new --lineage"
    )
