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
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
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


# A lineage's name is a folder of the run root, a part of S3 keys, MLflow tag values and
# logged-model names, and a word in shell commands the messages suggest: ASCII letters,
# digits, '.', '-' and '_', first a letter, digit or '_' (no '.', '..', '-x'), at most
# MAX_LINEAGE_CHARS (a file name's 255 bytes with room for MLflow's 250-character names).
_LINEAGE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
MAX_LINEAGE_CHARS = 128


def check_lineage_name(lineage: str) -> str:
    """`lineage` when it is a valid lineage name (see `_LINEAGE_NAME`), else ReplayRLError
    saying what is allowed and a name that is."""
    if len(lineage) <= MAX_LINEAGE_CHARS and _LINEAGE_NAME.fullmatch(lineage):
        return lineage
    shown = repr(lineage) if len(lineage) <= 40 else f"{lineage[:40]!r}... ({len(lineage)} chars)"
    fixed = re.sub(r"[^A-Za-z0-9._-]+", "_", lineage).strip("._-")[:40] or "lineage-1"
    raise ReplayRLError(
        f"Lineage name {shown} is not valid: use 1 to {MAX_LINEAGE_CHARS} ASCII letters, "
        f"digits, '.', '-' and '_', starting with a letter, digit or '_' (it names a folder, "
        f"S3 keys and MLflow runs), e.g. '{fixed}'."
    )


def lineage_paths(run_root: str, lineage: str) -> LineagePaths:
    check_lineage_name(lineage)
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
    """`state.json`'s bytes as a LineageState, every field's type and every record checked
    (`_state_problem`): a state edited by hand, or damaged, is refused with one line naming
    the field, before anything reads it."""
    fix = (
        "Put back the value a run wrote (from a backup, or another copy of the lineage), or "
        "start a new --lineage; nothing of the lineage was changed."
    )
    try:
        data = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReplayRLError(f"Lineage state '{paths.state}' is unreadable ({e}). {fix}") from None
    problem = _state_problem(data)
    if problem is not None:
        raise ReplayRLError(f"Lineage state '{paths.state}' is not valid: {problem}. {fix}")
    return LineageState(**data)


_STATE_FIELDS = {f.name: f for f in fields(LineageState)}
_REQUIRED = ("lineage", "arm", "seed", "config_hash")  # the fields without a default
# A field's check: None when the value is fine, else what it must be ("an integer >= 1").
_Check = Callable[[object], str | None]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _got(value: object) -> str:
    """`value` as state.json spells it (a string quoted), cut at 60 characters."""
    finite = not isinstance(value, float) or math.isfinite(value)
    text = json.dumps(value) if finite else str(value)
    return f"{text[:60]}..." if len(text) > 60 else text


def _count(minimum: int, *, null: bool = False) -> _Check:
    def check(value: object) -> str | None:
        if value is None and null:
            return None
        if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
            return None
        return f"an integer >= {minimum}" + (" or null" if null else "")

    return check


def _text(*, null: bool = False) -> _Check:
    def check(value: object) -> str | None:
        if isinstance(value, str) or (value is None and null):
            return None
        return "a string" + (" or null" if null else "")

    return check


def _ledger_problem(value: object, key: str) -> str | None:
    if not isinstance(value, dict):
        return f"{key} must be an object of numbers, got {_got(value)}"
    for name, number in value.items():
        if not _is_number(number):
            return f"{key}.{name} must be a number, got {_got(number)}"
    return None


_FIELD_CHECKS: dict[str, _Check] = {
    "lineage": _text(),
    "arm": _text(),
    "seed": _count(0),
    "config_hash": _text(),
    "next_iteration": _count(1),
    "policy_version": _count(0),
    "mlflow_run_id": _text(null=True),
    "tracking_uri": _text(null=True),
    "epoch": _count(0),
}
# The keys of the `checkpoint` record (`LineageState.checkpoint`) and what each must be.
_CHECKPOINT_KEYS: dict[str, _Check] = {
    "iteration": _count(0),
    "policy_version": _count(0),
    "rollouts_version": _count(0, null=True),
    "usage_version": _count(0, null=True),
}


def _state_problem(data: object) -> str | None:
    """What is wrong with `data` (state.json, parsed) as a LineageState, naming the field;
    None when nothing is."""
    if not isinstance(data, dict):
        return f"it must be a JSON object, got {_got(data)}"
    for name in data:
        if name not in _STATE_FIELDS:
            return f"unknown field '{name}' (written by a newer replayrl, or by hand)"
    for name in _REQUIRED:
        if name not in data:
            return f"the field '{name}' is missing"
    for name, check in _FIELD_CHECKS.items():
        if name in data and (must := check(data[name])) is not None:
            return f"{name} must be {must}, got {_got(data[name])}"
    if data.get("ledger") is not None and (problem := _ledger_problem(data["ledger"], "ledger")):
        return problem
    if data.get("checkpoint") is not None:
        problem = _checkpoint_problem(
            data["checkpoint"], next_iteration=data.get("next_iteration", 1)
        )
        if problem is not None:
            return problem
    if data.get("last_metrics") is not None:
        return _metrics_problem(data["last_metrics"])
    return None


def _checkpoint_problem(ck: object, *, next_iteration: int) -> str | None:
    if not isinstance(ck, dict):
        return f"checkpoint must be an object (the last full checkpoint) or null, got {_got(ck)}"
    for key, check in _CHECKPOINT_KEYS.items():
        if key not in ck:
            return f"the checkpoint record has no '{key}'"
        if (must := check(ck[key])) is not None:
            return f"checkpoint.{key} must be {must}, got {_got(ck[key])}"
    if "ledger" not in ck:
        return "the checkpoint record has no 'ledger'"
    if (problem := _ledger_problem(ck["ledger"], "checkpoint.ledger")) is not None:
        return problem
    if ck["iteration"] >= next_iteration:
        return (
            f"checkpoint.iteration ({ck['iteration']}) must be below next_iteration "
            f"({next_iteration}): a checkpoint is of a committed iteration"
        )
    return None


def _metrics_problem(pending: object) -> str | None:
    """`last_metrics`: {"iteration": t, "timestamp_ms": ms, "groups": [[step, {name: value}],
    ...]} (see `LineageState.last_metrics`)."""
    if not isinstance(pending, dict):
        return f"last_metrics must be an object or null, got {_got(pending)}"
    for key in ("iteration", "timestamp_ms"):
        if not _is_int(pending.get(key)) or pending[key] < 0:
            return f"last_metrics.{key} must be an integer >= 0, got {_got(pending.get(key))}"
    groups = pending.get("groups")
    if not isinstance(groups, list) or not groups:
        return f"last_metrics.groups must be a non-empty list, got {_got(groups)}"
    for i, group in enumerate(groups):
        if (
            not isinstance(group, list)
            or len(group) != 2
            or not _is_int(group[0])
            or not isinstance(group[1], dict)
        ):
            return f"last_metrics.groups[{i}] must be [step, {{name: value}}], got {_got(group)}"
        for name, value in group[1].items():
            if not _is_number(value):
                return (
                    f"last_metrics.groups[{i}] metric '{name}' must be a number, got {_got(value)}"
                )
    return None


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
        _parse_state(paths, blob)  # a state refused when read is refused before it is fenced
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
