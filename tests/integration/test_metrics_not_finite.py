"""A metric whose value is not finite is not logged (NaN means "no value"), but it never
vanishes silently: a NaN or ±inf the metric schema does not declare as possible is left out
with one warning naming it, once per name; the declared "no value" cases (an evaluation knob
that is off, the replay/* summaries of a record that drew no rows) stay quiet."""

from __future__ import annotations

import logging

import pytest
from mlflow.tracking import MlflowClient

from replayrl.engine import metric_schema, tracking
from replayrl.engine.tracking import Tracker

pytestmark = pytest.mark.integration


def test_undeclared_non_finite_metrics_are_warned_about_once_and_not_logged(
    tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(tracking, "_warned_not_finite", set())  # "once" is per process
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "not-finite", artifact_location=str(tmp_path / "artifacts"))
    run_id = tracker.start(
        run_root=str(tmp_path), lineage="nan", config_hash="0", tags={}, params={}
    )
    nan, inf = float("nan"), float("inf")
    record = {
        "iteration": 1.0,
        "train/loss": nan,  # always has a value: a NaN here is news
        "train/grad_norm": inf,
        "eval/pass1_sampled": nan,  # declared: only when eval.pass1_temperature is set
        "replay/sample_age_mean": nan,  # declared: no rows drawn, no ages
        "train/clip_fraction": 0.25,
    }
    with caplog.at_level(logging.WARNING, logger="replayrl.engine.tracking"):
        for step in (4, 8):  # a second record warns no more
            tracker.log_groups(
                run_id, [[step, record]], timestamp_ms=0, engine=metric_schema.INLINE
            )
    warned = [r.getMessage() for r in caplog.records if "not a finite number" in r.getMessage()]
    assert len(warned) == 2
    assert any("train/loss is nan" in m for m in warned)
    assert any("train/grad_norm is inf" in m for m in warned)
    logged = MlflowClient(uri).get_run(run_id).data.metrics
    assert set(logged) == {"iteration", "train/clip_fraction"}
