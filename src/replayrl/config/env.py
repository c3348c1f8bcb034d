"""What the environment supplies: the cache directory, the temp root, the command line's log
file, the MLflow tracking URI and the Kubeflow Pipelines connection. The only part of
replayrl.config that reads os.environ."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replayrl.config.run import RunConfig


def default_cache_dir(cfg: RunConfig) -> Path:
    """Where the warm-started tiny model is cached: model.cache_dir, else $REPLAYRL_CACHE,
    else ~/.cache/replayrl."""
    if cfg.model.cache_dir:
        return Path(cfg.model.cache_dir).expanduser()
    env = os.environ.get("REPLAYRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "replayrl"


def temp_root() -> Path:
    """Where checkpoint and download temp folders are made (created on first use): `tmp/`
    under $REPLAYRL_CACHE when it is set, else the system's temp dir. On a Kubeflow
    accelerator pod $REPLAYRL_CACHE is on the scratch volume (/scratch/replayrl), so a
    checkpoint staged before its upload (a full 7B one is ~90 GB with its optimizer) lands
    there, bounded by kubernetes.scratch_size, not on the node's root disk under /tmp."""
    env = os.environ.get("REPLAYRL_CACHE")
    if not env:
        return Path(tempfile.gettempdir())
    root = Path(env).expanduser() / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    return root


def cli_log_file() -> Path:
    """Where the command line keeps its log, tracebacks included: $REPLAYRL_LOG_FILE, else
    logs/replayrl.log under $REPLAYRL_CACHE, else under ~/.cache/replayrl."""
    env = os.environ.get("REPLAYRL_LOG_FILE")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("REPLAYRL_CACHE")
    base = Path(cache).expanduser() if cache else Path.home() / ".cache" / "replayrl"
    return base / "logs" / "replayrl.log"


def tracking_uri_from_env() -> str | None:
    """$MLFLOW_TRACKING_URI, or None where it is unset or empty."""
    return os.environ.get("MLFLOW_TRACKING_URI") or None


def kfp_connection_from_env() -> dict[str, str | None]:
    """Kubeflow Pipelines connection settings from the environment, for `replayrl submit`
    and `schedule` when no flag is given: KF_PIPELINES_ENDPOINT (the variable kfp.Client
    itself reads), KF_PIPELINES_TOKEN, KF_PIPELINES_NAMESPACE, KF_PIPELINES_COOKIES."""
    env = os.environ
    return {
        "host": env.get("KF_PIPELINES_ENDPOINT") or None,
        "token": env.get("KF_PIPELINES_TOKEN") or None,
        "namespace": env.get("KF_PIPELINES_NAMESPACE") or None,
        "cookies": env.get("KF_PIPELINES_COOKIES") or None,
    }
