"""What a lineage starts from: its problem splits, checkpoint v0 (the user's model or the
warm-started tiny model), its Hugging Face hub inputs, and the handle on its buffer.

`open_lineage` (`replayrl.engine.lineage`) publishes these once; every step reads them back from
the run root. Given the task's `TaskResources`, each is built once per task and kept there.
"""

from __future__ import annotations

import json
from pathlib import Path

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import RunConfig, default_cache_dir, hub_id
from replayrl.engine.resources import TaskResources
from replayrl.policy import hub
from replayrl.policy.models import initial_policy_dir
from replayrl.policy.problems import TaskSplits, load_task
from replayrl.storage import LineagePaths


def task_splits(cfg: RunConfig, resources: TaskResources | None = None) -> TaskSplits:
    """The task's training and evaluation prompts. A Hugging Face dataset id is read from
    the lineage's copy (`publish_hub_inputs`), or downloaded while the lineage opens."""
    if resources is not None and resources.splits is not None:
        return resources.splits
    t = cfg.task
    path = t.path
    if hub_id(path) is not None:
        copy = storage.lineage_paths(cfg.storage.run_root, cfg.lineage).dataset
        path = copy if storage.exists(copy) else str(hub_dataset(cfg).local)
    splits = load_task(
        name=t.name,
        num_train=t.num_train,
        num_eval=t.num_eval,
        seed=cfg.seed,
        path=path,
        options=t.options,
        open_file=storage.open_input,
    )
    if resources is not None:
        resources.splits = splits
    return splits


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
