"""Pure helpers of the Kubeflow engine: cron normalisation, the config parameter, result
JSON, the lease's lifetime, the pod-settings checks and the UI report."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from replayrl.config import KubernetesConfig, RunConfig
from replayrl.errors import ReplayRLError
from replayrl.kfp import pods, runtime
from replayrl.kfp.client import normalize_cron

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "given,expected",
    [
        ("0 * * * *", "0 0 * * * *"),
        ("*/30 2 * * 1-5", "0 */30 2 * * 1-5"),
        ("5 0 * * * *", "5 0 * * * *"),
    ],
)
def test_cron_gets_kfp_six_fields(given, expected):
    assert normalize_cron(given) == expected


@pytest.mark.parametrize("bad", ["hourly", "* * *", "0 0 0 * * * *"])
def test_bad_cron_says_what_is_expected(bad):
    with pytest.raises(ReplayRLError, match="five fields"):
        normalize_cron(bad)


def test_config_text_passes_yaml_text_through():
    text = "iterations: 3\nbuffer:\n  capacity: 64\n"
    assert runtime.config_text(text) == text
    assert runtime.config_text("") == ""
    assert runtime.config_text("{iterations: 3}") == "{iterations: 3}"


@dataclass(frozen=True)
class Result:
    iteration: int
    loss: float
    rate: float


def test_results_round_trip_through_json_exactly():
    r = Result(iteration=3, loss=0.1 + 0.2, rate=float("nan"))
    back = runtime.from_json(Result, runtime.to_json(r))
    assert back.iteration == 3 and isinstance(back.iteration, int)
    assert back.loss == r.loss and math.isnan(back.rate)


class FakeMetrics:
    def __init__(self):
        self.metadata = {}

    def log_metric(self, key, value):
        self.metadata[key] = value


def test_only_finite_numbers_reach_the_ui_metrics():
    m = FakeMetrics()
    runtime.log_metrics(m, {"a": 1, "b": 0.5, "c": float("nan"), "d": "x", "e": True})
    assert m.metadata == {"a": 1.0, "b": 0.5}


def test_the_lease_is_short_and_configurable():
    assert runtime.lease_ttl_s(RunConfig()) == 600.0  # minutes, not a pod's timeout
    cfg = RunConfig(kubernetes=KubernetesConfig(lease_ttl_s=120))
    assert runtime.lease_ttl_s(cfg) == 120.0
    with pytest.raises(ReplayRLError, match="lease_ttl_s must be >= 60 seconds"):
        pods.validate(KubernetesConfig(lease_ttl_s=10))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"retries": -1}, "kubernetes.retries must be >= 0"),
        ({"cpu_step_timeout_s": -5}, "0 = no timeout"),
        ({"gpu_step_memory": " "}, "Kubernetes quantity"),
        ({"gpu_tolerations": [{"key": "a", "effect": "Sometimes"}]}, "effect must be"),
        ({"gpu_node_selector": {"zone": ["a"]}}, "must be a label value"),
        ({"scratch_size": "lots"}, "kubernetes.scratch_size must be a Kubernetes quantity"),
        ({"shm_size": "16 GiB"}, "kubernetes.shm_size must be a Kubernetes quantity"),
    ],
)
def test_pod_settings_are_checked_with_the_fix(changes, message):
    with pytest.raises(ReplayRLError, match=message):
        pods.validate(KubernetesConfig(**changes))


@pytest.mark.parametrize("size", ["100Gi", "512M", "1.5Ti", "1e9", "2000000000", ""])
def test_scratch_sizes_are_kubernetes_quantities_or_empty(size):
    pods.validate(KubernetesConfig(scratch_size=size))


SHA = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    "image",
    [
        "ghcr.io/replayrl/replayrl:0.1.0",
        "replayrl",
        "localhost:5000/replayrl:dev_build-1.2",
        "registry.example.com:443/team/sub/replay-rl__x:latest",
        f"registry.example.com/replayrl@{SHA}",
        f"registry.example.com/replayrl:0.1.0@{SHA}",
        f"[::1]:5000/replayrl@{SHA}",
    ],
)
def test_images_by_tag_or_digest_are_accepted(image):
    pods.check_image(image)


@pytest.mark.parametrize(
    "image,message",
    [
        ("registry.example.com/replayrl@sha256:abc", "64 lowercase hex digits"),
        ("registry.example.com/replayrl@" + SHA.upper(), "64 lowercase hex digits"),
        ("registry.example.com/replayrl@md5:" + "ab" * 16, "64 lowercase hex digits"),
        ("registry.example.com/replayrl:0.1.0@", "64 lowercase hex digits"),
        ("", "not an image reference"),
        ("Registry.example.com/RePlayRL:0.1.0", "not an image reference"),
        ("registry.example.com/replayrl:", "not an image reference"),
        ("registry.example.com/replayrl:-bad", "not an image reference"),
        ("registry.example.com/replayrl:0.1.0 ", "not an image reference"),
        ("https://registry.example.com/replayrl", "not an image reference"),
    ],
)
def test_malformed_images_are_refused_with_the_form_expected(image, message):
    with pytest.raises(ReplayRLError, match=message):
        pods.check_image(image)


def test_kubernetes_settings_do_not_change_the_config_hash():
    moved = RunConfig(kubernetes=KubernetesConfig(train_gpus=8, accelerator_type="amd.com/gpu"))
    assert moved.config_hash() == RunConfig().config_hash()


def test_report_shows_the_iteration_and_where_the_rest_is():
    text = runtime.report(
        RunConfig(), 4, {"eval/pass1": 0.25, "train/loss": 0.01, "other": 1.0}, "http://mlflow:5000"
    )
    assert "iteration 4 of 300" in text and "| `eval/pass1` | 0.25 |" in text
    assert "other" not in text and "http://mlflow:5000" in text
