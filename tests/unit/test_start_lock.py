"""Engine starts on one GPU are serialised by its start lock (`policy.start_lock`), across
processes: real processes, real flock, a construction that is nothing but time. Each test
takes a second or two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from replayrl.errors import ReplayRLError
from replayrl.policy import start_lock

pytestmark = pytest.mark.unit

# One "engine start": wait for the go file, then hold the key's lock while the construction
# (a sleep) runs, and write when it began and ended (time.time, one clock for all processes).
START = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from replayrl.policy import start_lock

    directory, key, go, out, hold_s = sys.argv[1:6]
    Path(out + ".ready").write_text("")
    while not Path(go).exists():
        time.sleep(0.005)
    with start_lock.hold([key], directory=Path(directory), what="a test start"):
        began = time.time()
        Path(out + ".held").write_text("")
        time.sleep(float(hold_s))
        ended = time.time()
    Path(out).write_text(json.dumps([began, ended]))
    """
)


def starts(tmp_path: Path, keys: list[str], hold_s: float = 1.0) -> list[tuple[float, float]]:
    """Run one start per key in its own process, all released at once; their intervals."""
    script = tmp_path / "start.py"
    script.write_text(START)
    go = tmp_path / "go"
    outs = [tmp_path / f"start{i}.json" for i in range(len(keys))]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(tmp_path / "locks"),
                key,
                str(go),
                str(out),
                str(hold_s),
            ]
        )
        for key, out in zip(keys, outs, strict=True)
    ]
    deadline = time.monotonic() + 60
    while not all(Path(f"{out}.ready").exists() for out in outs):  # all polling for "go"
        assert time.monotonic() < deadline, "the starts did not come up"
        time.sleep(0.01)
    go.write_text("")
    for p in procs:
        assert p.wait(timeout=60) == 0
    return [tuple(json.loads(out.read_text())) for out in outs]


def test_two_starts_on_one_gpu_run_one_after_the_other(tmp_path):
    (a0, a1), (b0, b1) = sorted(starts(tmp_path, ["GPU-aaaa", "GPU-aaaa"]))
    assert a1 - a0 >= 1.0 and b1 - b0 >= 1.0
    assert b0 >= a1  # the second began after the first ended: no overlap


def test_starts_on_different_gpus_run_at_once(tmp_path):
    """The lock is per GPU: with different keys the same two starts overlap (so the test
    above is the lock's doing, not the processes')."""
    (a0, a1), (b0, b1) = sorted(starts(tmp_path, ["GPU-aaaa", "GPU-bbbb"]))
    assert b0 < a1


def hold_in_child(tmp_path: Path, key: str) -> subprocess.Popen:
    """A process that holds `key`'s lock for a minute (until it is killed)."""
    script = tmp_path / "start.py"
    script.write_text(START)
    go, out = tmp_path / "go", tmp_path / "holder.json"
    go.write_text("")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "locks"), key, str(go), str(out), "60"]
    )
    deadline = time.monotonic() + 30
    while not Path(str(out) + ".held").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the holder did not start"
        time.sleep(0.02)
    return proc


def test_a_start_that_waits_too_long_names_the_holder(tmp_path):
    holder = hold_in_child(tmp_path, "GPU-aaaa")
    try:
        began = time.monotonic()
        with pytest.raises(ReplayRLError) as caught:
            with start_lock.hold(["GPU-aaaa"], directory=tmp_path / "locks", timeout_s=0.3):
                pytest.fail("the lock was taken while another process held it")
        assert 0.3 <= time.monotonic() - began < 5
        message = str(caught.value)
        assert f"pid {holder.pid}: a test start" in message
        assert "GPU-aaaa" in message and str(tmp_path / "locks" / "GPU-aaaa.lock") in message
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = hold_in_child(tmp_path, "GPU-aaaa")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    began = time.monotonic()
    with start_lock.hold(["GPU-aaaa"], directory=tmp_path / "locks", timeout_s=5):
        assert time.monotonic() - began < 1
        note = (tmp_path / "locks" / "GPU-aaaa.lock").read_text()
        assert note == f"pid {os.getpid()}: a vLLM engine start\n"
    assert (tmp_path / "locks" / "GPU-aaaa.lock").read_text() == ""  # the note goes with it


def test_device_keys_become_file_names(tmp_path):
    with pytest.raises(ValueError, match="device key"):
        with start_lock.hold([".."], directory=tmp_path / "locks"):
            pass
    assert not (tmp_path / "locks").exists()  # refused before anything was made
    assert start_lock._file_name("GPU-1a2b/MIG 3") == "GPU-1a2b_MIG_3"


def test_the_trainer_loads_under_the_start_lock_of_gpus_it_shares_with_engines(monkeypatch):
    """The asynchronous trainer's model load on GPUs shared with vLLM engines waits for an
    engine start under way on them (`devices.trainer_load_lock`), and loads at once on GPUs
    of its own. CUDA is not on this machine: only its presence and the GPU's key are
    stood in for; the lock is the real flock, held by a real engine start's process."""
    import threading
    import uuid

    import torch

    from replayrl.engine.asynchronous import devices
    from replayrl.policy.engine_share import SHARING_ENV

    assert devices.engines_beside_trainer({SHARING_ENV: "2,1"}) == 2
    assert devices.engines_beside_trainer({SHARING_ENV: "0,1"}) == 0
    assert devices.engines_beside_trainer({}) == 0
    with devices.trainer_load_lock({SHARING_ENV: "2,1"}):  # no CUDA: nothing to hold
        pass

    key = f"test-gpu-{uuid.uuid4().hex}"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(start_lock, "cuda_device_keys", lambda count: [key])
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom replayrl.policy import start_lock\n"
            "with start_lock.hold([sys.argv[1]], what='an engine start'):\n"
            "    print('held', flush=True); time.sleep(1.5)\n",
            key,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        waited = {}

        def load(sharing: str) -> None:
            start = time.monotonic()
            with devices.trainer_load_lock({SHARING_ENV: sharing}):
                waited[sharing] = time.monotonic() - start

        own = threading.Thread(target=load, args=("0,1",))  # a GPU of its own: no wait
        own.start()
        own.join(timeout=5)
        load("1,1")  # beside an engine that is starting: waits for it
        assert holder.wait(timeout=30) == 0
    finally:
        holder.kill()
    assert waited["0,1"] < 0.5, waited
    assert waited["1,1"] > 0.8, waited
