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

Which store a lineage logs to, and the `Tracker` built on it, are `replayrl.engine.stores`'s
(`tracking_uri`, `lineage_store`, `follow_moved_root`, `make_tracker`): this module knows a
store only by the URI it is given.

A store that is busy (a sqlite file another process holds locked past sqlite's busy timeout,
MLflow's 20 s) is retried, every call of `Tracker.client`, for up to $REPLAYRL_TRACKING_RETRY_S
seconds (`DEFAULT_RETRY_S`), then `TrackingUnavailable`: one line naming the store and the fix.
Tracking only mirrors what state.json commits, so nothing committed is lost, and a rerun logs
every committed step once.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from replayrl import logs
from replayrl.engine import metric_schema
from replayrl.errors import ReplayRLError

log = logging.getLogger(__name__)
MARKER_METRIC = "iteration"
# MLflow 3's UI opens an experiment on the page of its kind; without this tag it may infer
# "GenAI" and open on traces, which replayrl never logs. This kind opens on the runs and their
# charts (the values are the UI's `ExperimentKind`: genai_development, custom_model_development).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# What a lineage generated its rollouts on (`Tracker.record_accelerator`): the model, e.g.
# "NVIDIA H100 80GB HBM3" or "cpu: AMD EPYC 7B13", and how many devices the process saw.
# Generation seconds are not comparable across models: `replayrl compare` refuses to mix them.
# A lineage that generated on more than one model lists them, sorted, joined by " + ".
ACCELERATOR_TAG = "system.accelerator"
ACCELERATOR_COUNT_TAG = "system.accelerator_count"
ACCELERATOR_SEPARATOR = " + "


# A URI as stored (without credentials) -> the one this process connected with, so a later
# client of the same store (`experiment_of_run` for the printed links, a tracker built from
# state.json) logs in too. Held in memory only.
_CONNECT_URIS: dict[str, str] = {}


def connect_uri(uri: str) -> str:
    """The URI to connect to store `uri` (as stored) with: with the credentials this process
    was given for it, if any."""
    return _CONNECT_URIS.get(uri, uri)


def _client(uri: str) -> _RetryingClient:
    from mlflow.tracking import MlflowClient

    shown = logs.without_credentials(uri)
    uri = connect_uri(uri)

    # Quiet the per-call logging of the sqlite store's migrations.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # Not mlflow.set_tracking_uri: it also sets MLFLOW_TRACKING_URI in os.environ, which
    # would send the next lineage opened in this process to this store.
    return _RetryingClient(MlflowClient(tracking_uri=uri), shown)


class TrackingUnavailable(ReplayRLError):
    """The tracking store stayed busy through every retry (`_retrying`)."""


# How long a busy store is retried unless $REPLAYRL_TRACKING_RETRY_S says otherwise: a few of
# sqlite's 20-s busy waits, so a backup or an `mlflow ui` holding the file for a minute costs
# a wait, not the run.
DEFAULT_RETRY_S = 120.0
RETRY_ENV = "REPLAYRL_TRACKING_RETRY_S"
_BUSY = ("database is locked", "database table is locked", "database is busy")
T = TypeVar("T")


def retry_s() -> float:
    raw = os.environ.get(RETRY_ENV, "").strip()
    if not raw:
        return DEFAULT_RETRY_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ReplayRLError(
            f"{RETRY_ENV}={raw!r} is not a number of seconds >= 0: set it to how long a busy "
            f"MLflow store is retried (default {DEFAULT_RETRY_S:g}), or unset it."
        )
    return value


def _busy(e: BaseException) -> str | None:
    """Why `e` (or an exception it was raised from) says the store is busy, or None. MLflow's
    sqlite store raises MlflowException(TEMPORARILY_UNAVAILABLE) from sqlalchemy's
    OperationalError from sqlite3's "database is locked"; some paths raise the latter two."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        text = str(x)
        for reason in _BUSY:
            if reason in text:
                return reason
        x = x.__cause__ or x.__context__
    return None


def _retrying(call: Callable[[], T], uri: str, what: str) -> T:
    """`call()`, again after a pause (1 s, doubling up to 15 s) while it fails because the store
    is busy, until `retry_s()` seconds have gone; then `TrackingUnavailable`. Safe to repeat:
    a sqlite call that hit the lock rolled back, and MLflow keeps one copy of a metric logged
    twice with the same key, step, time and value."""
    budget = retry_s()
    start = time.monotonic()
    delay, tries = 1.0, 0
    while True:
        tries += 1
        try:
            return call()
        except Exception as e:
            reason = _busy(e)
            if reason is None:
                raise
            waited = time.monotonic() - start
            if waited + delay > budget:
                raise TrackingUnavailable(
                    logs.redact(
                        f"The MLflow tracking store '{uri}' stayed busy ({reason}) through "
                        f"{tries} {'try' if tries == 1 else 'tries'} of {what} in {waited:.0f} s "
                        f"(retried for up to {RETRY_ENV}={budget:g} s): another process holds "
                        "it (an `mlflow ui` or server, a backup, another run on the same sqlite "
                        "file). Nothing committed is lost: once the store is free, rerun the "
                        "same command (a resumed lineage logs every committed step once)."
                    )
                ) from e
            log.warning(
                "The MLflow tracking store %s is busy (%s) after %.0f s: retrying %s in %.0f s "
                "(up to %s=%g s).",
                logs.redact(uri),
                reason,
                waited,
                what,
                delay,
                RETRY_ENV,
                budget,
            )
            time.sleep(delay)
            delay = min(delay * 2, 15.0)


class _RetryingClient:
    """An MlflowClient whose every public method is `_retrying`: what `Tracker.client` is, so
    the callers of `Tracker.client` (replayrl.engine.models, the engines) get the retries too."""

    def __init__(self, client, uri: str):
        self._client = client
        self._uri = uri

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if name.startswith("_") or not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args, **kwargs):
            return _retrying(lambda: attr(*args, **kwargs), self._uri, name)

        return call


class _QuietStoreErrors(logging.Filter):
    """MLflow's sqlite store logs every OperationalError with its traceback (on stderr) before
    it raises it as MlflowException: the caller gets the exception, retried or reported on one
    line (`_retrying`), so the log record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SQLAlchemy database error")


logging.getLogger("mlflow.store.db.utils").addFilter(_QuietStoreErrors())


class Tracker:
    def __init__(self, uri: str, experiment: str, *, artifact_location: str | None = None):
        """`artifact_location` is used only when the experiment is created; a sqlite store
        would otherwise put artifacts in ./mlruns of whatever folder the process runs in."""
        logs.register(urlsplit(uri).password)
        self.uri = logs.without_credentials(uri)  # the one to store and show
        self._accelerators: dict[str, tuple[str, int]] = {}  # `record_accelerator`'s
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

    def has_run(self, run_id: str) -> bool:
        """Whether the store holds run `run_id` (deleted or not): False when it says the run
        does not exist (the store was deleted, replaced or garbage-collected)."""
        return _has_run(self.client, run_id)

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

    def record_accelerator(self, run_id: str | None, model: str, count: int) -> None:
        """Tag run `run_id` with the accelerator `model` its rollouts were generated on (see
        `ACCELERATOR_TAG`), and `count`; a model the run does not list yet is added to it,
        with a warning (a retried pod that landed on another GPU model). Asks the store once
        per run and model in this process."""
        if not run_id or not model or self._accelerators.get(run_id) == (model, count):
            return
        from mlflow.entities import RunTag

        tags = self.client.get_run(run_id).data.tags
        listed = [m for m in tags.get(ACCELERATOR_TAG, "").split(ACCELERATOR_SEPARATOR) if m]
        models = sorted({*listed, model})
        if listed and model not in listed:
            log.warning(
                "Lineage run %s generated on %s before and on %s now: its generation seconds "
                "mix accelerator models (tag %s).",
                run_id,
                ACCELERATOR_SEPARATOR.join(listed),
                model,
                ACCELERATOR_TAG,
            )
        counts = max(count, int(tags.get(ACCELERATOR_COUNT_TAG) or 0))
        self.client.log_batch(
            run_id,
            tags=[
                RunTag(ACCELERATOR_TAG, ACCELERATOR_SEPARATOR.join(models)),
                RunTag(ACCELERATOR_COUNT_TAG, str(counts)),
            ],
        )
        self._accelerators[run_id] = (model, count)

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


def this_accelerator() -> tuple[str, int]:
    """(model, count) of what this process computes on: the first CUDA device's name and the
    number of devices it sees, or "cpu: " and the CPU's model name (/proc/cpuinfo, else
    `platform`) and 0. Asks torch only whether CUDA is usable and the device's name: a
    process that generates on a GPU has its CUDA context already (its device timer)."""
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0), torch.cuda.device_count()
    name = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                name = value.strip()
                break
    return f"cpu: {name or platform.processor() or platform.machine() or 'unknown'}", 0


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


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every logged value of metric `key` of run `run_id`, by step."""
    history = _client(uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value) for m in history)


def experiment_of_run(uri: str, run_id: str) -> str:
    return _client(uri).get_run(run_id).info.experiment_id


def _has_run(client: _RetryingClient, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    return True
