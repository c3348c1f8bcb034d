"""Pod settings of pipeline tasks, from the config's `kubernetes:` section.

Accelerator steps (a task of iterations, v0's evaluation, and in the step layout generate,
train and evaluate) get the accelerator type and count, their tolerations, node selector, a
memory-backed /dev/shm, a disk-backed /scratch that holds the checkpoint downloads and the
cache (`REPLAYRL_CACHE`: an emptyDir, or with `scratch_storage_class` a generic ephemeral
volume, which reserves its size where an emptyDir cannot), and `REPLAYRL_REQUIRE_GPU` (the
count), which makes the step stop at once with one line when CUDA cannot serve it
(`replayrl.policy.gpu`); CPU steps (opening a lineage, compact, record, the exit task) get
none of these. Every task gets the image, CPU/memory requests and limits (a namespace whose
ResourceQuota counts `limits.*` admits no pod without them), a pod timeout (the quick CPU
steps, opening the lineage and the exit task, a short one, `quick_step_timeout_s`: a pod that
cannot pull its image or lacks a Secret fails the run in minutes), S3 and MLflow credentials
from Secrets and endpoints from a ConfigMap as environment variables (the task that opens a
lineage also HF_TOKEN, for hub downloads), and caching off (unless the config turns it on).
Steps the caller marks as retried (generate, compact, train, evaluate) get retries with
exponential backoff, in a window that fits every attempt (`retry_window_s`). Pods whose loss
costs more than a few minutes of work carry `cluster-autoscaler.kubernetes.io/safe-to-evict:
"false"` and `karpenter.sh/do-not-disrupt: "true"`, so a scale-down (the cluster
autoscaler's or Karpenter's consolidation) never drains them; `image_pull_secrets` are set
on every pod. With `kubernetes.run_as_user` the container gets runAsUser/runAsGroup and
runAsNonRoot (KFP backend >= 2.16, which adds allowPrivilegeEscalation: false, drop ALL and
the RuntimeDefault seccomp profile itself); `kueue_pod_group` queues the asynchronous
segment's roles as one Kueue pod group.

`check_image` accepts an image by tag or by digest (`name@sha256:…`, which pins exactly the
image that was pushed). Knows nothing about what the steps do; only where their pods run.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

from kfp import kubernetes
from kfp.dsl import PipelineTask
from kfp.dsl import pipeline_task as _kfp_pipeline_task

from replayrl.config import KubernetesConfig
from replayrl.errors import ReplayRLError
from replayrl.policy.gpu import REQUIRE_GPU_ENV


class _FramesOnly:
    """`inspect` for kfp's `pipeline_task` module, with a `stack()` that reads no source.

    Every pod setting of a task (`set_cpu_limit`, `set_env_variable`, ...) calls
    `inspect.stack()[1][3]` in `PipelineTask._ensure_container_spec_exists`, only to name the
    setter in an error it raises on a pipeline used as a component. `inspect.stack()` reads
    the source of every frame on the stack and, per frame, scans `sys.modules`; in a process
    that has imported torch, transformers and MLflow (a test run, a notebook) each call took
    ~0.1 s, and compiling a 50-iteration pipeline 2 to 3 minutes instead of 20 s. This
    `stack()` returns the same frames with their names and lines, without their source."""

    def __getattr__(self, name: str) -> Any:
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list[inspect.FrameInfo]:
        frames = []
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            frames.append(
                inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name, None, None)
            )
            frame = frame.f_back
        return frames


if getattr(_kfp_pipeline_task, "inspect", None) is inspect:
    _kfp_pipeline_task.inspect = _FramesOnly()  # type: ignore[assignment]

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
# The cluster autoscaler drains no node that runs a pod with this annotation "false": a
# scale-down would otherwise evict a GPU pod hours into its task (an eviction is an Error,
# which KFP's retry policy does retry, but the work since the last checkpoint is lost).
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
# CPU pods that may run longer than this (their timeout, or none) are kept from eviction too.
LONG_POD_S = 600
# Kueue's pod integration: a pod with the queue label is held (scheduling-gated) until Kueue
# admits its group; the group is the pods with the same group name, complete at the count.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
# One group per run: Argo resolves {{workflow.name}} (unique per run) in the task's arguments,
# where KFP puts pod labels, before it creates the pod.
KUEUE_GROUP_NAME = "{{workflow.name}}"
_QUANTITY_SUFFIX = {
    "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
    "P": 1e15, "E": 1e18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
    "Ei": 2**60,
}  # fmt: skip


def validate(k: KubernetesConfig) -> None:
    """Check the section before any YAML is written; each message says how to fix it."""
    for name in ("generate_gpus", "train_gpus", "evaluate_gpus", "retries", "retry_backoff_s"):
        if getattr(k, name) < 0:
            raise ReplayRLError(f"kubernetes.{name} must be >= 0, got {getattr(k, name)}.")
    for name in ("gpu_step_timeout_s", "cpu_step_timeout_s"):
        if getattr(k, name) < 0:
            raise ReplayRLError(f"kubernetes.{name} must be >= 0 (0 = no timeout).")
    if k.quick_step_timeout_s < 0:
        raise ReplayRLError(
            f"kubernetes.quick_step_timeout_s must be >= 0 seconds (0 = "
            f"kubernetes.cpu_step_timeout_s), got {k.quick_step_timeout_s}."
        )
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
    for kind in ("gpu_step", "cpu_step"):
        for what in ("cpu", "memory"):
            request, limit = f"{kind}_{what}", f"{kind}_{what}_limit"
            for name in (request, limit):
                if not _QUANTITY.fullmatch(str(getattr(k, name)).strip()):
                    raise ReplayRLError(
                        f"kubernetes.{name} must be a Kubernetes quantity such as '4Gi' or "
                        f"'500m', got {getattr(k, name)!r}."
                    )
            if quantity(getattr(k, limit)) < quantity(getattr(k, request)):
                raise ReplayRLError(
                    f"kubernetes.{limit} ({getattr(k, limit)}) is below kubernetes.{request} "
                    f"({getattr(k, request)}): Kubernetes refuses a limit below the request; "
                    f"raise the limit."
                )
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


def quantity(text: str) -> float:
    """A Kubernetes resource quantity as a number (`4Gi` -> 4294967296.0, `500m` -> 0.5,
    `1e3` -> 1000.0, `1E` -> 1e18)."""
    match = _QUANTITY.fullmatch(str(text).strip())
    if match is None:
        raise ReplayRLError(f"{text!r} is not a Kubernetes quantity such as '4Gi' or '500m'.")
    number, suffix = float(match.group(1)), match.group(3) or ""
    if len(suffix) > 1 and suffix[0] in "eE" and suffix[1] != "i":  # an exponent: 1e3, 5E-2
        return number * 10 ** int(suffix[1:])
    return number * _QUANTITY_SUFFIX[suffix]


def retry_window_s(*, timeout_s: int, retries: int, backoff_s: int) -> int:
    """The retry strategy's max duration (KFP's `backoff_max_duration`, Argo's
    `retryStrategy.backoff.maxDuration`) for a task of pod timeout `timeout_s` retried
    `retries` times, the first after `backoff_s` and each later one after twice the one
    before. Argo counts it from the first attempt's start (time spent Pending included);
    past it Argo starts no retry, and it gives each retry pod only what is left of it as its
    deadline. So it must hold every attempt at its full timeout and every backoff:
    (retries + 1) x timeout + backoff_s x (2^retries - 1), plus an hour for pods that wait
    for a node (a GPU node scaling up). A task without a timeout (0) gets a week."""
    backoffs = backoff_s * (2**retries - 1)
    if timeout_s <= 0:
        return 7 * 24 * 3600 + backoffs
    return (retries + 1) * timeout_s + backoffs + 3600


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
    quick: bool = False,
    timeout_s: int | None = None,
) -> PipelineTask:
    """Apply the pod settings to one task; `gpus` > 0 makes it an accelerator step.
    `downloads`: the task may download from the Hugging Face hub (it opens a lineage), so it
    gets HF_TOKEN from `k.hf_secret`. `quick`: a quick CPU step (opening the lineage, the
    exit task), whose pod gets `quick_timeout_s` as its deadline: one that cannot pull its
    image or lacks a Secret fails the run in minutes. `timeout_s`: this pod's deadline (and
    its retry window) instead of its kind's, e.g. a CPU launcher that waits for accelerator
    pods elsewhere."""
    if quick and gpus > 0:
        raise ValueError("quick=True is for CPU steps (opening the lineage, the exit task)")
    task.set_container_image(image)
    task.set_caching_options(enable_caching=k.caching)
    accelerated = gpus > 0
    task.set_cpu_request(k.gpu_step_cpu if accelerated else k.cpu_step_cpu)
    task.set_memory_request(k.gpu_step_memory if accelerated else k.cpu_step_memory)
    task.set_cpu_limit(k.gpu_step_cpu_limit if accelerated else k.cpu_step_cpu_limit)
    task.set_memory_limit(k.gpu_step_memory_limit if accelerated else k.cpu_step_memory_limit)
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
            _scratch_volume(task, k)
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
    if timeout_s is None:
        timeout_s = k.gpu_step_timeout_s if accelerated else k.cpu_step_timeout_s
        if quick:
            timeout_s = quick_timeout_s(k)
    if timeout_s > 0:
        kubernetes.set_timeout(task, seconds=timeout_s)
    if accelerated or timeout_s <= 0 or timeout_s > LONG_POD_S:
        # The cluster autoscaler reads the first, Karpenter (which ignores it) the second.
        kubernetes.add_pod_annotation(task, annotation_key=SAFE_TO_EVICT, annotation_value="false")
        kubernetes.add_pod_annotation(task, annotation_key=DO_NOT_DISRUPT, annotation_value="true")
    if k.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, secret_names=list(k.image_pull_secrets))
    if k.run_as_user is not None:
        kubernetes.set_security_context(
            task, run_as_user=k.run_as_user, run_as_group=k.run_as_user, run_as_non_root=True
        )
    if retry and k.retries > 0:
        window_s = retry_window_s(
            timeout_s=timeout_s, retries=k.retries, backoff_s=k.retry_backoff_s
        )
        task.set_retry(
            num_retries=k.retries,
            backoff_duration=f"{k.retry_backoff_s}s",
            backoff_factor=2.0,
            backoff_max_duration=f"{window_s}s",
        )
    return task


def quick_timeout_s(k: KubernetesConfig) -> int:
    """The pod deadline of the quick CPU steps: `quick_step_timeout_s`, never longer than the
    other CPU steps' (`cpu_step_timeout_s`, 0 = none), which it is when 0."""
    quick, cpu = k.quick_step_timeout_s, k.cpu_step_timeout_s
    if quick <= 0:
        return cpu
    return quick if cpu <= 0 else min(quick, cpu)


def kueue_pod_group(task: PipelineTask, k: KubernetesConfig, *, pods: int) -> PipelineTask:
    """Queue `task` in `k.kueue_queue` as one of the `pods` pods of the run's Kueue pod group
    (the asynchronous segment's roles); nothing when no queue is set."""
    if k.kueue_queue:
        kubernetes.add_pod_label(task, label_key=KUEUE_QUEUE_LABEL, label_value=k.kueue_queue)
        kubernetes.add_pod_label(task, label_key=KUEUE_GROUP_LABEL, label_value=KUEUE_GROUP_NAME)
        kubernetes.add_pod_annotation(
            task, annotation_key=KUEUE_COUNT_ANNOTATION, annotation_value=str(pods)
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


def _scratch_volume(task: PipelineTask, k: KubernetesConfig) -> None:
    """/scratch: an emptyDir of at most `scratch_size` on the node's disk, or, with
    `scratch_storage_class`, a generic ephemeral volume of that size from the class. KFP
    cannot request ephemeral-storage for a pod (its container resources are CPU, memory and
    an accelerator; its driver sets nothing else), so only the second reserves the disk."""
    if k.scratch_storage_class:
        kubernetes.add_ephemeral_volume(
            task,
            volume_name=SCRATCH_VOLUME,
            mount_path=SCRATCH_MOUNT,
            access_modes=["ReadWriteOnce"],
            size=k.scratch_size,
            storage_class_name=k.scratch_storage_class,
        )
    else:
        kubernetes.empty_dir_mount(
            task, volume_name=SCRATCH_VOLUME, mount_path=SCRATCH_MOUNT, size_limit=k.scratch_size
        )


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
