"""The lineage lease on a local run root: a heartbeat keeps it alive while a step works,
stops renewing when the step ends (so a killed run's lease expires within one TTL), and
notices when another run has taken it; releasing writes nothing where no lease was."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from replayrl import storage
from replayrl.errors import ReplayRLError, StaleOwnerError
from replayrl.storage import fencing, lease

pytestmark = pytest.mark.unit


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_heartbeat_renews_the_lease_until_its_step_ends(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "beating")
    with lease.heartbeat(paths, owner="run-a", ttl_s=60, interval_s=0.05) as beat:
        first = lease.read(paths)
        wait_for(lambda: beat.beats >= 3)
        renewed = lease.read(paths)
        assert renewed.owner == "run-a" and renewed.acquired_at == first.acquired_at
        assert renewed.expires_at > first.expires_at
        with pytest.raises(ReplayRLError, match="being advanced by run 'run-a'"):
            lease.hold(paths, owner="run-b", ttl_s=60)
    # The step ended without releasing (a killed pod ends the same way): no more renewals,
    # so the lease runs out one TTL after the last one and another run may take it then.
    stopped_at = beat.beats
    last = lease.read(paths)
    time.sleep(0.2)
    assert beat.beats == stopped_at and lease.read(paths) == last
    taken = lease.hold(paths, owner="run-b", ttl_s=60, now=last.expires_at + 21)
    assert taken.owner == "run-b" and taken.epoch == last.epoch + 1


def test_a_heartbeat_that_finds_another_owner_stops_and_says_so(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "lost")
    with lease.heartbeat(paths, owner="run-a", ttl_s=60, interval_s=0.05) as beat:
        # As if run-a's lease had expired (a long stall) and run-b had taken the lineage.
        stolen = {"owner": "run-b", "acquired_at": time.time(), "expires_at": time.time() + 60}
        # Under the lease's lock, as another run's `hold` writes it: unlocked, a renewal
        # already past its read could overwrite it.
        with lease._locked(paths):
            storage.write_bytes_atomic(lease.lease_uri(paths), json.dumps(stolen).encode())
        wait_for(lambda: beat.lost is not None)
        assert "no longer this run's (now 'run-b'" in beat.lost
    assert lease.read(paths).owner == "run-b", "the heartbeat never takes a lease back"


def test_a_busy_lineage_stops_the_heartbeat_before_any_work(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "busy")
    lease.hold(paths, owner="run-a", ttl_s=60)
    with pytest.raises(ReplayRLError, match="being advanced by run 'run-a'"):
        with lease.heartbeat(paths, owner="run-b", ttl_s=60):
            pytest.fail("the block must not run")


def test_release_without_a_lease_writes_nothing(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "never-opened")
    assert not lease.release(paths, owner="run-a")
    assert list(tmp_path.iterdir()) == []


def test_held_takes_the_lease_when_asked_renews_it_and_releases_it(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "held")
    with lease.held(paths, owner="run-a", ttl_s=60) as holder:
        assert lease.read(paths) is None and holder.lost is None  # nothing taken yet
        holder.hold()
        beat = holder.beat
        assert lease.read(paths).owner == "run-a" and beat.interval_s == 20
        holder.hold()  # a renewal: still one heartbeat
        assert holder.beat is beat
    assert lease.read(paths) is None, "released at the end"
    assert not beat._thread.is_alive()


def test_held_releases_on_error_and_a_failed_release_never_masks_it(tmp_path, monkeypatch):
    paths = storage.lineage_paths(str(tmp_path), "failing")
    with pytest.raises(RuntimeError, match="the run's own"):
        with lease.held(paths, owner="run-a", ttl_s=60) as holder:
            holder.hold()
            raise RuntimeError("the run's own error")
    assert lease.read(paths) is None

    def unreachable(*args, **kwargs):
        raise OSError("store unreachable")

    monkeypatch.setattr(lease, "release", unreachable)
    with pytest.raises(RuntimeError, match="the run's own"):
        with lease.held(paths, owner="run-b", ttl_s=60) as holder:
            holder.hold()
            raise RuntimeError("the run's own error")
    assert lease.read(paths).owner == "run-b"


def test_held_on_a_busy_lineage_raises_and_leaves_the_other_runs_lease(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "busy-held")
    lease.hold(paths, owner="run-a", ttl_s=60)
    with pytest.raises(ReplayRLError, match="being advanced by run 'run-a'"):
        with lease.held(paths, owner="run-b", ttl_s=60) as holder:
            holder.hold()
    assert holder.beat is None and lease.read(paths).owner == "run-a"


def test_held_reports_a_lease_another_run_took(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "taken")
    with lease.held(paths, owner="run-a", ttl_s=0.15) as holder:
        holder.hold()  # renewed every 0.05 s
        stolen = {"owner": "run-b", "acquired_at": time.time(), "expires_at": time.time() + 60}
        with lease._locked(paths):
            storage.write_bytes_atomic(lease.lease_uri(paths), json.dumps(stolen).encode())
        wait_for(lambda: holder.lost is not None)
        assert "no longer this run's (now 'run-b'" in holder.lost
        with pytest.raises(StaleOwnerError):
            holder.hold()
    assert lease.read(paths).owner == "run-b", "not ours to release"


def test_every_take_gets_a_new_epoch_and_fences_the_state(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "epochs")
    storage.advance_state(
        paths,
        storage.LineageState(lineage="epochs", arm="replay", seed=0, config_hash="h"),
        expected_next_iteration=None,
    )
    epochs = []
    for _ in range(3):  # three runs one after another (or three steps of one Kubeflow run)
        with lease.held(paths, owner="kfp-run", ttl_s=60) as holder:
            holder.hold()
            epochs.append(holder.epoch)
            assert storage.read_state(paths).epoch == holder.epoch
            assert fencing.for_uri(paths.state).epoch == holder.epoch
    assert epochs == [1, 2, 3]
    # A lease file deleted by hand does not reset the epochs: the state remembers them.
    storage.delete(lease.lease_uri(paths))
    with lease.held(paths, owner="kfp-run", ttl_s=60) as holder:
        holder.hold()
        assert holder.epoch == 4


def test_a_retry_of_the_same_run_takes_a_new_epoch_and_the_first_attempt_is_fenced(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "retry")
    state = storage.LineageState(lineage="retry", arm="replay", seed=0, config_hash="h")
    first = lease.hold(paths, owner="kfp-run", ttl_s=60, token="attempt-1")
    lease.fence_take(paths, first)
    storage.advance_state(paths, state, expected_next_iteration=None)
    # The pod is stuck; Kubeflow retries the task: same owner, a new holder.
    retry = lease.hold(paths, owner="kfp-run", ttl_s=60, token="attempt-2")
    assert retry.epoch == first.epoch + 1
    lease.fence_take(paths, retry)
    # The first attempt comes back: its renewal and its commit are refused.
    with pytest.raises(StaleOwnerError):
        lease.renew(paths, first, ttl_s=60)
    fencing.install(fencing.Fence(paths.root, first.epoch))
    with pytest.raises(StaleOwnerError, match="newer owner"):
        storage.advance_state(
            paths, dataclasses.replace(state, next_iteration=2), expected_next_iteration=1
        )
    assert storage.read_state(paths).next_iteration == 1
    # Its release is a conditional write too: the retry's lease stays.
    assert not lease.release(paths, owner="kfp-run", token="attempt-1")
    assert lease.read(paths).token == "attempt-2"
    fencing.remove(paths.root)


def test_liveness_by_pid_only_in_the_holders_pid_namespace_and_boot(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "ns")
    live = lease.hold(paths, owner="inline:h:1:x", ttl_s=60, token="t")
    dead_pid = 2**22 + 12345  # above pid_max: no such process
    # Same host, boot and pid namespace, and the pid is gone: dead, taken at once.
    gone = dataclasses.replace(live, pid=dead_pid)
    storage.write_bytes_atomic(
        lease.lease_uri(paths), json.dumps(dataclasses.asdict(gone)).encode()
    )
    assert lease.hold(paths, owner="run-b", ttl_s=60).owner == "run-b"
    # Another pid namespace (a container on the same host name): its pids say nothing here.
    other_ns = dataclasses.replace(live, pid=dead_pid, pid_ns="pid:[4026531999]")
    storage.write_bytes_atomic(
        lease.lease_uri(paths), json.dumps(dataclasses.asdict(other_ns)).encode()
    )
    with pytest.raises(ReplayRLError, match="being advanced by run 'inline:h:1:x'"):
        lease.hold(paths, owner="run-b", ttl_s=60)
    # Another boot of the same machine: the same.
    other_boot = dataclasses.replace(live, pid=dead_pid, boot_id="another-boot")
    storage.write_bytes_atomic(
        lease.lease_uri(paths), json.dumps(dataclasses.asdict(other_boot)).encode()
    )
    with pytest.raises(ReplayRLError, match="being advanced by run 'inline:h:1:x'"):
        lease.hold(paths, owner="run-b", ttl_s=60)


def test_a_fast_clock_within_the_ttl_does_not_steal_a_live_lease(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "skew")
    held = lease.hold(paths, owner="run-a", ttl_s=60, now=1000.0, token="a")
    # run-a renews every 20 s; run-b's clock runs 50 s ahead (over 2/3 of the TTL).
    held = lease.hold(paths, owner="run-a", ttl_s=60, now=1020.0, token="a")
    with pytest.raises(ReplayRLError, match="being advanced by run 'run-a'"):
        lease.hold(paths, owner="run-b", ttl_s=60, now=1020.0 + 20 + 50)
    # Only past the expiry plus the allowance (a third of the TTL) is it free.
    assert lease.hold(paths, owner="run-b", ttl_s=60, now=held.expires_at + 20.5).owner == "run-b"


def test_the_skew_allowance_follows_the_holders_ttl_not_the_takers(tmp_path):
    paths = storage.lineage_paths(str(tmp_path), "ttl")
    held = lease.hold(paths, owner="run-a", ttl_s=3, now=1000.0, token="a")
    # A taker with a 600 s TTL does not wait 200 s past a 3 s lease: the holder's third.
    with pytest.raises(ReplayRLError, match="being advanced"):
        lease.hold(paths, owner="run-b", ttl_s=600, now=held.expires_at + 0.5)
    assert lease.hold(paths, owner="run-b", ttl_s=600, now=held.expires_at + 1.1).owner == "run-b"
