"""Whether the buffer's tables are whole, and setting right what is not: `ReplayBuffer`'s
`check`, `repair` and `check_versions` (`self` is the buffer).

The transaction log goes first: a table whose log is damaged
(`replayrl.buffer.repair.log_damage`) cannot be loaded at all, so `check` lists its damaged
log files and `repair` sets them aside (`replayrl.buffer.repair.set_aside_log`) before the
data files of the tables that load are checked or repaired (`replayrl.buffer.maintenance`'s
`check` and `repair`). `check_versions` refuses a table whose log no longer reaches the
version a checkpoint pairs with (the table gone, its newest entries deleted) before
`restore` changes anything.

Knows nothing about what the rows mean or how they are written; the messages that name
the fix for a damaged log are `replayrl.buffer.failures`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from replayrl.buffer import maintenance
from replayrl.buffer.delta import READ_ERRORS, STORAGE_ERRORS
from replayrl.buffer.repair import (
    DamagedFile,
    LogDamage,
    damaged_files,
    log_damage,
    set_aside_log,
)
from replayrl.errors import ReplayRLError

if TYPE_CHECKING:
    from replayrl.buffer.table import ReplayBuffer


def check_versions(
    self: ReplayBuffer, *, rollouts_version: int | None, usage_version: int | None
) -> None:
    """Raise a ReplayRLError naming the fix when either table's log does not reach the
    version given (None: nothing to check): the table is gone (its log deleted, with or
    without its data files), its newest entries were deleted back past that version, or
    its log is damaged. A lineage resumed from a checkpoint that pairs with those
    versions must stop then, not carry on with a table started anew."""
    for uri, version in (
        (self.rollouts_uri, rollouts_version),
        (self.usage_uri, usage_version),
    ):
        if version is not None:
            self._check_reaches(uri, version)


def check_reaches(self: ReplayBuffer, uri: str, version: int) -> None:
    latest = self._latest_version(uri)  # a damaged log raises here, with its fix
    if latest is not None and version <= latest:
        return
    new_lineage = (
        "or start a new --lineage (this one's checkpoints keep its weights: --set "
        "model.source=<a checkpoint folder>)"
    )
    if latest is None:
        damage = self._log_damage(uri)
        if damage is not None:
            raise ReplayRLError(
                self._log_message(damage, action=f"go back to version {version} of")
            )
        raise ReplayRLError(
            f"Cannot go back to version {version} of {uri}: the table is gone (no Delta log "
            f"and no data files), though the lineage's last full checkpoint pairs with that "
            f"version. Put {uri} back from a backup, {new_lineage}. Nothing was changed"
        )
    raise ReplayRLError(
        f"Cannot go back to version {version} of {uri}: its Delta log ends at version {latest} "
        f"(the entries after it, {uri}/_delta_log/{latest + 1:020d}.json on, were deleted), "
        f"though the lineage's last full checkpoint pairs with version {version}. Put them "
        f"back from a backup, {new_lineage}. Nothing was changed"
    )


def check(self: ReplayBuffer) -> list[DamagedFile]:
    """Damaged files of the latest version of either table (empty when the buffer is
    healthy): entries of a transaction log that stop the table from loading (see
    `replayrl.buffer.repair.log_damage`), and data files that are missing, truncated or
    not Parquet (one footer read per file) of the tables whose log loads."""
    damages = self._log_damages()
    if not damages:
        return maintenance.check(self)
    out = [d for damage in damages.values() for d in damage.damaged]
    return out + self._data_damage(skip=set(damages))


def log_damages(self: ReplayBuffer) -> dict[str, LogDamage]:
    """Table URI -> what stops its log from loading, for the tables where something does."""
    out = {}
    for uri in (self.rollouts_uri, self.usage_uri):
        damage = self._log_damage(uri)
        if damage is not None:
            out[uri] = damage
    return out


def log_damage_of(self: ReplayBuffer, uri: str) -> LogDamage | None:
    """What in the transaction log of table `uri` stops it from loading (None: nothing)."""
    try:
        return log_damage(uri, name=self._name(uri), storage_options=self.storage_options)
    except READ_ERRORS as e:
        raise self._explain(e, action="read the Delta log of", uri=uri) from e


def data_damage(self: ReplayBuffer, *, skip: set[str]) -> list[DamagedFile]:
    """Damaged data files of the tables that exist, but those in `skip`."""
    out = []
    try:
        for uri in (self.rollouts_uri, self.usage_uri):
            if uri not in skip and self._latest_version(uri) is not None:
                out += damaged_files(
                    self._open(uri), name=self._name(uri), storage_options=self.storage_options
                )
    except STORAGE_ERRORS as e:
        raise self._explain(e, action="check", uri=self.root_uri) from e
    return out


def repair(self: ReplayBuffer, *, dry_run: bool = False) -> list[DamagedFile]:
    """Set damaged files (see `check`) aside under `<root>/quarantine/<table>/` so reads
    work again, and return them (with the rows each data file held); `dry_run` only
    lists them. A damaged log goes first: its damaged entry and every later one (with
    the data files those added) move to `quarantine/<table>/_delta_log.<time>/` and the
    table reads as the version before the damage (`replayrl.buffer.repair`); then
    damaged data files are moved and their removal committed, every other row staying.
    A log from which no version can be read is refused with a ReplayRLError (nothing is
    moved: only a backup brings it back). Running it again after a crash finishes it."""
    damages = self._log_damages()
    if not damages:
        return maintenance.repair(self, dry_run=dry_run)
    for damage in damages.values():
        if not damage.recoverable or damage.data_files:
            raise ReplayRLError(self._log_message(damage, action="repair"))
    listed = [d for damage in damages.values() for d in damage.damaged]
    if dry_run:
        return listed + self._data_damage(skip=set(damages))
    self.check_fence("repair")
    for uri, damage in damages.items():
        try:
            set_aside_log(
                root_uri=self.root_uri, damage=damage, storage_options=self.storage_options
            )
        except READ_ERRORS as e:
            raise self._explain(
                e,
                action="repair the Delta log of",
                uri=uri,
                hint="Nothing was deleted: files already moved are under quarantine/; rerun repair",
            ) from e
        # Snapshots of versions that are no longer in the log.
        self._latest.pop(uri, None)
        self._expected.pop(uri, None)
    return listed + maintenance.repair(self, dry_run=False)
