"""The files through which the asynchronous engine's roles coordinate, under `<lineage>/async/`.

Generation workers, the trainer and the evaluator share nothing but the lineage's storage
(a local directory or S3): the Delta buffer, and these small files, each written atomically
by one role only:

    published/v{g:09d}/   the trainer's weights after gradient step g (weights only, no
                          optimizer state), COMPLETE marker last, and `publish.json`: when it
                          was published, on the lineage's cumulative clocks
    published/LATEST.json the version pointer: the newest published g (only ever increases)
    trainer.json          the trainer's status: gradient step, the buffer version it last
                          saw and how many of its rows no gradient step has used yet (the
                          workers' back-pressure), its busy and idle seconds
    workers/w{i}.json     worker i's status: its next batch, rows and tokens generated,
                          busy and idle seconds (cumulative over the lineage)
    weights.json          where the trainer's weight group meets (`weight_broadcast`): the
                          address of its store, the segment and the trainer's pid; rewritten
                          by each trainer start. Versions and fencing stay with LATEST.json:
                          a worker applies a broadcast version only once the pointer names
                          it, with the same publication time (the token sent with it)
    evaluator.json        the evaluator's busy and idle seconds
    eval/v{g:09d}.json    the evaluation of published version g
    segment.json          the running segment: its id, the gradient step it ends at, and
                          `done` once the trainer has published its last weights
    started/, abandoned.json  which roles of the segment started, and why it was given up
                          when one did not in time (`replayrl.engine.asynchronous.peers`)

Version g is the gradient step of the weights; v0 is the lineage's initial checkpoint. This
module knows nothing about models or the buffer's contents.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from replayrl import storage
from replayrl.errors import ReplayRLError
from replayrl.storage import LineagePaths, fencing


def root(paths: LineagePaths) -> str:
    return storage.join(paths.root, "async")


def published_dir(paths: LineagePaths) -> str:
    return storage.join(root(paths), "published")


def weights_uri(paths: LineagePaths, version: int) -> str:
    """Where published version `version` lies: v0 is the lineage's initial checkpoint."""
    if version == 0:
        return paths.checkpoint(0)
    return storage.join(published_dir(paths), f"v{version:09d}")


def eval_uri(paths: LineagePaths, version: int) -> str:
    return storage.join(root(paths), "eval", f"v{version:09d}.json")


def _read_json(uri: str) -> dict | None:
    """The record at `uri` (None when absent), without the fencing epoch it was written with.
    Every record is rewritten whole, and a read gets one whole version (`storage.read_bytes`)."""
    if not storage.exists(uri):
        return None
    try:
        data = json.loads(storage.read_bytes(uri))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReplayRLError(
            f"{uri} is unreadable ({e}); it is rewritten by the role that owns it: "
            "delete it and start the segment again."
        ) from None
    if isinstance(data, dict):
        data.pop(EPOCH_FIELD, None)
    return data


# Every record written under a fence carries the writer's fencing epoch in this field.
EPOCH_FIELD = "fencing_epoch"


def _write_json(uri: str, data: dict, *, check=None) -> None:
    """Write the record at `uri`. Under a fence (the roles of a run holding the lineage's
    lease) the write is conditioned on the epoch: refused (StaleOwnerError) when the lineage
    or this very record was written by a newer owner, and made by compare-and-swap, so a
    stopped role that comes back cannot overwrite what the run that took over wrote.
    `check(current record or None)` may refuse too (e.g. a pointer moving back)."""
    fence = fencing.for_uri(uri)
    if fence is None and check is None:
        storage.write_bytes_atomic(uri, json.dumps(data, indent=1, sort_keys=True).encode())
        return
    epoch = 0 if fence is None else fence.epoch
    body = json.dumps({**data, EPOCH_FIELD: epoch}, indent=1, sort_keys=True).encode()

    def update(blob: bytes | None) -> bytes:
        if fence is not None:
            found = 0
            if blob is not None:
                try:
                    found = int(json.loads(blob).get(EPOCH_FIELD, 0))
                except (ValueError, AttributeError, TypeError):
                    found = 0
            fencing.admit(found, epoch=epoch, root=fence.root, what=f"write {uri}")
            fence.check(f"write {uri}")
        if check is not None:
            current = None
            if blob is not None:
                try:
                    current = json.loads(blob)
                except ValueError:
                    current = None
            check(current)
        return body

    storage.compare_and_swap(uri, update, action="write")


# ---------------------------------------------------------------- published weights


@dataclass(frozen=True)
class Published:
    """One published version: the gradient step of its weights, and the lineage's
    cumulative wall seconds and generated tokens when it was published."""

    version: int
    published_at: float  # unix seconds
    cumulative_seconds: float
    cumulative_generated_tokens: int


def latest(paths: LineagePaths) -> Published | None:
    data = _read_json(storage.join(published_dir(paths), "LATEST.json"))
    return None if data is None else Published(**data)


def published_record(paths: LineagePaths, version: int) -> Published | None:
    data = _read_json(storage.join(weights_uri(paths, version), "publish.json"))
    return None if data is None else Published(**data)


def point_to(paths: LineagePaths, record: Published) -> None:
    """Make `record` the newest published version: its `publish.json`, then the pointer.
    Refuses to move the pointer back (versions only increase)."""

    def forward_only(current: dict | None) -> None:
        if current is not None and int(current.get("version", -1)) > record.version:
            raise ReplayRLError(
                f"published version {record.version} is older than the pointer's "
                f"{current['version']}: versions only increase"
            )

    forward_only(asdict(latest(paths)) if latest(paths) is not None else None)
    _write_json(storage.join(weights_uri(paths, record.version), "publish.json"), asdict(record))
    # The check runs again inside the swap: two writers cannot move the pointer back.
    _write_json(
        storage.join(published_dir(paths), "LATEST.json"), asdict(record), check=forward_only
    )


def published_versions(paths: LineagePaths) -> list[int]:
    out = []
    for name in storage.list_dir(published_dir(paths)):
        if name.startswith("v") and name[1:].isdigit():
            out.append(int(name[1:]))
    return sorted(out)


# ---------------------------------------------------------------- role status


@dataclass
class WorkerStatus:
    worker: int
    next_batch: int = 0
    rows_appended: int = 0
    generated_tokens: int = 0
    batches: int = 0
    busy_seconds: float = 0.0
    idle_seconds: float = 0.0
    # (buffer version, rows) of this worker's appends the trainer's count may not cover yet:
    # every worker reads every worker's for the one back-pressure count (`roles.unused_rows`).
    recent_appends: list = field(default_factory=list)
    pid: int | None = None
    policy_version: int | None = None
    # The published version this worker is loading now (written before it reads a byte),
    # so the trainer never prunes it under the worker (`versions_in_use`).
    loading: int | None = None
    # What this worker generates on (`tracking.this_accelerator`): the trainer tags the
    # lineage's run with it, as the synchronous engines' record does.
    accelerator: str = ""
    accelerators: int = 0
    # How this worker's versions arrived (`weights`): by broadcast or from the files, the
    # seconds applying them between batches (not busy), and its receiver's background
    # seconds receiving (beside generation).
    broadcast_loads: int = 0
    file_loads: int = 0
    apply_seconds: float = 0.0
    receive_seconds: float = 0.0


def worker_uri(paths: LineagePaths, worker: int) -> str:
    return storage.join(root(paths), "workers", f"w{worker}.json")


def read_worker(paths: LineagePaths, worker: int) -> WorkerStatus:
    data = _read_json(worker_uri(paths, worker))
    return WorkerStatus(worker=worker) if data is None else WorkerStatus(**data)


def write_worker(paths: LineagePaths, status: WorkerStatus) -> None:
    _write_json(worker_uri(paths, status.worker), asdict(status))


def read_workers(paths: LineagePaths, count: int) -> list[WorkerStatus]:
    return [read_worker(paths, w) for w in range(count)]


@dataclass(frozen=True)
class WeightGroup:
    """Where trainer rank 0's weight group meets: its store's address."""

    host: str
    port: int
    segment_id: str
    pid: int


def read_weight_group(paths: LineagePaths) -> WeightGroup | None:
    data = _read_json(storage.join(root(paths), "weights.json"))
    return None if data is None else WeightGroup(**data)


def write_weight_group(paths: LineagePaths, group: WeightGroup) -> None:
    _write_json(storage.join(root(paths), "weights.json"), asdict(group))


@dataclass
class TrainerStatus:
    gradient_step: int = 0
    buffer_version: int | None = None
    unused_rows: int = 0  # rows of `buffer_version` no gradient step has used
    row_uses: int = 0  # K_train: rows processed by gradient steps (B per step)
    busy_seconds: float = 0.0
    idle_seconds: float = 0.0
    pid: int | None = None
    updated_at: float = 0.0
    # Weight broadcasts (`weights`): seconds sending (not busy), sends, and sends that
    # timed out or failed (the group was re-formed).
    send_seconds: float = 0.0
    sends: int = 0
    send_failures: int = 0
    # Publishing but the send (usage commit, weights-only copy, full checkpoint, MLflow
    # logs): not busy either.
    publish_seconds: float = 0.0


def read_trainer(paths: LineagePaths) -> TrainerStatus:
    data = _read_json(storage.join(root(paths), "trainer.json"))
    return TrainerStatus() if data is None else TrainerStatus(**data)


def write_trainer(paths: LineagePaths, status: TrainerStatus) -> None:
    status.updated_at = time.time()
    _write_json(storage.join(root(paths), "trainer.json"), asdict(status))


@dataclass
class EvaluatorStatus:
    busy_seconds: float = 0.0
    idle_seconds: float = 0.0
    evaluated: int = 0
    pid: int | None = None
    loading: int | None = None  # the published version being evaluated now


def read_evaluator(paths: LineagePaths) -> EvaluatorStatus:
    data = _read_json(storage.join(root(paths), "evaluator.json"))
    return EvaluatorStatus() if data is None else EvaluatorStatus(**data)


def write_evaluator(paths: LineagePaths, status: EvaluatorStatus) -> None:
    _write_json(storage.join(root(paths), "evaluator.json"), asdict(status))


def versions_in_use(paths: LineagePaths, workers: int, *, besides: str | None = None) -> set[int]:
    """Published versions a role is loading or generating with now: never pruned. `besides`
    (a role name: `worker<i>`, `evaluator`) leaves that role's own statement out."""
    used = set()
    for status in read_workers(paths, workers):
        if besides != f"worker{status.worker}":
            used |= {v for v in (status.loading, status.policy_version) if v is not None}
    loading = read_evaluator(paths).loading if besides != "evaluator" else None
    if loading is not None:
        used.add(loading)
    return used


def read_eval(paths: LineagePaths, version: int) -> dict | None:
    return _read_json(eval_uri(paths, version))


def write_eval(paths: LineagePaths, version: int, result: dict) -> None:
    _write_json(eval_uri(paths, version), result)


# ---------------------------------------------------------------- the segment


@dataclass(frozen=True)
class Segment:
    """One run of the asynchronous roles: from `first_step` to `end_step` gradient steps
    (or `deadline`, unix seconds, whichever comes first). `done` once the trainer has
    published its last version, `final_step`."""

    id: str
    first_step: int
    end_step: int
    started_at: float  # unix seconds
    deadline: float | None = None
    cumulative_seconds_at_start: float = 0.0
    done: bool = False
    final_step: int | None = None


def read_segment(paths: LineagePaths) -> Segment | None:
    data = _read_json(storage.join(root(paths), "segment.json"))
    return None if data is None else Segment(**data)


def write_segment(paths: LineagePaths, segment: Segment) -> None:
    _write_json(storage.join(root(paths), "segment.json"), asdict(segment))


def segment_done(paths: LineagePaths, segment_id: str) -> bool:
    """True once segment `segment_id` is over (or another segment replaced it)."""
    current = read_segment(paths)
    return current is None or current.id != segment_id or current.done
