"""Pod settings of pipeline tasks, from the config's `kubernetes:` section.

Accelerator steps (a task of iterations, v0's evaluation, and in the step layout generate,
train and evaluate) get the accelerator type and count, their tolerations,
node selector, a memory-backed /dev/shm, a disk-backed /scratch that holds the checkpoint
downloads and the cache (`REPLAYRL_CACHE`), and `REPLAYRL_REQUIRE_GPU` (the count), which
makes the step stop at once with one line when CUDA cannot serve it (`replayrl.policy.gpu`); CPU
steps (opening a lineage, compact, record, the exit task) get none of these.
Every task gets the image, CPU/memory requests, a pod timeout, S3 and MLflow credentials
from Secrets and endpoints from a ConfigMap as environment variables (the task that opens a
lineage also HF_TOKEN, for hub downloads), and caching off
(unless the config turns it on). Steps the caller marks as retried (generate, compact,
train, evaluate) get retries with exponential backoff.

`check_image` accepts an image by tag or by digest (`name@sha256:…`, which pins exactly the
image that was pushed). Knows nothing about what the steps do; only where their pods run.
"""

from __future__ import annotations

import re
from typing import Any

from kfp import kubernetes
from kfp.dsl import PipelineTask

from replayrl.config import KubernetesConfig
from replayrl.errors import ReplayRLError
from replayrl.policy.gpu import REQUIRE_GPU_ENV

S3_SECRET_KEYS = {
    "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
}
MLFLOW_SECRET_KEYS = {
    "MLFLOW_TRACKING_USERNAME": "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD": "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN": "MLFLOW_TRACKING_TOKEN",
}
HF_SECRET_KEYS = {"HF_TOKEN": "HF_TOKEN"}
ENDPOINT_KEYS = {
    "AWS_ENDPOINT_URL": "AWS_ENDPOINT_URL",
    "AWS_REGION": "AWS_REGION",
    "MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI",
}
SHM_VOLUME = "dshm"
SCRATCH_VOLUME = "scratch"
SCRATCH_MOUNT = "/scratch"
# The cache (`config.default_cache_dir`) on the scratch volume: checkpoint downloads land
# there, not in the container's writable layer.
SCRATCH_CACHE = "/scratch/replayrl"
# A Kubernetes resource quantity: 100Gi, 512M, 1.5Ti, 1e9.
_QUANTITY = re.compile(r"[+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+|[numkMGTPE]|[KMGTPE]i)?")
# An image reference as registries and container runtimes parse it (the grammar of
# github.com/distribution/reference): [host[:port]/]path[:tag][@sha256:<64 hex>].
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[0-9a-fA-F:.]+\])(?::\d+)?"
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE = re.compile(
    rf"(?:{_DOMAIN}/)?{_PATH_PART}(?:/{_PATH_PART})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
    r"(?:@sha256:[0-9a-f]{64})?"
)
# A pipeline root the KFP launcher can open (KFP's backend/src/v2/objectstore/config.go): a
# bucket URI of a scheme it supports, an optional prefix, and optional query parameters.
_PIPELINE_ROOT = re.compile(r"(s3|gs|minio)://[^/?\s]+(/[^?\s]*)?(\?\S+)?")
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "toleration_seconds"}


def validate(k: KubernetesConfig) -> None:
    """Check the section before any YAML is written; each message says how to fix it."""
    for name in ("generate_gpus", "train_gpus", "evaluate_gpus", "retries", "retry_backoff_s"):
        if getattr(k, name) < 0:
            raise ReplayRLError(f"kubernetes.{name} must be >= 0, got {getattr(k, name)}.")
    for name in ("gpu_step_timeout_s", "cpu_step_timeout_s"):
        if getattr(k, name) < 0:
            raise ReplayRLError(f"kubernetes.{name} must be >= 0 (0 = no timeout).")
    if k.lease_ttl_s < 60:
        raise ReplayRLError(
            f"kubernetes.lease_ttl_s must be >= 60 seconds (a task renews it every third of "
            f"it), got {k.lease_ttl_s}."
        )
    if k.pipeline_root is not None and not _PIPELINE_ROOT.fullmatch(str(k.pipeline_root)):
        raise ReplayRLError(
            f"kubernetes.pipeline_root must be a bucket URI such as s3://my-bucket/kfp-artifacts "
            f"(s3://, gs:// or minio://), or null for the KFP install's default; got "
            f"{k.pipeline_root!r}."
        )
    for name in ("gpu_step_cpu", "gpu_step_memory", "cpu_step_cpu", "cpu_step_memory"):
        if not str(getattr(k, name)).strip():
            raise ReplayRLError(f"kubernetes.{name} must be a Kubernetes quantity such as '4Gi'.")
    for name in ("shm_size", "scratch_size"):
        value = str(getattr(k, name)).strip()
        if value and not _QUANTITY.fullmatch(value):
            raise ReplayRLError(
                f"kubernetes.{name} must be a Kubernetes quantity such as '100Gi', or '' for no "
                f"volume; got {getattr(k, name)!r}."
            )
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


def check_image(image: str) -> None:
    """Refuse an image reference a container runtime could not pull: by tag
    (`registry.example.com/replayrl:0.1.0`), by digest (`registry.example.com/replayrl@sha256:`
    and 64 hex digits) or both (`…/replayrl:0.1.0@sha256:…`, where the digest wins)."""
    if _IMAGE.fullmatch(image):
        return
    if "@" in image and not re.search(r"@sha256:[0-9a-f]{64}$", image):
        raise ReplayRLError(
            f"Image {image!r}: the digest after '@' must be 'sha256:' and 64 lowercase hex "
            "digits, as `docker inspect --format '{{index .RepoDigests 0}}' IMAGE` prints it."
        )
    raise ReplayRLError(
        f"Image {image!r} is not an image reference: use [registry[:port]/]name[:tag] or "
        "[registry[:port]/]name@sha256:<64 hex digits>, the name in lowercase, e.g. "
        "registry.example.com/replayrl@sha256:<digest>."
    )


def configure(
    task: PipelineTask,
    k: KubernetesConfig,
    *,
    image: str,
    gpus: int,
    retry: bool,
    downloads: bool = False,
) -> PipelineTask:
    """Apply the pod settings to one task; `gpus` > 0 makes it an accelerator step.
    `downloads`: the task may download from the Hugging Face hub (it opens a lineage), so it
    gets HF_TOKEN from `k.hf_secret`."""
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
        if k.scratch_size:
            kubernetes.empty_dir_mount(
                task,
                volume_name=SCRATCH_VOLUME,
                mount_path=SCRATCH_MOUNT,
                size_limit=k.scratch_size,
            )
            task.set_env_variable("REPLAYRL_CACHE", SCRATCH_CACHE)
            _scratch_compile_caches(task)
        task.set_env_variable(REQUIRE_GPU_ENV, str(gpus))
    if k.s3_secret:
        kubernetes.use_secret_as_env(
            task, secret_name=k.s3_secret, secret_key_to_env=S3_SECRET_KEYS
        )
    if k.mlflow_secret:
        kubernetes.use_secret_as_env(
            task, secret_name=k.mlflow_secret, secret_key_to_env=MLFLOW_SECRET_KEYS, optional=True
        )
    if downloads and k.hf_secret:
        kubernetes.use_secret_as_env(
            task, secret_name=k.hf_secret, secret_key_to_env=HF_SECRET_KEYS, optional=True
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


# vLLM's compiled graphs and torch's/Triton's kernels on the scratch volume, not under the
# container's home: a pod's engines (and a retried engine start) reuse what the first built,
# and the writable layer does not fill up. PYTORCH_CUDA_ALLOC_CONF is left alone here: these
# pods may build a vLLM engine with sleep mode, which refuses expandable segments.
SCRATCH_COMPILE_CACHES = {
    "VLLM_CACHE_ROOT": f"{SCRATCH_MOUNT}/vllm",
    "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH_MOUNT}/torchinductor",
    "TRITON_CACHE_DIR": f"{SCRATCH_MOUNT}/triton",
}


def _scratch_compile_caches(task: PipelineTask) -> None:
    for name, value in SCRATCH_COMPILE_CACHES.items():
        task.set_env_variable(name, value)


def _toleration(task: PipelineTask, t: dict[str, Any]) -> None:
    kubernetes.add_toleration(
        task,
        key=t.get("key"),
        operator=t.get("operator"),
        value=t.get("value"),
        effect=t.get("effect"),
        toleration_seconds=t.get("toleration_seconds"),
    )
