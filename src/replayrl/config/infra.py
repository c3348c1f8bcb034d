"""Where and how a run executes: tracking, storage and the Kubeflow pods (the asynchronous split is
in replayrl.config.asynchronous). Each knob carries its help, each section checks its own
fields in `check()` (see replayrl.config.schema for the conventions)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from replayrl.config.ranges import check_ranges
from replayrl.errors import ReplayRLError

# A Kubernetes object name (DNS subdomain, RFC 1123), e.g. a service account's.
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow: where runs, parameters and metrics are logged. Not part of the config hash."""

    uri: str | None = field(
        default=None,
        metadata={
            "help": "MLflow tracking URI. None = $MLFLOW_TRACKING_URI if set, else "
            "sqlite:///<run root>/mlflow.db for a local run root."
        },
    )
    experiment: str = field(
        default="replayrl", metadata={"help": "MLflow experiment the runs are logged to."}
    )
    system_metrics: bool = field(
        default=True,
        metadata={
            "help": "Log MLflow system metrics (CPU, memory, disk, network; GPU where NVML "
            "is present) to every run the engines open, as system/<metric> (system/<role>/"
            "<metric> for the asynchronous roles and Kubeflow tasks). Costs one background "
            "thread and a batch of metrics per interval. false = none."
        },
    )
    system_metrics_interval_s: float = field(
        default=10.0,
        metadata={
            "range": "(0, inf)",
            "help": "Seconds between two system-metrics samples (each is logged). "
            "$MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL overrides it.",
        },
    )
    copy_models: bool = field(
        default=False,
        metadata={
            "help": "Copy each full checkpoint's weights and tokenizer into MLflow's artifact "
            "store with its logged model. false = the logged model refers to the checkpoint "
            "under the run root (no copy; the reference breaks when the checkpoint is pruned)."
        },
    )
    register_model_name: str | None = field(
        default=None,
        metadata={
            "help": "Register the lineage's last full checkpoint under this MLflow registered "
            "model name when the lineage ends (as `replayrl register` does). None = register "
            "nothing."
        },
    )
    register_alias: str = field(
        default="candidate",
        metadata={"help": "Alias set on the model version the end of a lineage registers."},
    )

    def check(self) -> None:
        """Any URI and experiment name are accepted here (the store is opened, and
        checked, when a run starts)."""
        check_ranges(self, "tracking")


@dataclass(frozen=True)
class StorageConfig:
    """Where lineages (buffer, checkpoints, state.json) live. Not part of the config hash."""

    run_root: str = field(
        default="runs",
        metadata={
            "help": "Run root: file:// URI or local path (the embedded default) or "
            "s3://bucket/prefix. One lineage lives under <run_root>/<lineage>/."
        },
    )
    lineage: str | None = field(
        default=None,
        metadata={
            "help": 'The lineage name. None = "<task>-<arm>-s<seed>" ("<task>-async-<arm>-'
            's<seed>" with asynchronous.enabled).'
        },
    )

    def check(self) -> None:
        """The run root is opened (and checked) when a run starts."""
        check_ranges(self, "storage")


def _default_gpu_tolerations() -> list[dict[str, Any]]:
    return [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


GPU_STEPS = "Accelerator steps' "
CPU_STEPS = "CPU steps' "


@dataclass(frozen=True)
class KubernetesConfig:
    """Pod settings of the Kubeflow pipelines. `replayrl compile --config FILE` bakes them
    into the pipeline YAML; they decide where steps run, never what they compute, so they are
    not part of the config hash, and the inline engine ignores them. "Accelerator steps" are a
    task of iterations, v0's evaluation, and in the step layout generate, train and evaluate;
    opening a lineage, compact, recording an iteration and the exit task (releasing the
    lineage) run on CPU."""

    accelerator_type: str = field(
        default="nvidia.com/gpu",
        metadata={"help": "Extended resource requested for accelerators."},
    )
    generate_gpus: int = field(
        default=1,
        metadata={
            "range": "[0, inf)",
            "help": "Accelerators per generate pod; 0 runs the step on CPU only. At least "
            "rollout.tensor_parallel_size.",
        },
    )
    train_gpus: int = field(
        default=1,
        metadata={
            "range": "[0, inf)",
            "help": "Accelerators per train pod (the task pod, in the task layout); 0 runs "
            "the step on CPU only. train.num_processes is at most this.",
        },
    )
    evaluate_gpus: int = field(
        default=1,
        metadata={
            "range": "[0, inf)",
            "help": "Accelerators per evaluate pod; 0 runs the step on CPU only. At least "
            "rollout.tensor_parallel_size.",
        },
    )
    gpu_step_cpu: str = field(
        default="4", metadata={"help": GPU_STEPS + "CPU request (a Kubernetes quantity)."}
    )
    gpu_step_memory: str = field(
        default="32Gi",
        metadata={"help": GPU_STEPS + "memory request (a Kubernetes quantity)."},
    )
    cpu_step_cpu: str = field(
        default="1", metadata={"help": CPU_STEPS + "CPU request (a Kubernetes quantity)."}
    )
    cpu_step_memory: str = field(
        default="4Gi", metadata={"help": CPU_STEPS + "memory request (a Kubernetes quantity)."}
    )
    gpu_step_cpu_limit: str = field(
        default="16",
        metadata={
            "help": GPU_STEPS + "CPU limit (a Kubernetes quantity, at least the request): a "
            "namespace whose ResourceQuota counts limits.cpu admits no pod without one."
        },
    )
    gpu_step_memory_limit: str = field(
        default="64Gi",
        metadata={
            "help": GPU_STEPS + "memory limit (a Kubernetes quantity, at least the request); "
            "a pod that uses more is OOM-killed (and retried). Loading a checkpoint and vLLM's "
            "host buffers need headroom above the request."
        },
    )
    cpu_step_cpu_limit: str = field(
        default="2",
        metadata={"help": CPU_STEPS + "CPU limit (a Kubernetes quantity, at least the request)."},
    )
    cpu_step_memory_limit: str = field(
        default="8Gi",
        metadata={
            "help": CPU_STEPS + "memory limit (a Kubernetes quantity, at least the request)."
        },
    )
    gpu_tolerations: list[dict[str, Any]] = field(
        default_factory=_default_gpu_tolerations,
        metadata={
            "help": "Tolerations of accelerator steps: mappings with key, operator, value, "
            "effect (as in a pod spec). The default tolerates the usual GPU node taint. "
            "[] = none."
        },
    )
    gpu_node_selector: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "Node labels accelerator steps must match, e.g. "
            "{nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}. {} = any node that has the "
            "accelerator."
        },
    )
    shm_size: str = field(
        default="16Gi",
        metadata={
            "help": "Size limit of the memory-backed /dev/shm of accelerator steps (the "
            'container default of 64 MiB is too small for NCCL and data loaders). "" = no '
            "/dev/shm volume."
        },
    )
    scratch_size: str = field(
        default="100Gi",
        metadata={
            "help": "Size limit of a disk-backed scratch volume (an emptyDir) mounted at "
            "/scratch on accelerator steps, where checkpoint downloads and the cache go "
            "($REPLAYRL_CACHE = /scratch/replayrl) instead of the container's writable layer; "
            "a pod that writes more is evicted. A 0.5B model's full checkpoint is ~6 GB, and "
            'a task keeps a few. "" = no volume (downloads go to ~/.cache/replayrl in the '
            "container). An emptyDir requests no disk (KFP sets only CPU, memory and "
            "accelerator requests, not ephemeral-storage), so the scheduler may place the pod "
            "on a node with less free disk: see kubernetes.scratch_storage_class."
        },
    )
    scratch_storage_class: str | None = field(
        default=None,
        metadata={
            "help": "StorageClass of the scratch volume. Set: /scratch is a generic ephemeral "
            "volume instead of an emptyDir, a PersistentVolumeClaim of "
            "kubernetes.scratch_size (ReadWriteOnce) created with each pod and deleted with "
            "it, so the pod starts only where that much disk is provisioned for it (a local "
            "NVMe class with capacity tracking, or a network disk class). Its filesystem must "
            "be writable by the image's user (UID 1000, or kubernetes.run_as_user) and KFP "
            "sets no fsGroup: hostPath-style provisioners (local-path) make world-writable "
            "volumes, a block-disk class formats them root-owned (writable only where an "
            "admission policy sets fsGroup). A class that does not exist or cannot provision "
            "leaves the pod Pending, unscheduled, where no pod deadline runs. None = an "
            "emptyDir on the node's own disk, bounded by scratch_size but not reserved.",
        },
    )
    s3_secret: str | None = field(
        default="replayrl-s3",
        metadata={
            "help": "Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, set as env on "
            "every step. None = no secret (e.g. workload identity)."
        },
    )
    image_pull_secrets: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Secrets (of type kubernetes.io/dockerconfigjson, in the run's namespace) "
            "every step's pod pulls its image with: a private registry. [] = none (the "
            "service account's own imagePullSecrets still apply).",
        },
    )
    mlflow_secret: str | None = field(
        default="replayrl-mlflow",
        metadata={
            "help": "Secret with MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD / "
            "MLFLOW_TRACKING_TOKEN; optional: pods start without it. None = not mounted."
        },
    )
    hf_secret: str | None = field(
        default="replayrl-hf",
        metadata={
            "help": "Secret with HF_TOKEN, for a model.source or task.path that names a gated "
            "or private Hugging Face repository; optional, and set only on the task that opens "
            "a lineage (the one that downloads). None = not mounted."
        },
    )
    endpoints_config_map: str | None = field(
        default="replayrl-endpoints",
        metadata={
            "help": "ConfigMap with AWS_ENDPOINT_URL, AWS_REGION and MLFLOW_TRACKING_URI, set "
            "as env; optional: missing keys are left unset. None = not mounted."
        },
    )
    service_account: str | None = field(
        default=None,
        metadata={
            "help": "Kubernetes service account the pipeline's pods run as. Not in the "
            "pipeline YAML: `replayrl submit` and `schedule` set it on each run and recurring "
            "run (from a local --config; a config given as a URI is read only by the "
            'pipeline, so they use this default). None or "" = KFP\'s default account of '
            "the run's namespace, which exists wherever KFP runs pipelines: `default-editor` "
            "in a Kubeflow profile namespace, `pipeline-runner` in a standalone install. "
            "`replayrl-pipeline-runner` is the least-privilege account k8s/base/rbac.yaml "
            "creates (only what KFP's launcher and Argo's executor need); name it here once "
            "it is applied to the namespace. `replayrl preflight` checks the account exists."
        },
    )
    trainer_runtime: str = field(
        default="torch-distributed",
        metadata={
            "help": "The Kubeflow Trainer ClusterTrainingRuntime a multi-node trainer's "
            "TrainJob runs on (asynchronous.trainer_nodes > 1): `torch-distributed`, which "
            "the Trainer install ships and whose torch plugin sets torchrun's PET_NNODES, "
            "PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT, or a copy "
            "of it under another name. Its trainer job and container must be named `node`.",
        },
    )
    retries: int = field(
        default=2,
        metadata={
            "range": "[0, inf)",
            "help": "Retries of the idempotent steps (generate, compact, train, evaluate): the "
            "first after kubernetes.retry_backoff_s, then doubling. 0 = no retries. Opening is "
            "not retried (a run that finds the lineage busy must stop, not start the next "
            "iteration a minute later), nor is recording, the commit point.",
        },
    )
    retry_backoff_s: int = field(
        default=60,
        metadata={
            "range": "[0, inf)",
            "help": "Seconds before the first retry of a step; each later one doubles.",
        },
    )
    gpu_step_timeout_s: int = field(
        default=6 * 3600,
        metadata={
            "range": "[0, inf)",
            "help": "Wall-clock limit of one accelerator pod (activeDeadlineSeconds), in "
            "seconds. 0 = none.",
        },
    )
    cpu_step_timeout_s: int = field(
        default=3600,
        metadata={
            "range": "[0, inf)",
            "help": "Wall-clock limit of one CPU pod (activeDeadlineSeconds), in seconds. 0 = none.",
        },
    )
    quick_step_timeout_s: int = field(
        default=900,
        metadata={
            "range": "[0, inf)",
            "help": "Wall-clock limit (activeDeadlineSeconds, counted from when the node "
            "takes the pod: image pull included) of the two quick CPU steps, opening the "
            "lineage (every pipeline's first task) and the exit task that releases it; at most "
            "kubernetes.cpu_step_timeout_s. They use the image, Secrets and ConfigMap of every "
            "other step, so a pod stuck pulling its image (ImagePullBackOff) or missing a "
            "Secret key (CreateContainerConfigError) fails the run within this time, before "
            "any accelerator pod is requested, instead of after cpu_step_timeout_s. It must "
            "cover opening a new lineage: downloading model.source and a hub dataset, then "
            "writing v0 to the run root, about twice the model's size at the slower of the "
            "hub's and the bucket's bandwidth (a 0.5B model ~1 GB: under a minute; a 7B "
            "model ~15 GB: ~10 min at 50 MB/s, so raise it on slower links). "
            "0 = kubernetes.cpu_step_timeout_s.",
        },
    )
    run_as_user: int | None = field(
        default=None,
        metadata={
            "range": "[1, inf)",
            "null": "for the image's own user",
            "help": "UID (and GID) every step's container runs as, with runAsNonRoot: true, "
            "set through kfp-kubernetes' set_security_context: what a Pod Security "
            '"restricted" namespace demands of a pod. The image\'s user is 1000. Needs a KFP '
            "backend >= 2.16: a 2.15 backend refuses the field and no task starts. None = not "
            "set (the image still runs as UID 1000, but admission cannot see it).",
        },
    )
    kueue_queue: str | None = field(
        default=None,
        metadata={
            "help": "Kueue LocalQueue the asynchronous segment's roles (workers, trainer, "
            "evaluator) are queued in, as one pod group (labels kueue.x-k8s.io/queue-name and "
            "pod-group-name, annotation pod-group-total-count): Kueue admits them all or none, "
            "so no role holds accelerators while a peer waits for them. Needs Kueue's pod "
            "integration on the cluster. None = no Kueue labels.",
        },
    )
    lease_ttl_s: int = field(
        default=600,
        metadata={
            "range": "[1, inf)",
            "help": "How long (seconds) a lineage's lease outlives its last renewal. A running "
            "task renews it every third of this (a heartbeat); a run that ends releases it in "
            "its exit task, whatever happened; a run killed without that (a deleted pod, a "
            "terminated workflow) leaves its lineage busy for at most this long. The same run "
            "takes its own expired lease back, so a long wait for the next pod (a GPU node "
            "scaling up) costs nothing unless another run wants the lineage meanwhile.",
        },
    )
    caching: bool = field(
        default=False,
        metadata={
            "help": "KFP caching of step outputs. Off: a step's output lives in storage, not "
            "in KFP, so a cached step would skip real work."
        },
    )
    pipeline_root: str | None = field(
        default=None,
        metadata={
            "help": 'KFP pipeline root of the runs, e.g. "s3://my-bucket/kfp-artifacts": where '
            "KFP keeps each step's small Metrics and Markdown artifacts (the buffer, "
            "checkpoints and state.json live under the run root, never here). Compiled into "
            "the YAML, whose run form in the KFP UI offers it, and sent with every run and "
            "recurring run by `replayrl submit` / `schedule` (a KFP backend reads a run's root "
            "only from the run request). Where the namespace's kfp-launcher ConfigMap has no "
            "s3 `providers` entry (a Kubeflow profile's has none), KFP opens an s3:// root "
            "with the AWS SDK's defaults in the step's environment: the replayrl-s3 keys or "
            "workload identity, AWS_REGION, virtual-hosted addressing. None = the KFP "
            "install's default (kfp-launcher's defaultPipelineRoot, else "
            "minio://mlpipeline/v2/artifacts in KFP's own store)."
        },
    )
    layout: str = field(
        default="task",
        metadata={
            "help": 'How a pipeline lays out the iterations. "task": one accelerator pod runs '
            "kubernetes.iterations_per_task iterations with long-lived workers (one generation "
            "engine, the trainer with its optimizer in memory, the buffer mirrored in memory) "
            "and ends with a full checkpoint; pod start, imports, engine start and checkpoint "
            'download are paid once per task. "step": one pod per step per iteration '
            "(generate, compact, train, evaluate, record), each loading the newest checkpoint; "
            "every iteration writes a full checkpoint."
        },
    )
    iterations_per_task: int = field(
        default=10,
        metadata={
            "range": "(0, inf)",
            "help": 'Iterations one "task" pod runs. replay_loop runs ceil(iterations / '
            "iterations_per_task) tasks; a replay_iteration (recurring) run advances the "
            "lineage by one task. Larger values spread the per-task start-up over more "
            "iterations; a crash redoes at most the iterations since the task's last full "
            "checkpoint (train.checkpoint_every).",
        },
    )

    def check(self) -> None:
        check_ranges(self, "kubernetes")
        if self.layout not in ("task", "step"):
            raise ReplayRLError(f"kubernetes.layout must be 'task' or 'step', got '{self.layout}'.")
        queue = self.kueue_queue
        if queue and (len(queue) > 63 or not _K8S_NAME.fullmatch(queue) or "." in queue):
            raise ReplayRLError(
                f"kubernetes.kueue_queue must be a LocalQueue name (lowercase letters, digits "
                f"and '-', at most 63), got {queue!r}; null = no Kueue labels."
            )
        for name in self.image_pull_secrets:
            if not isinstance(name, str) or len(name) > 253 or not _K8S_NAME.fullmatch(name):
                raise ReplayRLError(
                    f"kubernetes.image_pull_secrets must list Secret names (lowercase letters, "
                    f"digits, '-' and '.'), got {name!r}."
                )
        sc = self.scratch_storage_class
        if sc is not None and (not sc or len(sc) > 253 or not _K8S_NAME.fullmatch(sc)):
            raise ReplayRLError(
                f"kubernetes.scratch_storage_class must be a StorageClass name (lowercase "
                f"letters, digits, '-' and '.'), got {sc!r}; null = an emptyDir."
            )
        rt = self.trainer_runtime
        if not rt or len(rt) > 253 or not _K8S_NAME.fullmatch(rt):
            raise ReplayRLError(
                f"kubernetes.trainer_runtime must be a ClusterTrainingRuntime name (lowercase "
                f"letters, digits, '-' and '.'), got {rt!r}; the Trainer install's is "
                f"torch-distributed."
            )
        sa = self.service_account
        if sa and (len(sa) > 253 or not _K8S_NAME.fullmatch(sa)):
            raise ReplayRLError(
                f"kubernetes.service_account must be a Kubernetes name (lowercase letters, "
                f"digits, '-' and '.', e.g. replayrl-pipeline-runner), got {sa!r}; null = the "
                f"namespace's default account."
            )
