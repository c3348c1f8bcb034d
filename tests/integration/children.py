"""Fresh child processes for the fault trials, forked from a server that has already imported
the engine.

A trial runs a lineage in a child process and kills (SIGKILL) or stops (SIGSTOP) it at a
named point. A new interpreter per child spent about 7 s of CPU importing torch,
transformers and the engine before its first line of work, more than most trials' work; the
kill and stall trials start about 70 children. Here every child is forked from one
`multiprocessing` fork server per test process that imported them once (`PRELOAD`): the child
starts with those modules in memory, and everything else is its own, as in a new interpreter
— its own pid, files, lease, fencing state and process-wide settings, killed or stopped
without touching the test process.

    child = start(__file__, [json.dumps(spec)], tmp_path, env={"REPLAYRL_LEASE_TTL_S": "6"})
    child.wait_for_line("READY")
    code = child.wait(timeout=600)       # -9 when it was killed, like a Popen's returncode
    out, err = child.output()

The child runs `child_main(argv)` of the script (the test module, loaded by path), its stdout
and stderr going to files under `folder`; an exception out of it exits 1 with its traceback
in `err`, `sys.exit(n)` exits n.

A child's torch uses `THREADS` threads unless its env says otherwise. Float sums follow the
thread count (a policy's log-probs differ in the 8th digit between one and two threads), so
a run in the test process that a trial compares with its children runs with the same count:

    with children.same_threads():
        run_inline(ref)
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# The children's torch thread count: two sequences of children run side by side on 2 cores.
THREADS = 1

# What the server imports once: the engine and what a run touches at its start.
PRELOAD = ["replayrl.engine.inline", "replayrl.config", "deltalake", "pyarrow.dataset", "mlflow"]

_context = None
_numbers = itertools.count()  # the children's output files, unique across threads
_started: list[Child] = []


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _entry(script: str, argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """In the child: stdout and stderr to their files, `env` set, `THREADS` torch threads
    unless OMP_NUM_THREADS says otherwise (set before the server imported torch it would not
    count), then the script's `child_main(argv)`."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", THREADS)))
    spec = importlib.util.spec_from_file_location("trial_child", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.child_main(argv)


class Child:
    """One child; `pid`, `poll()`, `wait()` and `returncode` as a Popen's."""

    def __init__(self, process, out: Path, err: Path):
        self._process = process
        self.out_path, self.err_path = out, err

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float) -> int:
        """Its exit code once it exits (-N when signal N ended it); TimeoutExpired after
        `timeout` seconds, the child left running."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"trial child {self.pid}", timeout)
        return self._process.exitcode

    def output(self) -> tuple[str, str]:
        """What it printed so far: (stdout, stderr)."""
        return (
            self.out_path.read_text(errors="replace"),
            self.err_path.read_text(errors="replace"),
        )

    def wait_for_line(self, line: str, *, timeout: float = 600) -> None:
        """Until a line of its stdout is `line`; AssertionError, with its output, when it
        exits first or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while line not in self.output()[0].splitlines():
            if self.poll() is not None or time.monotonic() > deadline:
                out, err = self.output()
                raise AssertionError(f"no {line!r} from the child: {out[-1500:]} {err[-3000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, and reap it (a stopped child too)."""
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self._process.join(30)


def start(script: str, argv: list[str], folder: Path, *, env: dict[str, str] | None = None):
    """Fork a child that runs `child_main(argv)` of `script`; its output goes to files under
    `folder` (made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = next(_numbers)
    out, err = folder / f"child-{n}.out", folder / f"child-{n}.err"
    out.touch()
    err.touch()
    process = _server().Process(
        target=_entry, args=(script, argv, dict(env or {}), str(out), str(err)), daemon=False
    )
    process.start()
    child = Child(process, out, err)
    _started.append(child)
    return child


@contextlib.contextmanager
def same_threads():
    """The test process's torch runs with the children's thread count inside the block (the
    caller's count restored after): a reference run compared exactly with children's. Outside
    xdist the test process has as many threads as cores, and its metrics differed from the
    children's in the 8th digit."""
    from replayrl.policy.models import torch_threads

    with torch_threads(THREADS):
        yield


def kill_all() -> None:
    """Kill every child still alive (a failed trial's stopped ones): multiprocessing joins its
    children when the test process exits, which a stopped child would hold up for ever."""
    while _started:
        _started.pop().kill()
