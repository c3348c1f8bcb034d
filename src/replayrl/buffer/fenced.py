"""The buffer's commits under a fence (`replayrl.storage.fencing`): every Delta commit a
process makes to a lineage whose lease it holds is stamped with the lease's epoch, made only
on the version it read, and preceded by a look at what was committed since (`settle`). These
are `ReplayBuffer`'s `_commit`, `_first_seen` and `check_fence` (`self` is the buffer)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import CommitFailedError

from replayrl.buffer.delta import COMMIT_ATTEMPTS, commit_epochs, commit_properties, retry_conflicts
from replayrl.errors import ReplayRLError
from replayrl.storage import fencing

if TYPE_CHECKING:
    from replayrl.buffer.table import ReplayBuffer

log = logging.getLogger(__name__)


def first_seen(self: ReplayBuffer, uri: str, version: int) -> None:
    if uri not in self._expected and fencing.for_uri(uri) is not None:
        self._expected[uri] = version


def check_fence(self: ReplayBuffer, what: str) -> None:
    """StaleOwnerError when this process writes under a fence a newer owner superseded."""
    fencing.check(self.root_uri, what)


def commit(
    self: ReplayBuffer,
    uri: str,
    write: Callable[[DeltaTable, CommitProperties | None], object],
    *,
    action: str,
) -> int:
    """Run `write(snapshot, commit properties)`, one Delta commit on table `uri`, and
    return the table's version after it.

    Without a fence (no lease held for this lineage in this process) the commit is
    retried on the newer version after a concurrent writer's, as delta-rs would. Under a
    fence (`replayrl.storage.fencing`) the commit is conditioned on the epoch: the fence
    is checked before every attempt, the commit is stamped with the epoch and made only
    on the version it read (`delta.commit_properties`), and anything committed since this
    process last saw the table is inspected first (`_settle`): a newer owner's commit
    stops it (StaleOwnerError), a stale owner's is undone. So a stopped owner that comes
    back can land no commit after the newer owner's first one. Either way a table whose
    log entry of the loaded version is gone (deleted or moved while this process used it) is
    refused before anything is written (`_check_present`)."""
    fence = fencing.for_uri(uri)
    if fence is None:
        table = self._open(uri)
        self._check_present(uri, table, action=action)
        try:
            retry_conflicts(lambda: write(table, None), refresh=table.update_incremental)
        except CommitFailedError as e:
            raise _lost_races(uri, action=action) from e
        return self._open(uri).version()
    props = commit_properties(fence.epoch)
    for attempt in range(COMMIT_ATTEMPTS):
        fence.check(f"{action} {uri}")
        table = self._open(uri)
        self._check_present(uri, table, action=action)
        try:
            settle(self, uri, table, fence)
            write(table, props)
        except CommitFailedError:
            time.sleep(random.uniform(0.01, 0.05) * (attempt + 1))
            continue
        table.update_incremental()
        self._expected[uri] = table.version()
        return table.version()
    raise _lost_races(uri, action=action)


def _lost_races(uri: str, *, action: str) -> ReplayRLError:
    return ReplayRLError(
        f"Could not {action} {uri}: {COMMIT_ATTEMPTS} commits in a row lost the race with "
        "another writer of this table. Check that only one run writes this lineage."
    )


def settle(self: ReplayBuffer, uri: str, table: DeltaTable, fence: fencing.Fence) -> None:
    """Inspect the commits to `uri` since this process last saw it (`table`: the latest
    snapshot): a newer epoch's stops this process; a stale owner's (an older epoch, or
    unstamped) made after this owner's are undone by restoring the version it expected,
    unless this epoch committed after them too (the asynchronous engine's concurrent
    workers): those stay, with a warning (valid rows of a published policy version)."""
    expected = self._expected.get(uri)
    latest = table.version()
    if expected is None or latest == expected:
        self._expected[uri] = latest
        return
    commits = commit_epochs(table, after=expected)
    newer = [e for _, e in commits if e is not None and e > fence.epoch]
    if newer:
        fencing.admit(max(newer), epoch=fence.epoch, root=fence.root, what=f"write {uri}")
    stale = [v for v, e in commits if e is None or e < fence.epoch]
    if stale and len(stale) == len(commits):
        log.warning(
            "undoing %d commit(s) a stale owner made to %s after this run took over "
            "(versions %s): restoring version %d",
            len(stale),
            uri,
            stale,
            expected,
        )
        table.restore(expected, commit_properties=commit_properties(fence.epoch))
        table.update_incremental()
        self._expected[uri] = table.version()
        return
    if stale:
        log.warning(
            "a stale owner committed to %s between this run's commits (versions %s); "
            "kept: this run's own commits came after it",
            uri,
            stale,
        )
    self._expected[uri] = latest
