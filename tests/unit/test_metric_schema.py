"""The one metric schema: its builders give the same values for the same inputs in either
engine (empty sets included), and every declared name is unique and matches itself."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from replayrl.core.metrics import percentile
from replayrl.engine import metric_schema as schema

pytestmark = pytest.mark.unit


def test_every_name_is_declared_once_and_matches_itself():
    names = [m.name for m in schema.METRICS]
    assert len(names) == len(set(names))
    for m in schema.METRICS:
        member = m.name.replace("{k}", "4").replace("{phase}", "training")
        member = member.replace("{node}", "trainer").replace(
            "{metric}", "cpu_utilization_percentage"
        )
        assert schema.find(member).name == m.name  # the first declaration that matches
        assert m.engines <= schema.BOTH
        assert m.axis in (schema.GRADIENT_STEP, schema.KTOKENS, schema.SYSTEM_SAMPLE)
        assert m.axis == schema.KTOKENS or "_by_ktokens/" not in m.name


def test_families_match_their_members_only():
    assert schema.find("eval/pass_at_4", schema.INLINE).name == "eval/pass_at_{k}"
    assert schema.find("gpu/peak_gib_training", schema.INLINE).name == "gpu/peak_gib_{phase}"
    assert schema.find("gpu/peak_gib_training", schema.ASYNC) is None
    assert schema.undeclared(["replay/uses_per_row_mean", "eval/pass1"], schema.INLINE) == [
        "replay/uses_per_row_mean"
    ]
    assert schema.undeclared(["replay/uses_per_row_mean", "eval/pass1"], schema.ASYNC) == []


def test_replay_statistics_of_an_empty_window_are_not_logged_in_either_engine():
    empty = schema.replay_metrics(ages=np.array([]), gaps=np.array([]))
    assert set(empty) == {f"replay/{k}" for k in schema.REPLAY_SHARED}
    assert all(math.isnan(v) for v in empty.values())
    assert schema.finite(empty) == {}
    assert math.isnan(percentile([], 50))  # the inline engine's TrainResult reads the same


def test_replay_statistics_by_hand():
    # Ages 0, 2, 4, 10; two rows never used before (-1), two used 3 and 5 steps ago.
    got = schema.replay_metrics(ages=np.array([0, 2, 4, 10]), gaps=np.array([-1, 3, -1, 5]))
    assert got == {
        "replay/sample_age_mean": 4.0,
        "replay/sample_age_p50": 3.0,
        "replay/sample_age_p95": pytest.approx(9.1),
        "replay/sample_age_max": 10.0,
        "replay/steps_since_last_use_mean": 4.0,
        "replay/frac_first_use": 0.5,
    }
    # Only first uses: the mean since last use has no value, the share is 1.
    first = schema.finite(schema.replay_metrics(ages=np.array([1]), gaps=np.array([-1])))
    assert "replay/steps_since_last_use_mean" not in first
    assert first["replay/frac_first_use"] == 1.0


def test_eval_metrics_are_one_set_of_names_on_both_axes():
    result = {
        "pass1": 0.5,
        "pass_at_k": 0.75,
        "mean_sample_correct": 0.4,
        "entropy": 1.2,
        "response_length": 5.0,
        "unparsed": 0.1,
        "pass1_sampled": math.nan,
    }
    at_step = schema.finite(schema.eval_metrics(result, k=4, prefix="eval/"))
    at_tokens = schema.finite(schema.eval_metrics(result, k=4, prefix="eval_by_ktokens/"))
    assert at_step["accuracy/pass1"] == at_step["eval/pass1"] == 0.5
    assert at_tokens["accuracy/pass1_by_ktokens"] == 0.5
    assert "eval/pass1_sampled" not in at_step  # NaN unless eval.pass1_temperature is set
    assert {k.split("/", 1)[1] for k in at_step if k.startswith("eval/")} == {
        k.split("/", 1)[1] for k in at_tokens if k.startswith("eval_by_ktokens/")
    }
    for name in [*at_step, *at_tokens]:
        assert schema.undeclared([name], schema.INLINE) == []
        assert schema.undeclared([name], schema.ASYNC) == []


def test_docs_metrics_md_is_generated_from_the_schema():
    committed = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    assert committed == schema.markdown(), (
        "docs/metrics.md is stale: run `python -m replayrl.engine.metric_schema > docs/metrics.md`"
    )
