"""The buffer's Delta commits under a lease are fenced: a stale owner's next commit is
refused, one that was already past its fence check is undone by the new owner's next commit,
a newer owner's commit stops an older one; and a vacuum, whatever its grace, keeps the
files a rewind to the last full checkpoint needs (`replayrl buffer vacuum --grace-s 0`
between checkpoints, then a crash and a resume)."""

from __future__ import annotations

import pytest
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError
from fault_helpers import crash_config, rows

from replayrl import storage
from replayrl.buffer.delta import commit_properties
from replayrl.buffer.table import ReplayBuffer
from replayrl.errors import StaleOwnerError
from replayrl.storage import fencing, lease


def _take(paths, token: str) -> fencing.Fence:
    """Take the lease as a new holder; a previous holder's lease is long expired (`now`)."""
    held = lease.read(paths)
    now = None if held is None else held.expires_at + 3600
    taken = lease.hold(paths, owner=f"run-{token}", ttl_s=60, token=token, now=now)
    return lease.fence_take(paths, taken)


def test_a_stale_owners_commits_are_refused_or_undone(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "fenced")
    state = storage.LineageState(lineage="fenced", arm="replay", seed=0, config_hash="h")
    a = _take(paths, "a")
    storage.advance_state(paths, state, expected_next_iteration=None)
    buf_a = ReplayBuffer(paths.buffer)
    buf_a.append(rows(1), iteration=1)
    snapshot_a = DeltaTable(buf_a.rollouts_uri)  # what A read before it stalled
    assert storage.read_state(paths).epoch == a.epoch == 1

    # A stalls; its lease expires; B takes over (epoch 2) and fences state.json.
    b = _take(paths, "b")
    assert b.epoch == 2 and storage.read_state(paths).epoch == 2
    buf_b = ReplayBuffer(paths.buffer)
    assert buf_b.version() == 0

    # A comes back: its next commit checks the fence and is refused.
    fencing.install(a)
    with pytest.raises(StaleOwnerError, match="newer owner"):
        buf_a.append(rows(2), iteration=2)
    # The commit A was already inside (past its check) lands before B commits anything...
    write_deltalake(snapshot_a, rows(9), mode="append", commit_properties=commit_properties(1))
    assert DeltaTable(buf_a.rollouts_uri).version() == 1

    # ...and B's next commit finds it (an older epoch after the version B expected) and
    # restores that version before committing its own rows.
    fencing.install(b)
    buf_b.append(rows(2), iteration=2)
    assert sorted(set(buf_b.read().column("iteration").to_pylist())) == [1, 2]
    # A's snapshot is now behind B's commits: a commit on it is refused, never rebased.
    with pytest.raises(CommitFailedError):
        write_deltalake(snapshot_a, rows(9), mode="append", commit_properties=commit_properties(1))
    assert 9 not in buf_b.read().column("iteration").to_pylist()

    # A newer owner's commit stops B at its next commit.
    latest = DeltaTable(buf_b.rollouts_uri)
    write_deltalake(latest, rows(7), mode="append", commit_properties=commit_properties(3))
    with pytest.raises(StaleOwnerError):
        buf_b.append(rows(3), iteration=3)
    fencing.remove(paths.root)


@pytest.mark.integration
@pytest.mark.slow
def test_vacuum_with_no_grace_between_checkpoints_keeps_what_the_rewind_needs(
    tmp_path, monkeypatch
):
    """A lineage with a full checkpoint every 2 iterations crashes after committing
    iteration 3; `replayrl buffer vacuum --grace-s 0` runs; the resume rewinds to the
    checkpoint of iteration 2 and finishes."""
    from test_crash_safety import Crash, arm

    from replayrl.cli.main import main
    from replayrl.engine.inline import run_inline

    cfg = crash_config(tmp_path, str(tmp_path / "runs"), "train.checkpoint_every=2")
    with monkeypatch.context() as m:

        def stop():
            raise Crash("after iteration 3")

        arm(m.setattr, "record:after_commit", 3, stop)
        with pytest.raises(Crash):
            run_inline(cfg)
    paths = storage.paths_of(cfg)
    state = storage.read_state(paths)
    assert state.next_iteration == 4 and state.checkpoint["iteration"] == 2
    buf = ReplayBuffer(paths.buffer)
    paired = state.checkpoint["rollouts_version"]
    needed = set(DeltaTable(buf.rollouts_uri, version=paired).file_uris())
    # Without the checkpoint's version kept, a no-grace vacuum would delete some of them.
    unprotected = buf.vacuum(grace_s=0, dry_run=True)["rollouts"]
    assert any(uri.endswith(name) for uri in needed for name in unprotected)

    code = main(
        ["buffer", "vacuum", "--grace-s", "0", "--run-root", cfg.storage.run_root,
         "--lineage", cfg.lineage]
    )  # fmt: skip
    assert code == 0
    assert lease.read(paths) is None, "the vacuum released the lease it took"
    assert all(storage.exists(uri) for uri in needed)
    summary = run_inline(cfg)
    assert storage.read_state(paths).next_iteration == cfg.iterations + 1
    assert summary is not None
