"""Pod settings of pipeline tasks, from the config's `kubernetes:` section.

Accelerator steps (generate, train, evaluate, and opening a lineage, which evaluates the
warm start when it creates one) get the accelerator type and count, their tolerations,
node selector and a memory-backed /dev/shm; CPU steps (compact, record) get none of these.
Every task gets the image, CPU/memory requests, a pod timeout, S3 and MLflow credentials
from Secrets and endpoints from a ConfigMap as environment variables, and caching off
(unless the config turns it on). Steps the caller marks as retried (generate, compact,
train, evaluate) get retries with exponential backoff.

Knows nothing about what the steps do; only where their pods run.
"""

from __future__ import annotations

from typing import Any

from kfp import kubernetes
from kfp.dsl import PipelineTask

from replayrl.config import KubernetesConfig
from replayrl.errors import ReplayRLError

S3_SECRET_KEYS = {
    "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
}
MLFLOW_SECRET_KEYS = {
    "MLFLOW_TRACKING_USERNAME": "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD": "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN": "MLFLOW_TRACKING_TOKEN",
}
ENDPOINT_KEYS = {
    "AWS_ENDPOINT_URL": "AWS_ENDPOINT_URL",
    "AWS_REGION": "AWS_REGION",
    "MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI",
}
SHM_VOLUME = "dshm"
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "toleration_seconds"}


def validate(k: KubernetesConfig) -> None:
    """Check the section before any YAML is written; each message says how to fix it."""
    for name in ("generate_gpus", "train_gpus", "evaluate_gpus", "retries", "retry_backoff_s"):
        if getattr(k, name) < 0:
            raise ReplayRLError(f"kubernetes.{name} must be >= 0, got {getattr(k, name)}.")
    for name in ("gpu_step_timeout_s", "cpu_step_timeout_s"):
        if getattr(k, name) < 0:
            raise ReplayRLError(f"kubernetes.{name} must be >= 0 (0 = no timeout).")
    for name in ("gpu_step_cpu", "gpu_step_memory", "cpu_step_cpu", "cpu_step_memory"):
        if not str(getattr(k, name)).strip():
            raise ReplayRLError(f"kubernetes.{name} must be a Kubernetes quantity such as '4Gi'.")
    if not isinstance(k.gpu_tolerations, list) or not all(
        isinstance(t, dict) for t in k.gpu_tolerations
    ):
        raise ReplayRLError(
            "kubernetes.gpu_tolerations must be a list of mappings, e.g. "
            "[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]."
        )
    for t in k.gpu_tolerations:
        unknown = set(t) - _TOLERATION_KEYS
        if unknown:
            raise ReplayRLError(
                f"kubernetes.gpu_tolerations: unknown field(s) {sorted(unknown)}; "
                f"use {sorted(_TOLERATION_KEYS)}."
            )
        if t.get("operator") not in (None, "Equal", "Exists"):
            raise ReplayRLError("kubernetes.gpu_tolerations: operator must be Equal or Exists.")
        if t.get("effect") not in (None, "NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise ReplayRLError(
                "kubernetes.gpu_tolerations: effect must be NoSchedule, PreferNoSchedule or NoExecute."
            )
    for key, value in k.gpu_node_selector.items():
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise ReplayRLError(
                f"kubernetes.gpu_node_selector.{key} must be a label value, got {value!r}."
            )


def configure(
    task: PipelineTask, k: KubernetesConfig, *, image: str, gpus: int, retry: bool
) -> PipelineTask:
    """Apply the pod settings to one task; `gpus` > 0 makes it an accelerator step."""
    task.set_container_image(image)
    task.set_caching_options(enable_caching=k.caching)
    accelerated = gpus > 0
    task.set_cpu_request(k.gpu_step_cpu if accelerated else k.cpu_step_cpu)
    task.set_memory_request(k.gpu_step_memory if accelerated else k.cpu_step_memory)
    if accelerated:
        task.set_accelerator_type(k.accelerator_type)
        task.set_accelerator_limit(gpus)
        for t in k.gpu_tolerations:
            _toleration(task, t)
        for key, value in sorted(k.gpu_node_selector.items()):
            kubernetes.add_node_selector(task, label_key=key, label_value=str(value))
        if k.shm_size:
            kubernetes.empty_dir_mount(
                task,
                volume_name=SHM_VOLUME,
                mount_path="/dev/shm",
                medium="Memory",
                size_limit=k.shm_size,
            )
    if k.s3_secret:
        kubernetes.use_secret_as_env(
            task, secret_name=k.s3_secret, secret_key_to_env=S3_SECRET_KEYS
        )
    if k.mlflow_secret:
        kubernetes.use_secret_as_env(
            task, secret_name=k.mlflow_secret, secret_key_to_env=MLFLOW_SECRET_KEYS, optional=True
        )
    if k.endpoints_config_map:
        kubernetes.use_config_map_as_env(
            task,
            config_map_name=k.endpoints_config_map,
            config_map_key_to_env=ENDPOINT_KEYS,
            optional=True,
        )
    timeout_s = k.gpu_step_timeout_s if accelerated else k.cpu_step_timeout_s
    if timeout_s > 0:
        kubernetes.set_timeout(task, seconds=timeout_s)
    if retry and k.retries > 0:
        task.set_retry(
            num_retries=k.retries,
            backoff_duration=f"{k.retry_backoff_s}s",
            backoff_factor=2.0,
            backoff_max_duration=f"{max(3600, k.retry_backoff_s * 2**k.retries)}s",
        )
    return task


def _toleration(task: PipelineTask, t: dict[str, Any]) -> None:
    kubernetes.add_toleration(
        task,
        key=t.get("key"),
        operator=t.get("operator"),
        value=t.get("value"),
        effect=t.get("effect"),
        toleration_seconds=t.get("toleration_seconds"),
    )
