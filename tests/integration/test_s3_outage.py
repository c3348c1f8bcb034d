"""The S3 server goes away in the middle of a step: the step waits with backoff and carries
on when the server is back, or fails after its deadline with a clear error, and the lineage
then resumes cleanly to the same end state as a run that saw no outage."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fault_helpers import assert_same_end_state, crash_config, end_state

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.engine.inline import run_inline
from replayrl.errors import ReplayRLError
from replayrl.storage import transfer as storage_transfer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def outage_during(monkeypatch, server, owner, attr: str, *, down_s: float, hit: int = 1):
    """The `hit`-th call of owner.attr first stops the server and schedules its restart
    `down_s` seconds later, then runs the call against the stopped server."""
    original = getattr(owner, attr)
    calls = {"n": 0, "restarted": threading.Event()}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == hit:
            server.stop()
            calls["stopped_at"] = time.monotonic()

            def restart():
                server.start()
                calls["restarted"].set()

            threading.Timer(down_s, restart).start()
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, attr, wrapper)
    return calls


def test_objects_and_state_wait_for_a_restarted_server(private_s3_server, monkeypatch):
    root = f"s3://{private_s3_server.bucket}/blip"
    paths = storage.lineage_paths(root, "lin")
    storage.write_bytes_atomic(paths.config, b"before")
    private_s3_server.stop()
    threading.Timer(3.0, private_s3_server.start).start()
    start = time.monotonic()
    assert storage.read_bytes(paths.config) == b"before"  # waits for the restart
    assert time.monotonic() - start >= 2.5
    storage.write_bytes_atomic(paths.config, b"after")
    assert storage.read_bytes(paths.config) == b"after"


def test_steps_ride_out_a_restart_and_match_an_undisturbed_run(
    tmp_path: Path, private_s3_server, monkeypatch
):
    root = f"s3://{private_s3_server.bucket}"
    # a full checkpoint every iteration, so there is an upload in iteration 2 to disturb
    every = "train.checkpoint_every=1"
    ref = crash_config(tmp_path, f"{root}/ref", "iterations=3", every)
    run_inline(ref)
    cfg = crash_config(tmp_path, f"{root}/blips", "iterations=3", every)
    # down for a few seconds while a Delta commit (generate, iteration 1) and a checkpoint
    # upload (train, iteration 2; v0 is the first upload) are under way
    with monkeypatch.context() as m:
        a = outage_during(m, private_s3_server, ReplayBuffer, "append", down_s=2, hit=1)
        b = outage_during(m, private_s3_server, storage_transfer, "upload_dir", down_s=2, hit=3)
        run_inline(cfg)
    assert a["restarted"].wait(30) and b["restarted"].wait(30)
    assert_same_end_state(end_state(cfg), end_state(ref))


def test_a_long_outage_fails_after_the_deadline_and_resumes_cleanly(
    tmp_path: Path, private_s3_server, monkeypatch
):
    root = f"s3://{private_s3_server.bucket}"
    ref = crash_config(tmp_path, f"{root}/ref", "iterations=2")
    run_inline(ref)
    cfg = crash_config(tmp_path, f"{root}/long", "iterations=2")
    monkeypatch.setenv("REPLAYRL_S3_DEADLINE_S", "1.5")
    with monkeypatch.context() as m:
        outage = outage_during(m, private_s3_server, ReplayBuffer, "append", down_s=5, hit=2)
        with pytest.raises(ReplayRLError) as err:
            run_inline(cfg)
        waited = time.monotonic() - outage["stopped_at"]
    message = str(err.value)
    assert "unreachable" in message and "rerun the same command to resume" in message
    assert private_s3_server.secret_key not in message
    assert waited < 5, "gave up only when the server came back"
    # The scheduled restart: `proc` is set as soon as the process is spawned, so wait for
    # the server to be ready, not merely started.
    assert outage["restarted"].wait(timeout=90), "the S3 server did not come back"
    run_inline(cfg)
    assert_same_end_state(end_state(cfg), end_state(ref))
