"""Where a lineage's MLflow store is, and the `Tracker` (`replayrl.engine.tracking`) built on it.

`tracking_uri` is a new lineage's store (the config's, $MLFLOW_TRACKING_URI, or a sqlite file in
a local run root), `lineage_store` a resumed one's (the store its state.json records, found
again in the run root given when that root was moved or copied, never recreated outside it),
`follow_moved_root` makes a moved sqlite store's paths follow its run root, and `make_tracker`
builds the lineage's `Tracker`, a new sqlite store built whole or not at all.

Knows nothing about what is logged: the client, its retries of a busy store, runs and metrics
are `replayrl.engine.tracking`'s (of a run it asks only whether a store holds it). Nor does it
read state.json: `replayrl.engine.lineage` gives it what the state records.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path

from replayrl import logs, storage
from replayrl.config import RunConfig, tracking_uri_from_env
from replayrl.engine.tracking import Tracker, _client, _has_run, _retrying
from replayrl.errors import ReplayRLError

log = logging.getLogger(__name__)


def tracking_uri(cfg: RunConfig) -> str:
    uri = cfg.tracking.uri or tracking_uri_from_env()
    if uri:
        return uri
    root = storage.normalize_root(cfg.storage.run_root)
    if storage.is_s3(root):
        raise ReplayRLError(
            "The run root is on S3, where a sqlite tracking store cannot live: set tracking.uri "
            "(or MLFLOW_TRACKING_URI) to your MLflow server, e.g. http://mlflow:5000."
        )
    return f"sqlite:///{root}/mlflow.db"


def _sqlite_file(uri: str) -> Path | None:
    """The file of a `sqlite:///path` URI (its query, `?timeout=...`, left out), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    return Path(path) if path else None


def lineage_store(
    cfg: RunConfig, recorded: str | None, run_id: str | None
) -> tuple[str, str | None]:
    """The store of a lineage resumed from its state.json, which records the store's URI
    (`recorded`) and the lineage's run in it (`run_id`), and the run root it was moved from
    (None: not moved). Then `follow_moved_root` makes the store's paths follow it.

    - Nothing recorded (a state from before the URI was kept): `tracking_uri(cfg)`.
    - The store configured now (tracking.uri, $MLFLOW_TRACKING_URI) is the one recorded: it.
    - A sqlite store other than the default one of the run root given (`<run root>/mlflow.db`,
      resolved from the root given now, never from state.json's absolute path), when that
      default store exists and holds the run: the default one. The run root was moved or
      copied (`mv A B`, `cp -r A B`) with its store, and B's lineage logs to B's copy: never
      to A's (with a copy, two lineages would write one run), and nothing is created at A.
    - A recorded sqlite store whose file is gone: the configured store, else the default one
      of the run root given; a store is never recreated outside the run root by itself (the
      run is then not found, and `lineage._resume` gives the lineage a new one).
    - Otherwise (a tracking server, a sqlite store that still exists) the recorded one."""
    configured = cfg.tracking.uri or tracking_uri_from_env()
    if not recorded:
        return tracking_uri(cfg), None
    if configured and logs.without_credentials(configured) == logs.without_credentials(recorded):
        return recorded, None
    old = _sqlite_file(recorded)
    root = storage.normalize_root(cfg.storage.run_root)
    if old is None or storage.is_s3(root):
        return recorded, None
    default = f"sqlite:///{root}/mlflow.db"
    if recorded == default:
        return recorded, None
    if Path(root, "mlflow.db").exists() and run_id and _holds_run(default, run_id):
        moved = old.is_absolute() and old.name == "mlflow.db" and str(old.parent) != root
        return default, str(old.parent) if moved else None
    if old.exists():
        return recorded, None
    return configured or default, None


def _holds_run(uri: str, run_id: str) -> bool:
    """Whether the store `uri` (which exists) holds run `run_id`; False for a file that is no
    MLflow store it can read."""
    try:
        return _has_run(_client(uri), run_id)
    except ReplayRLError:
        raise
    except Exception as e:  # MLflow raises many types for a file that is not its store
        log.debug("%s is not read as an MLflow store: %s", uri, e)
        return False


# Where a run root's paths sit in its sqlite store: artifact locations, and the tags that
# name a place under the run root (`Tracker.start`'s run_root, replayrl.engine.models'
# checkpoint), as (table, key column or None, value column).
_LOCATION_COLUMNS = (
    ("experiments", None, "artifact_location"),
    ("runs", None, "artifact_uri"),
    ("logged_models", None, "artifact_location"),
    ("model_versions", None, "source"),
    ("model_versions", None, "storage_location"),
    ("tags", "key", "value"),
    ("logged_model_tags", "tag_key", "tag_value"),
    ("model_version_tags", "key", "value"),
)
_LOCATION_TAGS = ("run_root", "checkpoint")


def follow_moved_root(uri: str, old_root: str, new_root: str) -> int:
    """Rewrite the paths under `old_root` that the sqlite store `uri` holds to the same paths
    under `new_root`, the root the store was moved (or copied) to with it: artifact locations
    (`file://<root>/mlartifacts...`, where a local lineage's experiment keeps them), and the
    `run_root` and `checkpoint` tags of runs, logged models and model versions. So MLflow
    writes the artifacts of a moved root's lineages into it (not into a recreated old root),
    and the UI, `replayrl register` and `load_registered` find them there. One transaction;
    idempotent (a second call finds nothing under `old_root`). Returns the values rewritten."""
    path = _sqlite_file(uri)
    if path is None:
        return 0
    prefixes = [(f"file://{old_root}", f"file://{new_root}"), (old_root, new_root)]

    def rewrite() -> int:
        con = sqlite3.connect(path, timeout=20, isolation_level=None)
        try:
            con.execute("BEGIN IMMEDIATE")
            n = 0
            for table, key, column in _LOCATION_COLUMNS:
                columns = {row[1] for row in con.execute(f"PRAGMA table_info({table})")}
                if column not in columns or (key is not None and key not in columns):
                    continue  # another MLflow schema: nothing of ours there
                only = f" AND {key} IN ({', '.join('?' * len(_LOCATION_TAGS))})" if key else ""
                for old, new in prefixes:
                    n += con.execute(
                        f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                        f"WHERE substr({column}, 1, ?) = ? "
                        f"AND (length({column}) = ? OR substr({column}, ?, 1) = '/'){only}",
                        (new, len(old) + 1, len(old), old, len(old), len(old) + 1)
                        + (_LOCATION_TAGS if key else ()),
                    ).rowcount
            con.execute("COMMIT")
            return n
        except BaseException:
            if con.in_transaction:
                con.execute("ROLLBACK")
            raise
        finally:
            con.close()

    try:
        n = _retrying(rewrite, uri, "rewriting the moved run root's paths")
    except sqlite3.Error as e:
        raise ReplayRLError(
            f"Cannot update the MLflow store {uri} for its run root's move from {old_root} to "
            f"{new_root}: {e}. Check that the file is writable, or set tracking.uri to the "
            "store that holds the lineage's run."
        ) from None
    if n:
        log.warning(
            "The run root moved from %s to %s with its MLflow store %s: %d of the store's paths "
            "under the old root now name the new one.",
            old_root,
            new_root,
            uri,
            n,
        )
    return n


def make_tracker(cfg: RunConfig, uri: str) -> Tracker:
    """The lineage's tracker. With a local store (sqlite), a new experiment keeps its
    artifacts beside the run root (beside the store's file when the run root is on S3); a
    tracking server uses its own artifact root. `uri` as
    stored (without credentials) connects with the credentials of the configured URI when
    that names the same store."""
    configured = cfg.tracking.uri or tracking_uri_from_env()
    if configured and logs.without_credentials(configured) == logs.without_credentials(uri):
        uri = configured
    root = storage.normalize_root(cfg.storage.run_root)
    local_store = uri.startswith(("sqlite:", "file:")) or "://" not in uri
    artifacts = None
    if local_store and not storage.is_s3(root):
        artifacts = f"file://{root}/mlartifacts"
    elif local_store and (db := _sqlite_file(uri)) is not None:
        # A sqlite store beside an S3 run root: its artifacts beside the store's file, not
        # MLflow's default for sqlite, ./mlruns in whatever folder the process started in.
        artifacts = f"file://{db.expanduser().resolve().parent}/mlartifacts"
    _create_sqlite_store_atomically(uri, cfg.tracking.experiment, artifacts)
    return Tracker(uri, cfg.tracking.experiment, artifact_location=artifacts)


def _create_sqlite_store_atomically(uri: str, experiment: str, artifacts: str | None) -> None:
    """MLflow builds a new sqlite store with dozens of schema migrations, and a process
    killed half-way leaves a store no later run can open ("duplicate column name"). Build a
    new one under a temporary name and link it into place only when it is whole."""
    path = _sqlite_file(uri)
    if path is None or path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.time_ns()}")
    query = uri.split("?", 1)[1] if "?" in uri else ""
    try:
        Tracker(
            f"sqlite:///{tmp}" + (f"?{query}" if query else ""),
            experiment,
            artifact_location=artifacts,
        )
        os.link(tmp, path)  # fails if another process linked its store first: keep that one
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
