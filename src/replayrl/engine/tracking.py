"""MLflow: one run per lineage, `step` = gradient step (`replayrl.engine.metric_schema`), resumed
by run id.

A lineage's run is identified by its run root, lineage name and config hash (tags set when
it is created), so lineages of the same name in different run roots, on one shared tracking
server, never share a run (`Tracker.find_run`).

Metrics of an iteration are logged once: a resumed lineage asks which steps a run already
has and skips them, so a crash between logging and advancing the state does not log an
iteration twice. Knows nothing about models or buffers: it logs the dicts it is given.

A tracking URI may carry credentials (`http://user:password@host:5000`): the client connects
with them, but `Tracker.uri` (what callers store in state.json and print) is the URI without
them, the password is registered with `replayrl.logs` so no log line shows it, and the
errors raised here are redacted.

`tracking_uri` is a lineage's store (the config's, $MLFLOW_TRACKING_URI, or a sqlite file in a
local run root) and `make_tracker` its `Tracker`, a new sqlite store built whole or not at all.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from replayrl import logs, storage
from replayrl.config import RunConfig, tracking_uri_from_env
from replayrl.engine import metric_schema
from replayrl.errors import ReplayRLError

log = logging.getLogger(__name__)
MARKER_METRIC = "iteration"
# MLflow 3's UI opens an experiment on the page of its kind; without this tag it may infer
# "GenAI" and open on traces, which replayrl never logs. This kind opens on the runs and their
# charts (the values are the UI's `ExperimentKind`: genai_development, custom_model_development).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


# A URI as stored (without credentials) -> the one this process connected with, so a later
# client of the same store (`experiment_of_run` for the printed links, a tracker built from
# state.json) logs in too. Held in memory only.
_CONNECT_URIS: dict[str, str] = {}


def connect_uri(uri: str) -> str:
    """The URI to connect to store `uri` (as stored) with: with the credentials this process
    was given for it, if any."""
    return _CONNECT_URIS.get(uri, uri)


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    uri = connect_uri(uri)

    # Quiet the per-call logging of the sqlite store's migrations.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # Not mlflow.set_tracking_uri: it also sets MLFLOW_TRACKING_URI in os.environ, which
    # would send the next lineage opened in this process to this store.
    return MlflowClient(tracking_uri=uri)


class Tracker:
    def __init__(self, uri: str, experiment: str, *, artifact_location: str | None = None):
        """`artifact_location` is used only when the experiment is created; a sqlite store
        would otherwise put artifacts in ./mlruns of whatever folder the process runs in."""
        logs.register(urlsplit(uri).password)
        self.uri = logs.without_credentials(uri)  # the one to store and show
        if self.uri != uri:
            _CONNECT_URIS[self.uri] = uri
        try:
            self.client = _client(uri)
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                self.experiment_id = self.client.create_experiment(
                    experiment,
                    artifact_location=artifact_location,
                    tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
                )
            else:
                self.experiment_id = exp.experiment_id
                if EXPERIMENT_KIND_TAG not in exp.tags:  # made before the tag, or by hand
                    self.client.set_experiment_tag(
                        self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND
                    )
        except ReplayRLError:
            raise
        except Exception as e:  # MLflow raises many types for an unreachable/broken store
            raise ReplayRLError(
                logs.redact(
                    f"Cannot reach the MLflow tracking store '{self.uri}': "
                    f"{e.__class__.__name__}: {e}. Check tracking.uri / MLFLOW_TRACKING_URI."
                )
            ) from None

    def find_run(self, *, run_root: str, lineage: str, config_hash: str) -> str | None:
        """The run of lineage `lineage` of run root `run_root` created with config
        `config_hash`, or None. Searched only while a new lineage has no state.json yet (a
        resumed lineage reads its run id from its state). When several match (an opener
        that lost the race of `start` and died before dropping its run), the oldest:
        earliest start time, then smallest run id, so every caller picks the same one.

        A lineage is named only within its run root, and a tracking server is shared by
        many run roots: `runs/a/alpha` and `runs/b/alpha` are different lineages with
        different runs, however alike their configs. Every run this project creates carries
        the three tags (`start` sets them, and did from the first release), so a lineage's
        run is always found by all three. Matching is exact: MLflow's filter has no escape for quotes, so the server narrows by
        whichever tags it can quote and the rest is compared here."""
        want = {"run_root": run_root, "lineage": lineage, "config_hash": config_hash}
        clauses = [c for c in (_tag_clause(k, v) for k, v in want.items()) if c]
        matches = []
        token = None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=" AND ".join(clauses),
                max_results=500,
                page_token=token,
            )
            matches += [r for r in page if all(r.data.tags.get(k) == v for k, v in want.items())]
            token = page.token
            if not token:
                break
        if not matches:
            return None
        return min(matches, key=lambda r: (r.info.start_time or 0, r.info.run_id)).info.run_id

    def start(
        self,
        *,
        run_root: str,
        lineage: str,
        config_hash: str,
        tags: dict[str, str],
        params: dict[str, object],
    ) -> str:
        """The run of a new lineage (identified as in `find_run`): the one found, left by an
        opening that died before the lineage's state recorded its run id, else a new one
        with the identity tags and `params`.

        MLflow has no conditional create, so this is not put-if-absent by itself, and it
        need not be: a new lineage is opened under its lease (one holder per run root and
        lineage, so two openers do not search and create at once), and the lineage's run is
        the one its state.json records, written put-if-absent (a compare-and-swap, locally
        and on S3). An opener that loses that write drops the run it got here unless it is
        the recorded one (`drop_run`, called by `lineage.open_lineage`), and a resumed
        lineage reads its run id from its state instead of searching. So each lineage ends
        with one live run, and a run of another run root, lineage or config is never
        found, let alone shared."""
        from mlflow.entities import Param, RunTag

        identity = {"run_root": run_root, "lineage": lineage, "config_hash": config_hash}
        run_id = self.find_run(**identity)
        if run_id is not None:
            self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            return run_id
        run = self.client.create_run(
            self.experiment_id, run_name=lineage, tags={**tags, **identity}
        )
        run_id = run.info.run_id
        items = [Param(k, _param_value(v)) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])
        return run_id

    def drop_run(self, run_id: str) -> None:
        """Delete a run a losing opener got from `start` (it is no lineage's run), so a
        search or the MLflow UI shows one run per lineage. Best effort: a run already
        deleted, or a store that fails now, leaves a run that `find_run` never returns
        again once the lineage's state exists."""
        try:
            self.client.delete_run(run_id)
        except Exception as e:  # MLflow raises many types
            log.warning("Could not delete MLflow run %s: %s", run_id, e)

    def logged_steps(self, run_id: str) -> set[int]:
        return {m.step for m in self.client.get_metric_history(run_id, MARKER_METRIC)}

    def log_metrics(self, run_id: str, metrics: dict[str, float], *, step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in sorted(metrics.items()) if _finite(k, v)]
        for i in range(0, len(items), 500):
            self.client.log_batch(run_id, metrics=items[i : i + 500])

    def log_groups(self, run_id: str, groups: list, *, timestamp_ms: int, engine: str) -> None:
        """Log [[step, {name: value}], ...] in one MLflow batch (one store transaction).
        Every name must be declared for `engine` in `replayrl.engine.metric_schema`; values
        that are not finite are left out (NaN means "no value"; see `_finite`)."""
        from mlflow.entities import Metric

        names = {name for _, values in groups for name in values}
        if unknown := metric_schema.undeclared(names, engine):
            raise ValueError(
                f"metrics not declared for the {engine} engine in replayrl.engine.metric_schema: "
                f"{unknown}"
            )
        items = [
            Metric(name, float(value), timestamp_ms, int(step))
            for step, values in groups
            for name, value in sorted(values.items())
            if _finite(name, value, engine)
        ]
        self.client.log_batch(run_id, metrics=items)

    def set_terminated(self, run_id: str, status: str = "FINISHED") -> None:
        # MLflow prints "View run ... at: <tracking URI>/#/..." on stdout here, credentials
        # and all: print it redacted.
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            self.client.set_terminated(run_id, status=status)
        sys.stdout.write(logs.redact(printed.getvalue()))

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    @contextlib.contextmanager
    def system_metrics(
        self, run_id: str, *, enabled: bool, interval_s: float, node_id: str | None = None
    ) -> Iterator[None]:
        """MLflow's system metrics (CPU, memory, disk, network; GPU where NVML is present) of
        this process's machine, logged to run `run_id` every `interval_s` seconds while the
        block runs, named `system/<metric>` (`system/<node_id>/<metric>`: one series per
        role or pod). Their step is the sample's index, continued when a run is resumed.

        A background thread samples and logs; it is stopped (and its last batch flushed)
        when the block ends, however it ends. Nothing here fails the run: a monitor that
        cannot start or log is a warning. MLflow's monitor stops by itself once the run is
        not RUNNING, so a resumed run that a previous task terminated is set RUNNING again
        (the task terminates it when the lineage ends)."""
        monitor = None
        if enabled:
            try:
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                if self.client.get_run(run_id).info.status != "RUNNING":
                    self.client.update_run(run_id, status="RUNNING")
                monitor = SystemMetricsMonitor(
                    run_id,
                    sampling_interval=interval_s,
                    resume_logging=True,
                    node_id=node_id,
                    tracking_uri=connect_uri(self.uri),
                )
                monitor.start()
            except Exception as e:  # never fail a run for its system metrics
                log.warning("System metrics are not logged: %s", logs.redact(str(e)))
                monitor = None
        try:
            yield
        finally:
            if monitor is not None:
                try:
                    monitor.finish()
                except Exception as e:
                    log.warning("Stopping the system metrics failed: %s", logs.redact(str(e)))


def _tag_clause(key: str, value: str) -> str | None:
    """`tags.key = 'value'` for MLflow's search filter, or None when the value holds both
    quote characters (the filter has no escape; the caller then compares it itself)."""
    for q in ("'", '"'):
        if q not in value:
            return f"tags.{key} = {q}{value}{q}"
    return None


# Summaries over the uses a record's gradient steps drew: NaN ("no value") when it drew none
# (metric_schema.replay_metrics, the asynchronous uses per row).
_EMPTY_SET_NAN_PREFIX = "replay/"
_warned_not_finite: set[str] = set()


def _finite(name: str, v: float, engine: str | None = None) -> bool:
    """Whether the value `v` of metric `name` is logged: finite values are. NaN means "no
    value" (replayrl.engine.metric_schema), quietly left out where the schema declares a
    metric without one for some data (a `when`, or the replay/* summaries of an empty set of
    uses); any other value that is not finite (NaN elsewhere, ±inf) is left out with a
    warning naming the metric, once per name and process, so it never vanishes silently. A
    value that is not a number at all is a bug, and raises."""
    value = float(v)
    if math.isfinite(value):
        return True
    if math.isnan(value):
        declared = metric_schema.find(name, engine)
        if name.startswith(_EMPTY_SET_NAN_PREFIX) or (
            declared is not None and declared.when is not None
        ):
            return False
    if name not in _warned_not_finite:
        _warned_not_finite.add(name)
        log.warning("Metric %s is %r, not a finite number: it is not logged.", name, v)
    return False


# How a None param is logged (MLflow params are strings).
NULL_PARAM = "null"


def _param_value(v: object) -> str:
    s = NULL_PARAM if v is None else str(v)
    return s[:6000]


# Where `mlflow ui` / `mlflow server` listen unless told otherwise.
LOCAL_UI = "http://127.0.0.1:5000"


def ui_link(uri: str, experiment_id: str, run_id: str | None = None) -> str:
    """Where to open an experiment (or one run) in MLflow's UI. The experiment link carries
    `workflowType=machine_learning`: MLflow 3's UI otherwise opens a new experiment on its
    GenAI traces overview, which is empty for replayrl. A sqlite or file store is served by
    `mlflow ui`, on 127.0.0.1:5000 by default; an http(s) server is linked as it is."""
    base = LOCAL_UI
    if uri.startswith(("http://", "https://")):
        # Credentials are never printed: the link is for a browser, which logs in itself.
        base = logs.without_credentials(uri).rstrip("/")
    if run_id:
        return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"{base}/#/experiments/{experiment_id}?workflowType=machine_learning"


def experiment_of_run(uri: str, run_id: str) -> str:
    return _client(uri).get_run(run_id).info.experiment_id


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


def make_tracker(cfg: RunConfig, uri: str) -> Tracker:
    """The lineage's tracker. With a local store (sqlite), a new experiment keeps its
    artifacts beside the run root; a tracking server uses its own artifact root. `uri` as
    stored (without credentials) connects with the credentials of the configured URI when
    that names the same store."""
    configured = cfg.tracking.uri or tracking_uri_from_env()
    if configured and logs.without_credentials(configured) == logs.without_credentials(uri):
        uri = configured
    root = storage.normalize_root(cfg.storage.run_root)
    local_store = uri.startswith(("sqlite:", "file:")) or "://" not in uri
    artifacts = f"file://{root}/mlartifacts" if local_store and not storage.is_s3(root) else None
    _create_sqlite_store_atomically(uri, cfg.tracking.experiment, artifacts)
    return Tracker(uri, cfg.tracking.experiment, artifact_location=artifacts)


def _create_sqlite_store_atomically(uri: str, experiment: str, artifacts: str | None) -> None:
    """MLflow builds a new sqlite store with dozens of schema migrations, and a process
    killed half-way leaves a store no later run can open ("duplicate column name"). Build a
    new one under a temporary name and link it into place only when it is whole."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri[len("sqlite:///") :])
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.time_ns()}")
    try:
        Tracker(f"sqlite:///{tmp}", experiment, artifact_location=artifacts)
        os.link(tmp, path)  # fails if another process linked its store first: keep that one
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
