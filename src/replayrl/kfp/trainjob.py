"""A trainer on several nodes: the KFP trainer task as a launcher of a Kubeflow Trainer TrainJob.

With `asynchronous.trainer_nodes` > 1 the `async_segment` pipeline's trainer task is a CPU
pod that creates one TrainJob for its segment (`trainjob_manifest`), waits for it (`launch`)
and ends as it ends: Complete is success, Failed is the task's one error line. The TrainJob's
pods run the trainer ranks: `python -m torch.distributed.run -m RANK_MODULE --config ...
--owner ... --segment-id ...` (`rank_command`), torchrun reading the rendezvous from the PET_*
variables the torch plugin sets. One TrainJob per segment, named after it (`trainjob_name`):
a retried launcher pod finds its own (409 AlreadyExists) and adopts it when its labels say it
is this segment's; one it finds Failed it deletes and creates again (the ranks resume from
the published weights and the buffer, as a retried trainer pod does). SIGTERM (Argo stopping
or terminating the run, the pod's deadline) deletes the TrainJob, with its pods (propagation
Foreground), and exits non-zero; the exit task deletes it too (`delete_for`), and the
owner reference to the run's Argo Workflow has the garbage collector delete it with the
workflow. One line per state change goes to the task's log.

What was read, and where (kubeflow/trainer at v2.3.0, 658725bdae5c7e3a0854d93ac6ff492e109a22ab):

- pkg/apis/trainer/v1alpha1/trainjob_types.go: `TrainJob` (trainer.kubeflow.org/v1alpha1,
  plural trainjobs, namespaced); metadata.name an RFC 1035 label of at most 63 characters
  (CEL rules on the type); spec.runtimeRef {name (required), apiGroup (default
  trainer.kubeflow.org), kind (default ClusterTrainingRuntime)}; spec.trainer {image, command,
  args, env, numNodes, resourcesPerNode, numProcPerNode}; spec.activeDeadlineSeconds (>= 1,
  from the TrainJob's start, reset on resume; Failed with reason DeadlineExceeded past it);
  spec.suspend, spec.managedBy; spec.runtimePatches [{manager (a domain-prefixed path,
  required), trainingRuntimeSpec.template {metadata {labels, annotations}, spec.replicatedJobs
  [{name, template.spec.template {metadata {labels, annotations}, spec: PodSpecPatch}}]}}],
  PodSpecPatch {serviceAccountName, volumes, initContainers, containers [{name, env,
  volumeMounts, securityContext}], imagePullSecrets, securityContext, nodeSelector, affinity,
  tolerations, schedulingGates, terminationGracePeriodSeconds}; status.conditions (types
  Suspended, Complete, Failed) and status.jobsStatus [{name, ready, succeeded, failed, active,
  suspended}]. v2.0 and v2.1 had spec.labels, spec.annotations and podSpecOverrides /
  podTemplateOverrides instead of runtimePatches, and no activeDeadlineSeconds: this launcher
  needs Trainer v2.2 or later.
- pkg/runtime/framework/plugins/jobset/jobset.go (Validate): a patch may name only replicated
  jobs and containers of the runtime, and may set no env on the `node` container (env goes in
  spec.trainer.env); pkg/runtime/framework/plugins/torch/torch.go: spec.trainer.env must not
  set PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, which
  the plugin sets (numNodes; numProcPerNode, else "auto"; the Job completion index;
  `<trainjob>-node-0-0.<trainjob>`; 29500); numNodes replaces the trainer job's count.
- charts/kubeflow-trainer/files/runtimes/torch-distributed.yaml: the `torch-distributed`
  ClusterTrainingRuntime, one replicated job `node` (label trainjob-ancestor-step: trainer)
  with one container `node`.
- manifests/overlays/kubeflow-platform/kubeflow-trainer-roles.yaml: in a Kubeflow platform
  install, `kubeflow-edit` (a profile's default-editor) may create, get and delete trainjobs.

Needs, for the launcher pod's service account: create, get and delete on
trainjobs.trainer.kubeflow.org, get on its own pod (the workflow owner reference and the
image). It polls with get (every `POLL_S`), so it needs no list or watch. Only checked
against a stand-in of the Kubernetes API (tests/pipeline/test_trainjob.py), not a cluster.

Knows nothing about what the ranks compute; imports no `kfp` module (`segment_env` reads the
Secret and ConfigMap keys the other tasks get from `replayrl.kfp.pods`, which does).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

from replayrl.config import KubernetesConfig, RunConfig, load_config
from replayrl.errors import ReplayRLError
from replayrl.kfp import pending_peers
from replayrl.policy.gpu import REQUIRE_GPU_ENV

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"
TRAINJOB = {"group": GROUP, "version": VERSION, "plural": PLURAL}
RUNTIME_KIND = "ClusterTrainingRuntime"
# The trainer's replicated job and container in torch-distributed (and the name the torch
# plugin and the jobset plugin look for).
NODE = "node"
MANAGER = "replayrl.io/launcher"  # the runtimePatches entry this launcher owns
LINEAGE_LABEL = "replayrl.io/lineage"
SEGMENT_LABEL = "replayrl.io/segment"
ISTIO_INJECT = "sidecar.istio.io/inject"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# What the ranks run (written by the in-rank side): torchrun turns PET_* into RANK,
# LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for env:// rendezvous.
RANK_MODULE = "replayrl.kfp.trainjob_rank"
POLL_S = 10.0
SIGTERM_EXIT = 128 + signal.SIGTERM
_TIMEOUT_S = 20
_POLL_ERRORS = 6  # consecutive failed polls before the launcher gives up
_GONE_S = 300.0  # the longest it waits for a Failed TrainJob's foreground deletion
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


def trainjob_name(segment_id: str) -> str:
    """The TrainJob of segment `segment_id`: `replayrl-trainer-<segment id>`."""
    name = f"replayrl-trainer-{segment_id}"
    if len(name) > 63 or not _NAME.fullmatch(name):
        raise ReplayRLError(f"Segment id {segment_id!r} makes no TrainJob name (RFC 1035).")
    return name


def lineage_label(lineage: str) -> str:
    """`lineage` as a label value (63 characters, alphanumeric ends), else a hash of it."""
    if len(lineage) <= 63 and _LABEL_VALUE.fullmatch(lineage):
        return lineage
    return "h-" + hashlib.sha256(lineage.encode()).hexdigest()[:40]


def rank_command(*, config: str, owner: str, segment_id: str) -> tuple[list[str], list[str]]:
    """(command, args) of the TrainJob's trainer container."""
    command = ["python", "-m", "torch.distributed.run"]
    return command, ["-m", RANK_MODULE, "--config", config, "--owner", owner,
                     "--segment-id", segment_id]  # fmt: skip


def segment_env(k: KubernetesConfig, *, gpus_per_node: int) -> list[dict[str, Any]]:
    """The environment of the trainer pods: what the other role pods get, by reference (the
    S3 Secret's keys, MLflow's and the endpoints ConfigMap's when present: no credential is
    copied into the TrainJob), the scratch cache and GPU requirement."""
    from replayrl.kfp import pods

    env: list[dict[str, Any]] = []

    def refs(source: str, name: str | None, keys: dict[str, str], optional: bool) -> None:
        for var, key in keys.items():
            if name:
                ref = {"name": name, "key": key, **({"optional": True} if optional else {})}
                env.append({"name": var, "valueFrom": {source: ref}})

    refs("secretKeyRef", k.s3_secret, pods.S3_SECRET_KEYS, False)
    refs("secretKeyRef", k.mlflow_secret, pods.MLFLOW_SECRET_KEYS, True)
    refs("configMapKeyRef", k.endpoints_config_map, pods.ENDPOINT_KEYS, True)
    if k.scratch_size:
        env.append({"name": "REPLAYRL_CACHE", "value": pods.SCRATCH_CACHE})
        env += [{"name": n, "value": v} for n, v in pods.SCRATCH_COMPILE_CACHES.items()]
    if gpus_per_node > 0:
        env.append({"name": REQUIRE_GPU_ENV, "value": str(gpus_per_node)})
    return env


def _pod_patch(k: KubernetesConfig) -> dict[str, Any]:
    """The trainer pods' spec patch: volumes, placement, pull secrets, security context."""
    from replayrl.kfp import pods

    volumes, mounts = [], []
    if k.shm_size:
        volumes.append({"name": pods.SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                                              "sizeLimit": k.shm_size}})  # fmt: skip
        mounts.append({"name": pods.SHM_VOLUME, "mountPath": "/dev/shm"})
    if k.scratch_size:
        if k.scratch_storage_class:
            claim = {"accessModes": ["ReadWriteOnce"], "storageClassName": k.scratch_storage_class,
                     "resources": {"requests": {"storage": k.scratch_size}}}  # fmt: skip
            volumes.append({"name": pods.SCRATCH_VOLUME,
                            "ephemeral": {"volumeClaimTemplate": {"spec": claim}}})  # fmt: skip
        else:
            volumes.append({"name": pods.SCRATCH_VOLUME, "emptyDir": {"sizeLimit": k.scratch_size}})
        mounts.append({"name": pods.SCRATCH_VOLUME, "mountPath": pods.SCRATCH_MOUNT})
    container: dict[str, Any] = {"name": NODE}
    if mounts:
        container["volumeMounts"] = mounts
    spec: dict[str, Any] = {"containers": [container]}
    if volumes:
        spec["volumes"] = volumes
    if k.gpu_node_selector:
        spec["nodeSelector"] = {key: str(v) for key, v in sorted(k.gpu_node_selector.items())}
    if k.gpu_tolerations:
        spec["tolerations"] = [
            {("tolerationSeconds" if key == "toleration_seconds" else key): v
             for key, v in t.items() if v is not None}
            for t in k.gpu_tolerations
        ]  # fmt: skip
    if k.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in k.image_pull_secrets]
    if k.run_as_user is not None:
        # Pod Security "restricted": non-root, no privilege escalation, no capabilities, the
        # runtime's seccomp profile (what KFP >= 2.16 adds to the other pods itself).
        spec["securityContext"] = {
            "runAsUser": k.run_as_user,
            "runAsGroup": k.run_as_user,
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        container["securityContext"] = {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
    return spec


def trainjob_manifest(
    cfg: RunConfig,
    *,
    name: str,
    namespace: str,
    segment_id: str,
    image: str,
    command: list[str],
    args: list[str],
    env: list[dict[str, Any]],
    deadline_s: int,
    owner: dict[str, Any] | None,
) -> dict[str, Any]:
    """The TrainJob of one segment's trainer: `cfg.asynchronous.trainer_nodes` nodes of T /
    nodes processes, each node with `kubernetes.train_gpus` accelerators per process and the
    accelerator pods' CPU and memory; `deadline_s` its activeDeadlineSeconds (0: none);
    `owner` an owner reference (the run's Argo Workflow) or None. Its pods carry no Istio
    sidecar (NCCL's traffic is not HTTP) and the labels that keep a scale-down from evicting
    them; with `kubernetes.kueue_queue` the TrainJob is queued there (Kueue's TrainJob
    integration), as a workload of its own."""
    from replayrl.kfp import pods

    k, a = cfg.kubernetes, cfg.asynchronous
    procs = a.trainers // a.trainer_nodes
    gpus = k.train_gpus * procs
    requests = {"cpu": k.gpu_step_cpu, "memory": k.gpu_step_memory}
    limits = {"cpu": k.gpu_step_cpu_limit, "memory": k.gpu_step_memory_limit}
    if gpus:
        requests[k.accelerator_type] = limits[k.accelerator_type] = str(gpus)
    labels = {LINEAGE_LABEL: lineage_label(cfg.lineage or ""), SEGMENT_LABEL: segment_id}
    if k.kueue_queue:
        labels[KUEUE_QUEUE_LABEL] = k.kueue_queue
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": labels,
        "annotations": {LINEAGE_LABEL: cfg.lineage or ""},
    }
    if owner:
        metadata["ownerReferences"] = [owner]
    pod_metadata = {
        "labels": {ISTIO_INJECT: "false", SEGMENT_LABEL: segment_id},
        "annotations": {ISTIO_INJECT: "false", pods.SAFE_TO_EVICT: "false",
                        pods.DO_NOT_DISRUPT: "true"},
    }  # fmt: skip
    node_patch = {"name": NODE, "template": {"spec": {"template": {
        "metadata": pod_metadata, "spec": _pod_patch(k)}}}}  # fmt: skip
    spec: dict[str, Any] = {
        "runtimeRef": {"name": k.trainer_runtime, "apiGroup": GROUP, "kind": RUNTIME_KIND},
        "trainer": {
            "image": image,
            "command": command,
            "args": args,
            "env": env,
            "numNodes": a.trainer_nodes,
            "numProcPerNode": procs,
            "resourcesPerNode": {"requests": requests, "limits": limits},
        },
        "runtimePatches": [
            {
                "manager": MANAGER,
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node_patch]}}},
            }
        ],
    }
    if deadline_s > 0:
        spec["activeDeadlineSeconds"] = int(deadline_s)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": metadata, "spec": spec}


def state_of(job: dict[str, Any]) -> tuple[str, str]:
    """(state, message): Failed or Complete (a True condition, Failed first), Suspended,
    else Running (a child Job active) or Created."""
    status = job.get("status") or {}
    true = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    for kind in ("Failed", "Complete", "Suspended"):
        if kind in true:
            c = true[kind]
            return kind, " ".join(str(c.get("message") or c.get("reason") or "").split())
    active = sum(int(j.get("active") or 0) for j in status.get("jobsStatus") or [])
    return ("Running" if active else "Created"), ""


def _api_error(e: Exception) -> str:
    status, reason = getattr(e, "status", None), getattr(e, "reason", None)
    text = f"{status} {reason}" if status else f"{type(e).__name__}: {e}"
    return " ".join(str(text).split())[:200]


def _is(e: Exception, status: int) -> bool:
    return getattr(e, "status", None) == status


def _ours(job: dict[str, Any], manifest: dict[str, Any]) -> bool:
    want, have = manifest["metadata"]["labels"], (job.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == want[k] for k in (LINEAGE_LABEL, SEGMENT_LABEL))


def delete(custom: Any, *, name: str, namespace: str) -> bool:
    """Delete TrainJob `name` and, first, its JobSet, Jobs and pods (Foreground); False when
    it is not there."""
    try:
        custom.delete_namespaced_custom_object(
            **TRAINJOB,
            namespace=namespace,
            name=name,
            propagation_policy="Foreground",
            _request_timeout=_TIMEOUT_S,
        )
    except Exception as e:
        if _is(e, 404):
            return False
        raise
    return True


def _create(custom: Any, manifest: dict[str, Any], where: str) -> dict[str, Any]:
    ns = manifest["metadata"]["namespace"]
    try:
        return custom.create_namespaced_custom_object(
            **TRAINJOB, namespace=ns, body=manifest, _request_timeout=_TIMEOUT_S
        )
    except Exception as e:
        if _is(e, 409):
            raise
        if _is(e, 404):
            fix = "install Kubeflow Trainer v2.2 or later (docs/gpu.md), or set trainer_nodes: 1"
        elif getattr(e, "status", None) in (401, 403):
            fix = "grant the pipeline's service account create, get and delete on trainjobs"
        else:
            fix = (
                f"the API server refused it: {' '.join(str(getattr(e, 'body', '')).split())[:300]}"
            )
        raise ReplayRLError(
            f"Could not create TrainJob {where} ({_api_error(e)}): {fix}. "
            f"asynchronous.trainer_nodes > 1 runs the trainer as a Kubeflow Trainer TrainJob."
        ) from None


def _create_or_adopt(custom: Any, manifest: dict[str, Any], say: Callable[[str], None]) -> dict:
    name, ns = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    where = f"{ns}/{name}"
    try:
        job = _create(custom, manifest, where)
        say(f"trainjob {where}: created ({_shape(manifest)})")
        return job
    except Exception as e:
        if not _is(e, 409):
            raise
    job = custom.get_namespaced_custom_object(
        **TRAINJOB, namespace=ns, name=name, _request_timeout=_TIMEOUT_S
    )
    if not _ours(job, manifest):
        have = (job.get("metadata") or {}).get("labels") or {}
        raise ReplayRLError(
            f"TrainJob {where} exists and is not this segment's (labels {LINEAGE_LABEL}="
            f"{have.get(LINEAGE_LABEL)!r}, {SEGMENT_LABEL}={have.get(SEGMENT_LABEL)!r}): delete "
            f"it (kubectl delete trainjob -n {ns} {name}) and retry the run."
        )
    state, _ = state_of(job)
    if state != "Failed":
        say(f"trainjob {where}: adopted, this segment's from an earlier attempt ({state})")
        return job
    # A Failed one from an earlier attempt: the ranks resume from the published weights.
    say(f"trainjob {where}: an earlier attempt's failed; deleting it and creating it again")
    delete(custom, name=name, namespace=ns)
    end = time.monotonic() + _GONE_S
    while time.monotonic() < end:
        try:
            job = _create(custom, manifest, where)
            say(f"trainjob {where}: created again ({_shape(manifest)})")
            return job
        except Exception as e:
            if not _is(e, 409):
                raise
        time.sleep(1.0)
    raise ReplayRLError(f"TrainJob {where} was not deleted within {_GONE_S:.0f} s; retry the run.")


def _shape(manifest: dict[str, Any]) -> str:
    t = manifest["spec"]["trainer"]
    return (
        f"{t['numNodes']} nodes x {t['numProcPerNode']} processes, "
        f"runtime {manifest['spec']['runtimeRef']['name']}"
    )


@contextlib.contextmanager
def _delete_on_sigterm(
    custom: Any, *, name: str, namespace: str, say: Callable[[str], None]
) -> Iterator[None]:
    """While the block runs (in the main thread), SIGTERM deletes the TrainJob and exits
    SIGTERM_EXIT: a stopped or terminated run leaves no trainer pods holding accelerators."""

    def handler(signum, frame):
        try:
            gone = delete(custom, name=name, namespace=namespace)
            say(f"trainjob {namespace}/{name}: SIGTERM, " + ("deleted" if gone else "not there"))
        except Exception as e:
            say(f"trainjob {namespace}/{name}: SIGTERM, could not delete it ({_api_error(e)})")
        raise SystemExit(SIGTERM_EXIT)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: the caller handles its own signals
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch(
    manifest: dict[str, Any],
    *,
    custom: Any,
    deadline_s: float | None = None,
    poll_s: float = POLL_S,
    should_stop: Callable[[], str | None] | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> dict[str, Any]:
    """Create the TrainJob (or adopt this segment's, `_create_or_adopt`) through
    CustomObjectsApi `custom` and wait until it is Complete (returns it) or Failed
    (ReplayRLError with its condition's message). Past `deadline_s` (None: no limit), or
    once `should_stop` (asked every poll) gives a reason, such as the segment given up while
    the TrainJob waits for a queue or nodes, it deletes the TrainJob and raises. SIGTERM
    deletes it and exits SIGTERM_EXIT."""
    name, ns = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    where = f"{ns}/{name}"
    started = time.monotonic()
    with _delete_on_sigterm(custom, name=name, namespace=ns, say=say):
        job = _create_or_adopt(custom, manifest, say)
        previous, errors = state_of(job)[0], 0  # said by _create_or_adopt
        while True:
            state, message = state_of(job)
            if state != previous:
                say(f"trainjob {where}: {state}" + (f": {message}" if message else ""))
                previous = state
            if state == "Complete":
                return job
            if state == "Failed":
                raise ReplayRLError(
                    f"TrainJob {where} failed: {message or 'no message'}. Its pods' logs: "
                    f"kubectl logs -n {ns} -l jobset.sigs.k8s.io/jobset-name={name} --prefix."
                )
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                delete(custom, name=name, namespace=ns)
                raise ReplayRLError(
                    f"TrainJob {where} did not finish within {deadline_s:.0f} s "
                    f"(kubernetes.gpu_step_timeout_s; it was {state}): deleted it."
                )
            reason = _stop_reason(should_stop)
            if reason:
                delete(custom, name=name, namespace=ns)
                raise ReplayRLError(f"Deleted TrainJob {where} ({state}): {reason}")
            time.sleep(poll_s)
            try:
                job = custom.get_namespaced_custom_object(
                    **TRAINJOB, namespace=ns, name=name, _request_timeout=_TIMEOUT_S
                )
                errors = 0
            except Exception as e:
                if _is(e, 404):
                    raise ReplayRLError(
                        f"TrainJob {where} was deleted while it ran ({state}); retry the run."
                    ) from None
                errors += 1
                if errors >= _POLL_ERRORS:
                    raise ReplayRLError(
                        f"Could not read TrainJob {where} {errors} times in a row "
                        f"({_api_error(e)}); it is left running for the exit task to delete."
                    ) from None


def _stop_reason(should_stop: Callable[[], str | None] | None) -> str | None:
    if should_stop is None:
        return None
    try:
        return should_stop()
    except Exception as e:  # a failed look (S3 unreachable for a moment) is no reason
        log.warning("could not check whether to stop the TrainJob (%s)", _api_error(e))
        return None


def _identity() -> tuple[str, str]:
    here = pending_peers._in_cluster()
    if here is None:
        raise ReplayRLError(
            "asynchronous.trainer_nodes > 1 launches the trainer as a Kubeflow TrainJob from "
            "a Kubeflow pod; outside one (kfp.local, this machine) use trainer_nodes: 1."
        )
    return here


def workflow_owner(pod: Any) -> dict[str, Any] | None:
    """An owner reference to the Argo Workflow that owns `pod` (Argo puts one on every pod
    it creates), not blocking the workflow's deletion; None when the pod has none."""
    for ref in pod.metadata.owner_references or []:
        if ref.kind == "Workflow" and ref.api_version.startswith("argoproj.io/"):
            return {"apiVersion": ref.api_version, "kind": ref.kind, "name": ref.name,
                    "uid": ref.uid, "controller": False, "blockOwnerDeletion": False}  # fmt: skip
    return None


def _own_image(pod: Any) -> str:
    containers = pod.spec.containers or []
    main = next((c for c in containers if c.name == "main"), containers[0] if containers else None)
    if main is None or not main.image:
        raise ReplayRLError("This pod names no container image for the TrainJob's pods.")
    return main.image


def launch_trainer(
    *, config: str, owner: str, segment_id: str, poll_s: float = POLL_S
) -> dict[str, Any]:
    """The launcher task's body: segment `segment_id` of run `owner` on
    `asynchronous.trainer_nodes` nodes, from inside its KFP pod (this pod's image, namespace,
    workflow). Returns the finished TrainJob."""
    from kubernetes import client

    from replayrl import storage
    from replayrl.engine.asynchronous import peers

    cfg = load_config(text=config)
    if cfg.asynchronous.trainer_nodes < 2:
        raise ReplayRLError("launch_trainer is for asynchronous.trainer_nodes > 1.")
    pod_name, namespace = _identity()
    api = pending_peers._api_client()
    try:
        pod = client.CoreV1Api(api).read_namespaced_pod(
            pod_name, namespace, _request_timeout=_TIMEOUT_S
        )
    except Exception as e:
        raise ReplayRLError(
            f"The trainer launcher could not read its own pod {namespace}/{pod_name} "
            f"({_api_error(e)}): its service account needs get on pods."
        ) from None
    wf = workflow_owner(pod)
    if wf is None:
        log.warning(
            "pod %s has no Workflow owner: only the exit task deletes the TrainJob", pod_name
        )
    k = cfg.kubernetes
    command, args = rank_command(config=config, owner=owner, segment_id=segment_id)
    procs = cfg.asynchronous.trainers // cfg.asynchronous.trainer_nodes
    manifest = trainjob_manifest(
        cfg,
        name=trainjob_name(segment_id),
        namespace=namespace,
        segment_id=segment_id,
        image=_own_image(pod),
        command=command,
        args=args,
        env=segment_env(k, gpus_per_node=k.train_gpus * procs),
        deadline_s=k.gpu_step_timeout_s,
        owner=wf,
    )
    deadline = float(k.gpu_step_timeout_s) if k.gpu_step_timeout_s > 0 else None
    paths = storage.paths_of(cfg)
    return launch(
        manifest,
        custom=client.CustomObjectsApi(api),
        deadline_s=deadline,
        poll_s=poll_s,
        # Given up (a worker or the evaluator did not start): the ranks, if any run, stop on
        # their own; a TrainJob still queued or Pending would wait for ever.
        should_stop=lambda: peers.abandoned_reason(paths, segment_id),
    )


def trainer_numbers(config: str) -> dict[str, Any]:
    """The trainer's numbers on the board after its TrainJob ended (for the KFP UI), as the
    one-host trainer task reports them."""
    from replayrl import storage
    from replayrl.engine.asynchronous import board
    from replayrl.kfp.async_runtime import _numbers

    status = board.read_trainer(storage.paths_of(load_config(text=config)))
    return {"final_step": status.gradient_step, **_numbers(status)}


def delete_for(segment_id: str, *, custom: Any = None, namespace: str | None = None) -> bool:
    """The exit task's clean-up: delete segment `segment_id`'s TrainJob (Foreground) when it
    is there and its label says it is this segment's. True when one was deleted. Best effort:
    outside a pod, or on any failure (logged as one warning), it returns False; never raises,
    so the exit task still releases the lineage."""
    name = trainjob_name(segment_id)
    try:
        if custom is None or namespace is None:
            here = pending_peers._in_cluster()
            if here is None:
                return False
            from kubernetes import client

            namespace = namespace or here[1]
            custom = custom or client.CustomObjectsApi(pending_peers._api_client())
        job = custom.get_namespaced_custom_object(
            **TRAINJOB, namespace=namespace, name=name, _request_timeout=_TIMEOUT_S
        )
        if ((job.get("metadata") or {}).get("labels") or {}).get(SEGMENT_LABEL) != segment_id:
            log.warning(
                "TrainJob %s/%s is not segment %s's: left alone", namespace, name, segment_id
            )
            return False
        return delete(custom, name=name, namespace=namespace)
    except Exception as e:
        if _is(e, 404):
            return False
        log.warning(
            "could not delete TrainJob %s/%s (%s): delete it by hand (kubectl delete trainjob "
            "-n %s %s); the lineage is released all the same",
            namespace, name, _api_error(e), namespace, name,
        )  # fmt: skip
        return False
