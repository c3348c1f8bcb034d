"""What a lineage starts from: its problem splits, checkpoint v0 (the user's model or the
warm-started tiny model), its Hugging Face hub inputs, and the handle on its buffer.

`open_lineage` (`replayrl.engine.lineage`) publishes these once; every step reads them back from
the run root. Given the task's `TaskResources`, each is built once per task and kept there.

The problems are pinned: `inputs/task.json` records a digest of the training and held-out
problems (`problems.splits_digest`) when the lineage opens, and every later load of the task
(any engine, any pod) compares against it, so a task file rewritten under a lineage is
refused with one line instead of mixing old and new problems in the buffer and changing the
held-out set mid-curve. `accept_task_inputs` (`replayrl run --accept-changed-task-data`)
records a change the user wants, with the iteration it took effect at.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import RunConfig, default_cache_dir, hub_id
from replayrl.engine.resources import TaskResources
from replayrl.errors import ReplayRLError
from replayrl.policy import hub
from replayrl.policy.models import initial_policy_dir
from replayrl.policy.problems import TaskSplits, load_task, splits_digest
from replayrl.storage import LineagePaths


def task_splits(cfg: RunConfig, resources: TaskResources | None = None) -> TaskSplits:
    """The task's training and evaluation prompts. A Hugging Face dataset id is read from
    the lineage's copy (`publish_hub_inputs`), or downloaded while the lineage opens."""
    if resources is not None and resources.splits is not None:
        return resources.splits
    splits = _load_splits(cfg)
    check_task_inputs(cfg, splits)
    if resources is not None:
        resources.splits = splits
    return splits


def _load_splits(cfg: RunConfig) -> TaskSplits:
    t = cfg.task
    path = t.path
    if hub_id(path) is not None:
        copy = storage.lineage_paths(cfg.storage.run_root, cfg.lineage).dataset
        path = copy if storage.exists(copy) else str(hub_dataset(cfg).local)
    return load_task(
        name=t.name,
        num_train=t.num_train,
        num_eval=t.num_eval,
        seed=cfg.seed,
        path=path,
        options=t.options,
        open_file=storage.open_input,
    )


ACCEPT_FLAG = "--accept-changed-task-data"


def _task_record_uri(cfg: RunConfig) -> str:
    return storage.join(storage.paths_of(cfg).inputs, "task.json")


def _task_record(cfg: RunConfig, splits: TaskSplits) -> dict[str, Any]:
    return {"path": cfg.task.path, "name": cfg.task.name, **splits_digest(splits)}


def _read_task_record(cfg: RunConfig) -> dict[str, Any] | None:
    """The lineage's record of its problems; None for a lineage that has none yet (not
    opened yet, or opened before problems were pinned: `pin_task_inputs` records them)."""
    uri = _task_record_uri(cfg)
    paths = storage.paths_of(cfg)
    # A record without a state (the lineage's folder left behind, its state.json deleted to
    # start over) pins nothing: the lineage being created records its own.
    if not storage.exists(uri) or not storage.exists(paths.state):
        return None
    try:
        record = json.loads(storage.read_bytes(uri))
        _ = record["train_sha256"], record["eval_sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise ReplayRLError(
            f"The record of lineage '{cfg.lineage}''s problems '{uri}' is unreadable ({e}). "
            f"Rerun with {ACCEPT_FLAG} to record the task data as it is now."
        ) from None
    return record


def check_task_inputs(cfg: RunConfig, splits: TaskSplits) -> None:
    """Refuse problems that differ from those the lineage recorded when it opened."""
    record = _read_task_record(cfg)
    if record is None:
        return
    now = splits_digest(splits)
    changed = [
        name
        for key, name in (("eval_sha256", "held-out"), ("train_sha256", "training"))
        if record.get(key) != now[key]
    ]
    if not changed and record.get("reward_kind") == now["reward_kind"]:
        return
    what = f"task.path '{cfg.task.path}'" if cfg.task.path else f"task '{cfg.task.name}'"
    raise ReplayRLError(
        f"The task data of lineage '{cfg.lineage}' changed since the lineage recorded it: "
        f"{what} now gives other {' and '.join(changed) or 'scored'} problems. Resuming would "
        f"mix old and new problems in the buffer and change the held-out set mid-curve. "
        f"Restore the file, start a new --lineage, or rerun with {ACCEPT_FLAG} to go on "
        f"with the new data (recorded in the lineage's inputs/task.json)."
    )


def pin_task_inputs(cfg: RunConfig, resources: TaskResources | None = None) -> None:
    """Record the lineage's problems when it has no record yet (it was just created, or
    opened before problems were pinned). Called by `open_lineage`, holding the lease, after
    `task_splits` compared the problems with a record already there."""
    if _read_task_record(cfg) is not None:
        return
    splits = task_splits(cfg, resources)
    record = {**_task_record(cfg, splits), "history": []}
    storage.write_bytes_atomic(_task_record_uri(cfg), json.dumps(record, indent=1).encode())


def accept_task_inputs(cfg: RunConfig) -> bool:
    """Record the task data as it is now as the lineage's problems, keeping what it replaces
    (with the iteration it took effect at) in the record's `history`. True when it changed
    something; nothing for a lineage without a record."""
    record = _read_task_record(cfg)
    if record is None:
        return False
    now = _task_record(cfg, _load_splits(cfg))
    if all(record.get(k) == v for k, v in now.items() if k != "path"):
        return False
    state = storage.read_state(storage.paths_of(cfg))
    replaced = {k: v for k, v in record.items() if k != "history"}
    replaced["replaced_at_iteration"] = None if state is None else state.next_iteration
    replaced["replaced_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    new = {**now, "history": [*record.get("history", []), replaced]}
    storage.write_bytes_atomic(_task_record_uri(cfg), json.dumps(new, indent=1).encode())
    return True


def replay_buffer(paths: LineagePaths, resources: TaskResources | None = None) -> ReplayBuffer:
    """The lineage's buffer; the resources keep one open (its snapshots are refreshed
    incrementally, which is much cheaper than reopening the Delta log every step)."""
    if resources is not None:
        return resources.buffer
    return ReplayBuffer(paths.buffer, storage_options=storage.delta_storage_options(paths.buffer))


def initial_policy(cfg: RunConfig, resources: TaskResources | None = None) -> Path:
    """A local directory with v0: the user's model or the (cached) warm-started tiny model."""
    return initial_policy_dir(cfg, task_splits(cfg, resources))


def hub_dataset(cfg: RunConfig) -> hub.Download | None:
    """The task's hub dataset split as one local Parquet file (downloaded once per process),
    or None when task.path is not a hub id."""
    t = cfg.task
    repo = hub_id(t.path)
    if repo is None:
        return None
    cache = str(default_cache_dir(cfg))
    return hub.download_dataset(repo, t.dataset_config, t.dataset_split, t.revision, cache)


def publish_hub_inputs(cfg: RunConfig, paths: LineagePaths) -> dict[str, str]:
    """Copy a hub dataset into the lineage (never replacing a copy an earlier attempt made,
    which this process may already have read) and record the commits the hub names resolved
    to in `inputs/hub.json`. Returns the MLflow params that record them ({} without hub
    names)."""
    repo = hub_id(cfg.model.source)
    model = hub.download_model(repo, cfg.model.revision) if repo is not None else None
    recorded = hub.record(model, None)
    if hub_id(cfg.task.path) is not None:
        earlier = (
            json.loads(storage.read_bytes(paths.hub_record))
            if storage.exists(paths.hub_record)
            else {}
        )
        if storage.exists(paths.dataset) and "dataset" in earlier:
            recorded["dataset"] = earlier["dataset"]
        else:
            dataset = hub_dataset(cfg)
            storage.write_bytes_atomic(paths.dataset, dataset.local.read_bytes())
            recorded |= hub.record(None, dataset)
    if recorded:
        storage.write_bytes_atomic(paths.hub_record, hub.dump(recorded))
    return hub.params(recorded)


def publish_initial_policy(cfg: RunConfig, paths: LineagePaths, local: Path) -> None:
    """Checkpoint v0 of the lineage, copied from `local` without any optimizer or RNG state
    (a `model.source` that is another lineage's full checkpoint): v0 starts a fresh optimizer."""
    if not storage.is_complete(paths.checkpoint(0)):
        storage.write_checkpoint(local, paths.checkpoint(0), skip=storage.is_training_state)
