"""One vLLM engine starts at a time on a GPU: a lock file per physical GPU, held with flock.

Why: vLLM sizes an engine's KV cache from how much the *device's* free memory changed while
the engine started, not from what the engine itself allocated. In vLLM 0.33
(`vllm/utils/mem_utils.py`, `memory_profiling`, lines 312-321) the engine's non-KV memory is
`total_consumed = free memory before the engine was created - free memory after its profile
run`, both read with `cudaMemGetInfo`, and `vllm/v1/worker/gpu_worker.py`
(`determine_available_memory`, lines 732 and 753) asserts that free memory did not grow
("Error in memory profiling ... other processes sharing the same container release GPU
memory"), then gives the KV cache `requested memory - non-KV memory`. So a neighbour that
allocates on the same GPU while an engine starts (another engine starting beside it) is
charged to that engine and shrinks its KV cache, and one that frees memory meanwhile trips
the assertion.
The asynchronous engine starts its workers and its evaluator at once, and with one GPU (or
fewer GPUs than roles) several of them build their engines on the same GPU.

`hold(keys)` serialises those starts: each key (a GPU's UUID, `cuda_device_keys`) is a file
`<directory>/<key>.lock` that a start holds with an exclusive `flock` for as long as it
builds the engine; the next start on that GPU waits for it, then measures a device on
which the first engine's memory is already allocated and stays put. The kernel releases an
flock when its holder's file closes, however the holder ends (an exception, a kill), so a
lock is never left stale; the file itself stays (empty but for the holder's note) and is
reused. The holder writes its pid and what it is doing into the file, for the message of a
start that gives up waiting (`timeout_s`, a ReplayRLError naming both).

Every process that shares a GPU must use the same `directory`: the default is one folder in
the system's temporary directory, which all processes of a machine (or of a Kubernetes pod)
share. Different pods on one node do not share it, but they are given different GPUs.

What the lock does not cover: memory that a process allocates on the GPU without taking the
lock (a trainer loading its model or training beside an engine that starts) still moves the
device's free memory under vLLM's measurement. A trainer that wants its load kept out of an
engine's start can hold the same keys while it loads. Knows nothing about vLLM itself; torch
is imported only to read the GPUs' UUIDs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from replayrl.errors import ReplayRLError

# Where the lock files live unless a caller says otherwise: shared by every process here.
DEFAULT_DIRECTORY = Path(tempfile.gettempdir()) / "replayrl-gpu-locks"
# How long a start waits for the one before it. A 7B engine with CUDA-graph capture starts
# in a few minutes; three roles queued on one GPU wait for two such starts.
DEFAULT_TIMEOUT_S = 1800.0
# How often a waiting start tries the lock again.
POLL_S = 0.1


def cuda_device_keys(count: int = 1) -> list[str]:
    """The UUIDs of this process's first `count` visible CUDA devices: the same physical GPU
    has the same key in every process, whatever `CUDA_VISIBLE_DEVICES` numbers it as. Reading
    them initialises CUDA in this process (a vLLM engine built in this process does so too)."""
    import torch

    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]


@contextlib.contextmanager
def hold(
    keys: Sequence[str],
    *,
    what: str = "a vLLM engine start",
    directory: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Iterator[None]:
    """Hold the lock of every device in `keys` for the body; wait for it up to `timeout_s`.

    keys: one per device the body allocates on (a GPU's UUID); duplicates count once. They
        are taken in sorted order, so two holders of overlapping sets cannot deadlock.
    what: what the holder does, written into the lock file for the message of a start that
        gives up waiting for it.
    directory: where the lock files are (created if missing); None = `DEFAULT_DIRECTORY`.
    timeout_s: the longest wait for all the locks together; past it, a ReplayRLError that
        names the device, the lock file and its holder, and nothing is held.
    """
    folder = DEFAULT_DIRECTORY if directory is None else Path(directory)
    files = {key: folder / f"{_file_name(key)}.lock" for key in sorted(set(keys))}
    folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with contextlib.ExitStack() as held:
        for key, path in files.items():
            held.enter_context(_one(path, key, what, deadline))
        yield


@contextlib.contextmanager
def _one(path: Path, key: str, what: str, deadline: float) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ReplayRLError(
                        f"Waited too long to start on GPU {key}: {_holder(path)} holds its start "
                        f"lock {path} still. Another vLLM engine is starting on the same GPU (or "
                        "hangs while it starts); let it finish, or stop that process, then rerun."
                    ) from None
                time.sleep(POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {what}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # before the unlock, so no waiter reads a stale note
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _holder(path: Path) -> str:
    """Who holds the lock at `path`, from the note its holder wrote."""
    try:
        note = path.read_text().strip()
    except OSError:
        note = ""
    return note or "a process that has not written its note yet"


def _file_name(key: str) -> str:
    """`key` as a file name: letters, digits, '.', '_' and '-' kept, anything else '_'."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", key)
    if not name.strip("."):
        raise ValueError(f"not a usable device key: {key!r}")
    return name
