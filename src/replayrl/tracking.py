"""MLflow: one run per lineage, `step` = iteration, resumed by run id.

Metrics of an iteration are logged once: a resumed lineage asks which steps a run already
has and skips them, so a crash between logging and advancing the state does not log an
iteration twice. Knows nothing about models or buffers: it logs the dicts it is given.
"""

from __future__ import annotations

import logging
import math
import time

from replayrl.errors import ReplayRLError

log = logging.getLogger(__name__)
MARKER_METRIC = "iteration"


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    # Quiet the per-call logging of the sqlite store's migrations.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # Not mlflow.set_tracking_uri: it also sets MLFLOW_TRACKING_URI in os.environ, which
    # would send the next lineage opened in this process to this store.
    return MlflowClient(tracking_uri=uri)


class Tracker:
    def __init__(self, uri: str, experiment: str, *, artifact_location: str | None = None):
        """`artifact_location` is used only when the experiment is created; a sqlite store
        would otherwise put artifacts in ./mlruns of whatever folder the process runs in."""
        self.uri = uri
        try:
            self.client = _client(uri)
            exp = self.client.get_experiment_by_name(experiment)
            self.experiment_id = (
                exp.experiment_id
                if exp
                else self.client.create_experiment(experiment, artifact_location=artifact_location)
            )
        except ReplayRLError:
            raise
        except Exception as e:  # MLflow raises many types for an unreachable/broken store
            raise ReplayRLError(
                f"Cannot reach the MLflow tracking store '{_redact(uri)}': {e.__class__.__name__}: {e}. "
                f"Check tracking.uri / MLFLOW_TRACKING_URI."
            ) from None

    def find_run(self, lineage: str) -> str | None:
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.lineage = '{lineage}'", max_results=1
        )
        return runs[0].info.run_id if runs else None

    def start(self, *, lineage: str, tags: dict[str, str], params: dict[str, object]) -> str:
        from mlflow.entities import Param, RunTag

        run_id = self.find_run(lineage)
        if run_id is None:
            run = self.client.create_run(
                self.experiment_id, run_name=lineage, tags={"lineage": lineage, **tags}
            )
            run_id = run.info.run_id
            items = [Param(k, _param_value(v)) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):
                self.client.log_batch(run_id, params=items[i : i + 100])
        else:
            self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        return run_id

    def logged_steps(self, run_id: str) -> set[int]:
        return {m.step for m in self.client.get_metric_history(run_id, MARKER_METRIC)}

    def log_metrics(self, run_id: str, metrics: dict[str, float], *, step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in sorted(metrics.items()) if _finite(v)]
        for i in range(0, len(items), 500):
            self.client.log_batch(run_id, metrics=items[i : i + 500])

    def set_terminated(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)


def _finite(v: float) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _param_value(v: object) -> str:
    s = "null" if v is None else str(v)
    return s[:6000]


def _redact(uri: str) -> str:
    """Drop user:password from a URI before it goes into a message."""
    if "@" in uri and "://" in uri:
        scheme, rest = uri.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return uri
