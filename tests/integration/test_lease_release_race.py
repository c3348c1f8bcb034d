"""Releasing a lease is a conditional write: a holder whose lease expired and was taken by
another run cannot release the new holder's lease, however the two calls interleave.

On S3 the release rewrites `lease.json` (marked released) with If-Match on the ETag it just
read, so a take that lands between its read and its write makes the write fail and the
release re-reads, finds another holder and writes nothing. Locally the same read-decide-write
runs under the lease's lock file. Both stores run here: the real S3 server (SeaweedFS) and a
local folder.
"""

from __future__ import annotations

import threading
import time

import pytest

from replayrl import storage
from replayrl.storage import lease

pytestmark = pytest.mark.integration

TTL_S = 30.0
ROUNDS = 50


@pytest.fixture(params=["file", "s3"])
def run_root(request, tmp_path) -> str:
    if request.param == "file":
        return str(tmp_path / "runs")
    return request.getfixturevalue("s3_root")


def _expired_lease_of_a(paths: storage.LineagePaths) -> lease.Lease:
    """Run A took the lease long ago and stopped renewing it (a stalled pod): expired."""
    return lease.hold(paths, owner="run-a", ttl_s=TTL_S, token="a", now=time.time() - 10 * TTL_S)


def test_a_stale_holder_cannot_release_the_lease_another_run_took(run_root):
    paths = storage.lineage_paths(run_root, "stale-release")
    held_by_a = _expired_lease_of_a(paths)
    held_by_b = lease.hold(paths, owner="run-b", ttl_s=TTL_S, token="b")
    assert held_by_b.epoch == held_by_a.epoch + 1, "a new take, one epoch up"
    before = storage.read_bytes(lease.lease_uri(paths))

    # A comes back and releases, by its token and by its run id alone (the exit task's way).
    assert not lease.release(paths, owner="run-a", token=held_by_a.token)
    assert not lease.release(paths, owner="run-a")

    assert storage.read_bytes(lease.lease_uri(paths)) == before, "B's lease is untouched"
    assert lease.read(paths) == held_by_b
    assert lease.renew(paths, held_by_b, ttl_s=TTL_S).token == "b", "and B still renews it"
    # B's own release still works.
    assert lease.release(paths, owner="run-b", token="b")
    assert lease.read(paths) is None


def test_a_release_racing_a_take_never_leaves_the_taker_without_its_lease(run_root):
    """A's release and B's take start together, many times: whichever lands first, B ends
    holding the stored lease (same token, epoch and expiry, not released)."""
    released_first = 0
    for i in range(ROUNDS):
        paths = storage.lineage_paths(run_root, f"race-{i}")
        held_by_a = _expired_lease_of_a(paths)
        start = threading.Barrier(2)
        out: dict[str, object] = {}

        def release_a(paths=paths, held_by_a=held_by_a, start=start, out=out) -> None:
            start.wait()
            out["released"] = lease.release(paths, owner="run-a", token=held_by_a.token)

        def take_b(paths=paths, start=start, out=out, token=f"b{i}") -> None:
            start.wait()
            out["taken"] = lease.hold(paths, owner="run-b", ttl_s=TTL_S, token=token)

        threads = [threading.Thread(target=release_a), threading.Thread(target=take_b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert set(out) == {"released", "taken"}, f"round {i}: a call failed or hung: {out}"

        taken = out["taken"]
        assert isinstance(taken, lease.Lease)
        stored = lease._stored(paths)
        assert stored == taken and not stored.released, (
            f"round {i}: B believes it holds {taken}, the store has {stored}"
        )
        assert taken.epoch == held_by_a.epoch + 1
        assert lease.renew(paths, taken, ttl_s=TTL_S).token == f"b{i}"
        released_first += bool(out["released"])
    # Either order is fine; say which ones this run saw (pytest -rA shows it).
    print(f"A's release landed before B's take in {released_first} of {ROUNDS} rounds")
