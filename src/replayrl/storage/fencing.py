"""Fencing: a lineage's writes are conditioned on the epoch of the lease that allowed them.

The lease (`replayrl.storage.lease`) hands every holder a fencing epoch, one more than any
epoch the lineage has seen. Taking the lease also *fences* `state.json`: its `epoch` field is
raised to the holder's epoch by a compare-and-swap. From then on an owner whose lease was
taken over while it was stopped (SIGSTOP, a paused VM, a network cut, a zombie pod of a
retried Kubeflow task) finds a higher epoch in `state.json` and every durable write it
attempts is refused with `StaleOwnerError` — see docs/fencing.md for what is fenced how.

This module keeps, per process, the fence of each lineage it holds (`install`), so the
storage and buffer code that writes under a lineage root finds the epoch to condition on
(`for_uri`) without every caller passing it along. A child process that writes for its
parent's lease (the asynchronous trainer) is given the epoch and installs it itself.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

from replayrl.errors import StaleOwnerError
from replayrl.storage import objects


@dataclass(frozen=True)
class Fence:
    """The right to write under lineage `root` with fencing `epoch`."""

    root: str
    epoch: int

    @property
    def state_uri(self) -> str:
        return objects.join(self.root, "state.json")

    def current_epoch(self) -> int:
        """The epoch `state.json` was last fenced with (0: none yet, or no state)."""
        if not objects.exists(self.state_uri):
            return 0
        return epoch_of(objects.read_bytes(self.state_uri))

    def check(self, what: str = "write") -> None:
        """Raise StaleOwnerError when a newer owner has fenced the lineage."""
        admit(self.current_epoch(), epoch=self.epoch, root=self.root, what=what)


def epoch_of(blob: bytes | None) -> int:
    """The `epoch` field of a JSON object's bytes; 0 when absent or unreadable."""
    if blob is None:
        return 0
    try:
        value = json.loads(blob).get("epoch", 0)
    except (ValueError, AttributeError, UnicodeDecodeError):
        return 0
    return int(value) if isinstance(value, int) else 0


def admit(found: int, *, epoch: int, root: str, what: str) -> None:
    """Refuse (StaleOwnerError) a write with `epoch` where epoch `found` is already in place."""
    if found > epoch:
        raise StaleOwnerError(
            f"A newer owner (fencing epoch {found}) took over the lineage at {root} while this "
            f"run (epoch {epoch}) was stopped or cut off; this run stops without trying to "
            f"{what}. Nothing it wrote since is visible to the newer owner."
        )


_FENCES: dict[str, Fence] = {}
_LOCK = threading.Lock()


def install(fence: Fence) -> None:
    """Record that this process writes under `fence.root` with `fence.epoch`."""
    with _LOCK:
        _FENCES[fence.root.rstrip("/")] = fence


def remove(root: str, *, epoch: int | None = None) -> None:
    """Forget the fence of `root` (only if it still has `epoch`, when given)."""
    with _LOCK:
        current = _FENCES.get(root.rstrip("/"))
        if current is not None and (epoch is None or current.epoch == epoch):
            del _FENCES[root.rstrip("/")]


def for_uri(uri: str) -> Fence | None:
    """The fence of the lineage `uri` lies under, if this process holds one."""
    with _LOCK:
        best = None
        for root, fence in _FENCES.items():
            if (uri == root or uri.startswith(root + "/")) and (
                best is None or len(root) > len(best.root)
            ):
                best = fence
        return best


def epoch_for(uri: str) -> int:
    """The epoch this process writes under `uri` with; 0 when it holds no fence there."""
    fence = for_uri(uri)
    return 0 if fence is None else fence.epoch


def check(uri: str, what: str = "write") -> None:
    """Raise StaleOwnerError when this process holds a fence over `uri` that a newer owner
    has superseded; nothing when it holds none."""
    fence = for_uri(uri)
    if fence is not None:
        fence.check(what)
