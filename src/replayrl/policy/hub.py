"""Models and datasets named by their Hugging Face hub id.

`model.source: Qwen/Qwen3-0.6B` (with an optional `model.revision`) and `task.path:
open-r1/OpenR1-Math-220k` (with `task.dataset_config`, `task.dataset_split` and an optional
`task.revision`) name repositories on the hub. A lineage downloads each once, when it is
opened:

- the model's config, tokenizer and safetensors weights (nothing else) become the lineage's
  checkpoint v0, so every later step reads it from the run root like any checkpoint;
- the dataset's split, all its data files in one Parquet file, is copied to
  `<lineage>/inputs/dataset.parquet`, which every later step reads instead of the hub.

The commit each name resolved to is recorded in `<lineage>/inputs/hub.json` and in the
lineage's MLflow params (`hub.model_revision`, `hub.dataset_revision`), so a branch that moves
later never changes a lineage. Downloads go through huggingface_hub and its cache (`HF_HOME`,
`HF_HUB_CACHE`); `HF_TOKEN` authorises gated and private repositories (pods read it from the
`kubernetes.hf_secret` Secret). With `HF_HUB_OFFLINE=1` only the local hub cache is read:
the tests build one and run that way, so no test downloads anything.

A name is a hub id when it is `hf://owner/name`, or `owner/name` with no such local path
(and not a data file's name such as `data/train.parquet`).
"""

from __future__ import annotations

import fnmatch
import functools
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from replayrl.config import DATA_SUFFIXES
from replayrl.errors import ReplayRLError

log = logging.getLogger(__name__)

# What a model checkpoint needs and nothing more (no .bin/.pt/.onnx/.gguf duplicates).
MODEL_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


@dataclass(frozen=True)
class Download:
    repo_id: str
    requested: str | None  # the revision asked for (None = the default branch)
    revision: str  # the commit it resolved to
    local: Path  # the model's directory, or the split as one Parquet file


def _explain(kind: str, repo_id: str, revision: str | None, error: Exception) -> ReplayRLError:
    from huggingface_hub import errors as hf_errors

    at = f" at revision {revision!r}" if revision else ""
    if isinstance(error, hf_errors.LocalEntryNotFoundError) or _offline():
        cache = _hub_cache()
        return ReplayRLError(
            f"{kind} {repo_id!r}{at} is not in the local Hugging Face cache ({cache}) and "
            "downloads are off (HF_HUB_OFFLINE) or the hub is unreachable: download it there "
            "first (`hf download`), or run where the hub is reachable."
        )
    if isinstance(error, hf_errors.GatedRepoError):
        return ReplayRLError(
            f"{kind} {repo_id!r} is gated: accept its terms on huggingface.co and set HF_TOKEN "
            "(in pods: the kubernetes.hf_secret Secret)."
        )
    if isinstance(error, hf_errors.RevisionNotFoundError):
        return ReplayRLError(f"{kind} {repo_id!r} has no revision {revision!r}.")
    if isinstance(error, hf_errors.RepositoryNotFoundError):
        return ReplayRLError(
            f"{kind} {repo_id!r} is not on the Hugging Face hub (or is private and HF_TOKEN is "
            "not set), and there is no local path of that name. Check the name."
        )
    return ReplayRLError(f"cannot download {kind} {repo_id!r}{at}: {error}")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _snapshot(kind: str, repo_id: str, revision: str | None, **kwargs) -> Path:
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, **kwargs))
    except (hf_errors.HfHubHTTPError, hf_errors.LocalEntryNotFoundError, OSError) as e:
        raise _explain(kind, repo_id, revision, e) from e


@functools.lru_cache(maxsize=8)
def download_model(repo_id: str, revision: str | None = None) -> Download:
    """The model's snapshot in the hub cache (downloaded when missing): config, tokenizer
    and safetensors weights only."""
    log.info("model %s: from the Hugging Face hub (revision %s)", repo_id, revision or "main")
    local = _snapshot("model", repo_id, revision, allow_patterns=MODEL_PATTERNS)
    if not (local / "config.json").exists() or not any(local.glob("*.safetensors")):
        raise ReplayRLError(
            f"model {repo_id!r} has no config.json and safetensors weights on the hub; "
            "replayrl loads checkpoints in the Hugging Face safetensors layout only."
        )
    return Download(repo_id=repo_id, requested=revision, revision=local.name, local=local)


def split_patterns(card: str, config: str | None, split: str) -> list[str]:
    """The data-file patterns of (`config`, `split`) from a dataset card's `configs:`
    metadata (the layout the hub's viewer and `datasets` read); without it, the usual
    `data/<split>-*` file names. Raises naming the configs or splits there are."""
    meta: dict = {}
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", card, re.S)
    if match:
        meta = yaml.safe_load(match.group(1)) or {}
    configs = meta.get("configs") or []
    if not configs:
        prefix = f"{config}/" if config else ""
        return [f"{prefix}{split}-*", f"{prefix}{split}/*", f"data/{split}-*", f"data/{split}/*"]
    names = [c.get("config_name", "default") for c in configs]
    if config is None:
        chosen = next((c for c in configs if c.get("default")), None)
        chosen = chosen or next((c for c in configs if c.get("config_name") == "default"), None)
        if chosen is None and len(configs) == 1:
            chosen = configs[0]
        if chosen is None:
            raise ReplayRLError(
                f"the dataset has configs {names} and none is the default: set task.dataset_config."
            )
    else:
        chosen = next((c for c in configs if c.get("config_name") == config), None)
        if chosen is None:
            raise ReplayRLError(f"the dataset has no config {config!r}; its configs: {names}.")
    files = chosen.get("data_files") or []
    if isinstance(files, str | dict):
        files = [files]
    by_split: dict[str, list[str]] = {}
    for entry in files:
        if isinstance(entry, str):
            entry = {"split": "train", "path": entry}
        paths = entry.get("path") or []
        by_split.setdefault(entry.get("split", "train"), []).extend(
            [paths] if isinstance(paths, str) else list(paths)
        )
    if split not in by_split:
        raise ReplayRLError(
            f"config {chosen.get('config_name', 'default')!r} of the dataset has no split "
            f"{split!r}; its splits: {sorted(by_split)}."
        )
    return by_split[split]


@functools.lru_cache(maxsize=8)
def download_dataset(
    repo_id: str, config: str | None, split: str, revision: str | None, cache_dir: str
) -> Download:
    """The split's data files (Parquet or JSONL) downloaded and written as one Parquet file
    under `cache_dir`; its card is read first, so only that split is downloaded."""
    import pyarrow as pa
    import pyarrow.json as pa_json
    import pyarrow.parquet as pq

    what = f"{repo_id} ({config or 'default config'}, split {split})"
    log.info("dataset %s: from the Hugging Face hub (revision %s)", what, revision or "main")
    card_dir = _snapshot(
        "dataset", repo_id, revision, repo_type="dataset", allow_patterns=["README.md"]
    )
    sha = card_dir.name
    card = card_dir / "README.md"
    patterns = split_patterns(card.read_text() if card.exists() else "", config, split)
    snapshot = _snapshot("dataset", repo_id, sha, repo_type="dataset", allow_patterns=patterns)
    files = sorted(
        f
        for f in snapshot.rglob("*")
        if f.is_file()
        and f.name.endswith(DATA_SUFFIXES)
        and any(fnmatch.fnmatch(f.relative_to(snapshot).as_posix(), p) for p in patterns)
    )
    if not files:
        raise ReplayRLError(
            f"dataset {what} at {sha[:12]}: no Parquet or JSONL files match {patterns}."
        )
    tables = [
        pq.read_table(f) if f.name.endswith(".parquet") else pa_json.read_json(f) for f in files
    ]
    out = (
        Path(cache_dir) / "hub-datasets" / repo_id / sha / f"{config or 'default'}-{split}.parquet"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(pa.concat_tables(tables, promote_options="default"), tmp)
    tmp.replace(out)
    log.info("dataset %s: %d file(s), %d rows", what, len(files), sum(t.num_rows for t in tables))
    return Download(repo_id=repo_id, requested=revision, revision=sha, local=out)


def record(model: Download | None, dataset: Download | None) -> dict:
    """What a lineage records of its hub inputs: `inputs/hub.json` and the MLflow params."""
    out = {}
    for key, d in (("model", model), ("dataset", dataset)):
        if d is not None:
            out[key] = {"repo_id": d.repo_id, "requested": d.requested, "revision": d.revision}
    return out


def params(recorded: dict) -> dict[str, str]:
    return {f"hub.{key}_revision": value["revision"] for key, value in recorded.items()}


def dump(recorded: dict) -> bytes:
    return json.dumps(recorded, indent=2, sort_keys=True).encode()
