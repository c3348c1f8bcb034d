"""Where a lineage lives and how far it got: its layout (`LineagePaths`) and `state.json`.

One lineage lives under `<run root>/<lineage>/`:

    state.json            next iteration, policy version, the last full checkpoint (with
                          the buffer table versions it pairs with), MLflow run id
    config.yaml           the resolved config the lineage was started with
    buffer/rollouts       the replay buffer (Delta table, see `replayrl.buffer.table`)
    buffer/usage          one row per use of a rollout (Delta table)
    checkpoints/v000003/  a checkpoint (`replayrl.storage.checkpoints`)

Concurrency: `advance_state` is a compare-and-swap (`objects.compare_and_swap`: under an
exclusive file lock locally, an S3 conditional write on S3), refused to an owner whose
fencing epoch is older than the one `state.json` was fenced with (`fence`); `objects.ensure_writable` (called when a lineage is opened)
refuses an S3 store that ignores conditional writes, where the swap would silently be
last-writer-wins. Every object operation goes through `replayrl.storage.objects` (module
attributes, looked up at each call, so a test that patches one there reaches these calls).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from replayrl.errors import ReplayRLError
from replayrl.storage import fencing, objects

if TYPE_CHECKING:
    from replayrl.config import RunConfig


@dataclass(frozen=True)
class LineagePaths:
    root: str  # <run root>/<lineage>

    @property
    def state(self) -> str:
        return objects.join(self.root, "state.json")

    @property
    def config(self) -> str:
        return objects.join(self.root, "config.yaml")

    @property
    def buffer(self) -> str:
        return objects.join(self.root, "buffer")

    @property
    def checkpoints(self) -> str:
        return objects.join(self.root, "checkpoints")

    def checkpoint(self, version: int) -> str:
        return objects.join(self.checkpoints, f"v{version:06d}")

    @property
    def eval_dir(self) -> str:
        return objects.join(self.root, "eval")

    @property
    def inputs(self) -> str:
        """Inputs downloaded once for the lineage (`replayrl.policy.hub`)."""
        return objects.join(self.root, "inputs")

    @property
    def dataset(self) -> str:
        return objects.join(self.inputs, "dataset.parquet")

    @property
    def hub_record(self) -> str:
        return objects.join(self.inputs, "hub.json")


def lineage_paths(run_root: str, lineage: str) -> LineagePaths:
    if not lineage or "/" in lineage or lineage.startswith("."):
        raise ReplayRLError(
            f"Lineage name '{lineage}' is not valid: use letters, digits, '-' and '_'."
        )
    return LineagePaths(objects.join(objects.normalize_root(run_root), lineage))


def paths_of(cfg: RunConfig) -> LineagePaths:
    """The layout of `cfg`'s lineage: `lineage_paths(storage.run_root, lineage)`."""
    return lineage_paths(cfg.storage.run_root, cfg.lineage)


@dataclass(frozen=True)
class LineageState:
    lineage: str
    arm: str
    seed: int
    config_hash: str
    next_iteration: int = 1  # iterations are 1-based; iteration t trains v_{t-1} -> v_t
    policy_version: int = 0  # newest complete checkpoint of the lineage
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    # Cumulative compute ledger, so a resumed lineage continues the totals.
    ledger: dict[str, float] | None = None
    # Metrics of the last committed iteration, written with the commit so they reach the
    # tracker exactly once even when the process dies right after the commit:
    # {"iteration": t, "timestamp_ms": ms, "groups": [[step, {name: value}], ...]}.
    last_metrics: dict[str, Any] | None = None
    # The last full checkpoint, which a crashed run rewinds to: {"iteration": c,
    # "policy_version": v, "rollouts_version": Delta version of buffer/rollouts after
    # iteration c (None: no table yet), "usage_version": same for buffer/usage, "ledger":
    # the cumulative ledger after iteration c}. None in states written before checkpoint
    # cadence existed: every committed iteration had its checkpoint then.
    checkpoint: dict[str, Any] | None = None
    # The fencing epoch of the newest lease holder (`replayrl.storage.fencing`): raised when
    # a holder takes the lease, and every advance is refused to an older epoch.
    epoch: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()


def _parse_state(paths: LineagePaths, blob: bytes) -> LineageState:
    try:
        return LineageState(**json.loads(blob))
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
        raise ReplayRLError(
            f"Lineage state '{paths.state}' is unreadable ({e}). Restore it or start a new --lineage."
        ) from None


def read_state(paths: LineagePaths) -> LineageState | None:
    if not objects.exists(paths.state):
        return None
    return _parse_state(paths, objects.read_bytes(paths.state))


def check_iteration_open(paths: LineagePaths, *, iteration: int) -> None:
    """Raise when the lineage already committed `iteration`: a run that lost the race for
    it must not overwrite rows or checkpoints the winner's commit points at."""
    # A run a newer owner fenced out hears so first (StaleOwnerError), whatever the iteration.
    fencing.check(paths.root, f"write iteration {iteration}")
    state = read_state(paths)
    if state is not None and state.next_iteration > iteration:
        raise ReplayRLError(
            f"Iteration {iteration} of the lineage at {paths.root} was already committed "
            f"(state.json says next iteration {state.next_iteration}): another run is advancing "
            f"this lineage. This run stops without writing; stop one of the two runs."
        )


def fence(paths: LineagePaths, epoch: int) -> None:
    """Raise `state.json`'s fencing epoch to `epoch` (a compare-and-swap), so that from now
    on an owner with an older epoch can no longer advance the lineage. StaleOwnerError when
    a newer epoch is already there; nothing when there is no state yet (the lineage's first
    state is written with the creator's epoch)."""

    def update(blob: bytes | None) -> bytes | None:
        if blob is None:
            return None
        found = fencing.epoch_of(blob)
        fencing.admit(found, epoch=epoch, root=paths.root, what="fence the lineage")
        if found == epoch:
            return None
        data = json.loads(blob)
        data["epoch"] = epoch
        return json.dumps(data, indent=2, sort_keys=True).encode()

    objects.compare_and_swap(paths.state, update, action="fence")


def advance_state(
    paths: LineagePaths, new: LineageState, *, expected_next_iteration: int | None
) -> None:
    """Replace state.json if it still says `expected_next_iteration` (None: must not exist)
    and no newer owner fenced it.

    A real compare-and-swap (`objects.compare_and_swap`): locally under an exclusive file
    lock, on S3 a conditional write (`If-Match` the ETag just read, or `If-None-Match: *` for
    a new lineage), so of two runs advancing the same iteration exactly one wins and the
    other gets a ReplayRLError. The new state carries the epoch this process holds for the
    lineage (`replayrl.storage.fencing`); a state fenced with a higher epoch refuses it with
    StaleOwnerError. On S3, a retry whose first attempt landed finds its own state there and
    succeeds.
    """
    fence = fencing.for_uri(paths.root)
    if fence is not None:
        # Always this process's own epoch, never one copied from a state read meanwhile.
        new = replace(new, epoch=fence.epoch)

    body = new.to_json()

    def update(blob: bytes | None) -> bytes:
        if blob == body and objects.is_s3(paths.state):
            return body  # this very state is there: an earlier attempt landed (its answer lost)
        current = None if blob is None else _parse_state(paths, blob)
        if current is not None:
            fencing.admit(current.epoch, epoch=new.epoch, root=paths.root, what="commit")
        _check_expected(paths, expected_next_iteration, current)
        return body

    objects.compare_and_swap(paths.state, update, action="advance")


def _check_expected(
    paths: LineagePaths, expected: int | None, current: LineageState | None
) -> None:
    found = None if current is None else current.next_iteration
    if found != expected:
        raise ReplayRLError(
            f"Lineage state '{paths.state}' changed underneath this run (expected next iteration "
            f"{expected}, found {found}): another run is advancing this lineage. Stop one of them."
        )
