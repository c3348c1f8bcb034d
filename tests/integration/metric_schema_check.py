"""Checks that a lineage's MLflow run logged exactly what `replayrl.engine.metric_schema`
declares for its engine: nothing undeclared, and every metric declared as always logged."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from replayrl.engine import metric_schema


def assert_logs_the_declared_metrics(tracking_uri: str, run_id: str, engine: str) -> set[str]:
    logged = set(MlflowClient(tracking_uri).get_run(run_id).data.metrics)
    assert metric_schema.undeclared(logged, engine) == []
    always = [m for m in metric_schema.declared(engine) if m.when is None]
    missing = [m.name for m in always if not any(m.pattern().match(name) for name in logged)]
    assert missing == [], f"declared as always logged by the {engine} engine, but not logged"
    return logged
