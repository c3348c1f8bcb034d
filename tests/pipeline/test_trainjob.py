"""The trainer launcher (`replayrl.kfp.trainjob`): with asynchronous.trainer_nodes > 1 the KFP
trainer task creates a Kubeflow Trainer TrainJob, waits for it, adopts its own after a retry
(409), deletes it on SIGTERM and in the exit task.

STAND-IN: the Kubernetes API is `k8s_standin` (NOT Kubernetes, NOT Kubeflow Trainer: every
request is checked against the operations and models of the `kubernetes` client; no
controller runs, so a test sets the TrainJob's status itself, as the Trainer controller
would). A created TrainJob is held to `trainjob_faults`, the TrainJob schema written here by
hand from kubeflow/trainer v2.3.0's pkg/apis/trainer/v1alpha1/trainjob_types.go (fields,
required ones, minimums, the name's CEL rules) and the validations of its webhooks (torch
plugin: no PET_* in trainer.env; jobset plugin: patches name only the runtime's `node` job
and container, set no env on it, a domain-prefixed manager). Kubernetes' own types in it
(EnvVar, ResourceRequirements, Volume, ...) are checked against the `kubernetes` client's
models. Whether a real Trainer controller runs these pods was not checked here."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from k8s_standin import TRAINJOBS, KubeState, Violation, deserialize, kubeconfig, serve
from kubernetes import client
from kubernetes import config as kube_config

from replayrl.config import load_config
from replayrl.errors import ReplayRLError
from replayrl.kfp import pending_peers, trainjob

pytestmark = pytest.mark.pipeline

NS, SEGMENT = "team-a", "0a1b2c3d4e5f"
NAME = trainjob.trainjob_name(SEGMENT)
RUN = "async-segment-x7k2p"
ME = f"{RUN}-system-container-impl-1111"
IMAGE = "registry.example.com/replayrl:0.3.0"
CONFIG = """
storage: {lineage: gsm8k-async-replay-s0}
asynchronous: {enabled: true, trainers: 4, trainer_nodes: 2}
kubernetes:
  train_gpus: 1
  s3_secret: replayrl-s3
  mlflow_secret: replayrl-mlflow
  endpoints_config_map: replayrl-endpoints
  run_as_user: 1000
  kueue_queue: gpu-queue
  scratch_storage_class: local-nvme
  image_pull_secrets: [regcred]
  gpu_tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
  gpu_node_selector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}
"""

# ---------------------------------------------------------------- the TrainJob schema

PET = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
_RFC1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAP = "map"  # a map of strings (labels, annotations, nodeSelector)


def _o(required=(), **props):
    return {"required": set(required), "props": props}


LABELS = _o(labels=MAP, annotations=MAP)
CONTAINER_PATCH = _o(
    ["name"], name=str, env=["V1EnvVar"], volumeMounts=["V1VolumeMount"],
    securityContext="V1SecurityContext",
)  # fmt: skip
POD_SPEC_PATCH = _o(
    serviceAccountName=str, volumes=["V1Volume"], initContainers=[CONTAINER_PATCH],
    containers=[CONTAINER_PATCH], imagePullSecrets=["V1LocalObjectReference"],
    securityContext="V1PodSecurityContext", nodeSelector=MAP, affinity="V1Affinity",
    tolerations=["V1Toleration"], schedulingGates=["V1PodSchedulingGate"],
    terminationGracePeriodSeconds=(int, 0),
)  # fmt: skip
REPLICATED_JOB_PATCH = _o(
    ["name"], name=str,
    template=_o(metadata=LABELS, spec=_o(template=_o(metadata=LABELS, spec=POD_SPEC_PATCH))),
)  # fmt: skip
RUNTIME_PATCH = _o(
    ["manager"], manager=str, time=str,
    trainingRuntimeSpec=_o(template=_o(metadata=LABELS, spec=_o(replicatedJobs=[REPLICATED_JOB_PATCH]))),
)  # fmt: skip
TRAINER = _o(
    image=str, command=[str], args=[str], env=["V1EnvVar"], numNodes=(int, 0),
    resourcesPerNode="V1ResourceRequirements", numProcPerNode=(int, 1),
)  # fmt: skip
TRAINJOB = _o(
    ["apiVersion", "kind", "metadata", "spec"],
    apiVersion=str, kind=str, metadata="V1ObjectMeta",
    spec=_o(
        ["runtimeRef"],
        runtimeRef=_o(["name"], name=str, apiGroup=str, kind=str),
        initializer=_o(dataset=object, model=object), trainer=TRAINER,
        runtimePatches=[RUNTIME_PATCH], suspend=bool, activeDeadlineSeconds=(int, 1),
        managedBy=str,
    ),
    status=object,
)  # fmt: skip


def _faults(value, schema, where: str) -> list[str]:
    if schema is object:
        return []
    if schema is MAP:
        ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
        return [] if ok else [f"{where}: expected a map of strings"]
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [f for i, v in enumerate(value) for f in _faults(v, schema[0], f"{where}[{i}]")]
    if isinstance(schema, str):  # a Kubernetes type
        try:
            deserialize(value, schema)
        except Violation as e:
            return [f"{where}: {e}"]
        return []
    if isinstance(schema, tuple):  # an integer with a minimum
        if not isinstance(value, int) or isinstance(value, bool) or value < schema[1]:
            return [f"{where}: expected an integer >= {schema[1]}, got {value!r}"]
        return []
    if schema in (str, bool):
        return [] if isinstance(value, schema) else [f"{where}: expected {schema.__name__}"]
    if not isinstance(value, dict):
        return [f"{where}: expected an object"]
    faults = [f"{where}.{k}: required" for k in sorted(schema["required"] - set(value))]
    for key, item in value.items():
        if key not in schema["props"]:
            faults.append(f"{where}: unknown field {key!r}")
        else:
            faults += _faults(item, schema["props"][key], f"{where}.{key}")
    return faults


def trainjob_faults(job: dict) -> list[str]:
    """What the API server (the CRD's schema and CEL rules) and the Trainer's webhooks would
    refuse in TrainJob `job`; [] when nothing."""
    faults = _faults(job, TRAINJOB, "TrainJob")
    if faults:
        return faults
    if job["apiVersion"] != "trainer.kubeflow.org/v1alpha1" or job["kind"] != "TrainJob":
        faults.append("not a trainer.kubeflow.org/v1alpha1 TrainJob")
    name = job["metadata"].get("name", "")
    if len(name) > 63 or not _RFC1035.fullmatch(name):
        faults.append(f"metadata.name {name!r} must be an RFC 1035 label of at most 63")
    if not job["spec"]["runtimeRef"]["name"]:
        faults.append("spec.runtimeRef.name: at least 1 character")
    reserved = {e["name"] for e in job["spec"].get("trainer", {}).get("env", [])} & PET
    if reserved:
        faults.append(f"spec.trainer.env: must not have reserved envs {sorted(reserved)}")
    for patch in job["spec"].get("runtimePatches", []):
        if "/" not in patch["manager"]:
            faults.append(f"manager {patch['manager']!r} must be a domain-prefixed path")
        spec = patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {})
        for rjob in spec.get("replicatedJobs", []):
            if rjob["name"] != "node":
                faults.append(f"replicated job {rjob['name']!r} is not in torch-distributed")
            pod = rjob.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                if c["name"] != "node" or c.get("env"):
                    faults.append(f"container patch {c['name']!r}: no such container, or env")
    return faults


# ---------------------------------------------------------------- fixtures


@pytest.fixture
def kube(tmp_path):
    state = KubeState()
    state.validators[TRAINJOBS] = trainjob_faults
    with serve(state) as url:
        path = kubeconfig(url, state.token, tmp_path / "kubeconfig")
        state.kubeconfig = path  # type: ignore[attr-defined]
        yield state
    assert state.rejected == [], "requests outside the Kubernetes API"


def custom_api(path: Path):
    return client.CustomObjectsApi(
        kube_config.new_client_from_config(str(path), persist_config=False)
    )


def launch(state: KubeState, job: dict, **kwargs):
    """`trainjob.launch` against the stand-in, never waiting more than 10 s."""
    kwargs = {"poll_s": 0.02, "deadline_s": 10.0, "say": lambda _: None, **kwargs}
    return trainjob.launch(job, custom=custom_api(state.kubeconfig), **kwargs)


def manifest(cfg=None, *, segment=SEGMENT, owner=None, deadline_s=3600):
    cfg = cfg or load_config(text=CONFIG)
    command, args = trainjob.rank_command(config="{}", owner="run-1", segment_id=segment)
    return trainjob.trainjob_manifest(
        cfg,
        name=trainjob.trainjob_name(segment),
        namespace=NS,
        segment_id=segment,
        image=IMAGE,
        command=command,
        args=args,
        env=trainjob.segment_env(cfg.kubernetes, gpus_per_node=2),
        deadline_s=deadline_s,
        owner=owner,
    )


def jobs(state: KubeState) -> dict:
    return state.namespaced[TRAINJOBS]


def drive(state: KubeState, *statuses: dict, name: str = NAME, after_s: float = 0.05):
    """As the Trainer controller would: once TrainJob `name` exists, set each status in turn."""

    def run():
        for _ in range(400):  # one this launcher created, or an earlier attempt's it adopts
            found = jobs(state).get((NS, name))
            if found and not (found["metadata"]["uid"] == "earlier" and "Failed" in str(found)):
                break
            time.sleep(0.01)
        for status in statuses:
            time.sleep(after_s)
            if (NS, name) in jobs(state):  # a whole new object: the server may be reading it
                jobs(state)[(NS, name)] = {**jobs(state)[(NS, name)], "status": status}

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


RUNNING = {"jobsStatus": [{"name": "node", "ready": 2, "succeeded": 0, "failed": 0,
                           "active": 2, "suspended": 0}]}  # fmt: skip


def condition(kind: str, message: str) -> dict:
    return {"conditions": [{"type": kind, "status": "True", "reason": kind, "message": message,
                            "lastTransitionTime": "2026-01-01T00:00:00Z"}]}  # fmt: skip


def posts(state: KubeState) -> list[str]:
    return [r for r in state.requests if r.startswith("POST ")]


# ---------------------------------------------------------------- the manifest


def test_the_trainjob_holds_to_the_schema_and_carries_the_segment():
    job = manifest(owner={"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                          "name": RUN, "uid": "wf-uid", "controller": False,
                          "blockOwnerDeletion": False})  # fmt: skip
    assert trainjob_faults(job) == []
    spec, trainer = job["spec"], job["spec"]["trainer"]
    assert spec["runtimeRef"] == {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                                  "kind": "ClusterTrainingRuntime"}  # fmt: skip
    # T = 4 over 2 nodes: 2 processes and 2 accelerators (train_gpus 1 each) per node.
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 2)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "2"
    assert trainer["command"] == ["python", "-m", "torch.distributed.run"]
    assert trainer["args"][:2] == ["-m", trainjob.RANK_MODULE]
    assert spec["activeDeadlineSeconds"] == 3600
    meta = job["metadata"]
    assert meta["labels"][trainjob.SEGMENT_LABEL] == SEGMENT
    assert meta["labels"][trainjob.LINEAGE_LABEL] == "gsm8k-async-replay-s0"
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert meta["ownerReferences"][0]["uid"] == "wf-uid"
    # Credentials by reference only, never their values.
    env = {e["name"]: e for e in trainer["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "replayrl-s3"
    assert env["MLFLOW_TRACKING_URI"]["valueFrom"]["configMapKeyRef"]["optional"] is True
    assert env["REPLAYRL_REQUIRE_GPU"]["value"] == "2"
    pod = spec["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod = pod["template"]["spec"]["template"]
    assert pod["metadata"]["labels"][trainjob.ISTIO_INJECT] == "false"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"dshm", "scratch"}


def test_the_schema_refuses_what_the_api_server_would():
    job = manifest()
    del job["spec"]["runtimeRef"]["name"]
    job["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "3"})
    job["spec"]["trainer"]["numProcPerNode"] = 0
    job["spec"]["podTemplateOverrides"] = []  # v2.1's field, gone in v2.2
    faults = trainjob_faults(job)
    assert any("runtimeRef.name: required" in f for f in faults)
    assert any("numProcPerNode" in f for f in faults)
    assert any("podTemplateOverrides" in f for f in faults)
    job = manifest()
    job["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "3"})
    assert trainjob_faults(job) == ["spec.trainer.env: must not have reserved envs ['PET_NNODES']"]
    job = manifest()
    job["metadata"]["name"] = "Replayrl_Trainer"
    assert any("RFC 1035" in f for f in trainjob_faults(job))


def test_a_long_lineage_name_becomes_a_valid_label():
    long = "x" * 100
    assert len(trainjob.lineage_label(long)) <= 63
    assert trainjob.lineage_label(long) != trainjob.lineage_label(long + "y")
    assert trainjob.lineage_label("ok-name.1") == "ok-name.1"


# ---------------------------------------------------------------- conditions drive it


def test_conditions_drive_it_to_success(kube):
    lines: list[str] = []
    drive(kube, RUNNING, condition("Complete", "jobset completed"))
    job = launch(kube, manifest(), say=lines.append)
    assert trainjob.state_of(job)[0] == "Complete"
    assert [line.split(": ", 1)[1].split(" (")[0] for line in lines] == [
        "created",
        "Running",
        "Complete: jobset completed",
    ]
    assert len(posts(kube)) == 1 and kube.deletions == []


def test_conditions_drive_it_to_failure_with_the_conditions_message(kube):
    drive(kube, RUNNING, condition("Failed", "jobset failed: node-0 exited 1"))
    with pytest.raises(ReplayRLError, match=r"failed: jobset failed: node-0 exited 1\. Its pods"):
        launch(kube, manifest())
    assert (NS, NAME) in jobs(kube), "left for its logs; the exit task deletes it"


def test_past_its_deadline_it_is_deleted(kube):
    with pytest.raises(ReplayRLError, match="did not finish within 0 s"):
        launch(kube, manifest(), deadline_s=0.1)
    assert jobs(kube) == {}
    assert kube.deletions == [(NS, NAME, {"propagationPolicy": "Foreground"})]


def test_a_segment_given_up_while_it_waits_deletes_it(kube):
    polls = iter([None, None, "worker 1 had not started within 1800 s"])
    with pytest.raises(ReplayRLError, match=r"Deleted TrainJob .* \(Suspended\): worker 1 had"):
        drive(kube, condition("Suspended", "queued in gpu-queue"), after_s=0.0)
        launch(kube, manifest(), should_stop=lambda: next(polls, "x"), poll_s=0.1)
    assert jobs(kube) == {}
    assert kube.deletions == [(NS, NAME, {"propagationPolicy": "Foreground"})]


def test_a_refused_trainjob_is_one_line(kube):
    job = manifest()
    job["spec"]["trainer"]["env"].append({"name": "PET_MASTER_PORT", "value": "1"})
    with pytest.raises(ReplayRLError, match=r"Could not create TrainJob .*422 .*reserved envs"):
        launch(kube, job)
    kube.namespaced.pop(TRAINJOBS)  # the CRD not installed
    with pytest.raises(ReplayRLError, match="install Kubeflow Trainer v2.2 or later"):
        launch(kube, manifest())


# ---------------------------------------------------------------- 409: a retried launcher


def _existing(status: dict, *, segment: str = SEGMENT) -> dict:
    job = manifest(segment=SEGMENT)
    job["metadata"]["labels"][trainjob.SEGMENT_LABEL] = segment
    job["metadata"]["uid"] = "earlier"
    return {**job, "status": status}


def test_a_retried_launcher_adopts_its_segments_trainjob(kube):
    jobs(kube)[(NS, NAME)] = _existing(RUNNING)
    lines: list[str] = []
    drive(kube, condition("Complete", "done"))
    launch(kube, manifest(), say=lines.append)
    assert "adopted" in lines[0]
    assert jobs(kube)[(NS, NAME)]["metadata"]["uid"] == "earlier", "the same TrainJob"
    assert kube.deletions == []


def test_an_earlier_attempts_failed_trainjob_is_replaced(kube):
    jobs(kube)[(NS, NAME)] = _existing(condition("Failed", "OOMKilled"))
    drive(kube, condition("Complete", "done"), after_s=0.2)
    lines: list[str] = []
    launch(kube, manifest(), say=lines.append)
    assert kube.deletions == [(NS, NAME, {"propagationPolicy": "Foreground"})]
    assert jobs(kube)[(NS, NAME)]["metadata"]["uid"] != "earlier"
    assert "created again" in lines[1]


def test_another_segments_trainjob_of_that_name_is_refused_and_left_alone(kube):
    jobs(kube)[(NS, NAME)] = other = _existing(RUNNING, segment="ffffffffffff")
    with pytest.raises(ReplayRLError, match="exists and is not this segment's") as e:
        launch(kube, manifest())
    assert "\n" not in str(e.value)
    assert jobs(kube)[(NS, NAME)] is other and kube.deletions == []


# ---------------------------------------------------------------- SIGTERM and the exit task

CHILD = """
import json, sys
from kubernetes import client, config
from replayrl.kfp import trainjob
api = client.CustomObjectsApi(config.new_client_from_config(sys.argv[1], persist_config=False))
trainjob.launch(json.loads(sys.argv[2]), custom=api, poll_s=0.05)
"""


def test_sigterm_deletes_the_trainjob_and_exits_non_zero(kube):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(kube.kubeconfig), json.dumps(manifest())],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for _ in range(300):
            if (NS, NAME) in jobs(kube) and len(kube.requests) >= 2:  # created, and polled
                break
            time.sleep(0.05)
        assert (NS, NAME) in jobs(kube), child.communicate(timeout=5)[0]
        os.kill(child.pid, signal.SIGTERM)
        out, _ = child.communicate(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == trainjob.SIGTERM_EXIT, out
    assert "SIGTERM, deleted" in out
    assert jobs(kube) == {}
    assert kube.deletions == [(NS, NAME, {"propagationPolicy": "Foreground"})]


def test_the_exit_task_deletes_only_its_segments_trainjob(kube):
    api = custom_api(kube.kubeconfig)
    assert trainjob.delete_for(SEGMENT, custom=api, namespace=NS) is False  # none there
    jobs(kube)[(NS, NAME)] = _existing(RUNNING)
    assert trainjob.delete_for(SEGMENT, custom=api, namespace=NS) is True
    assert jobs(kube) == {}
    jobs(kube)[(NS, NAME)] = _existing(RUNNING, segment="ffffffffffff")
    assert trainjob.delete_for(SEGMENT, custom=api, namespace=NS) is False
    assert (NS, NAME) in jobs(kube)
    assert trainjob.delete_for(SEGMENT) is False, "outside a pod: nothing to do"


# ---------------------------------------------------------------- from inside the KFP pod


def test_the_launcher_pod_owns_the_trainjob_by_its_workflow_and_image(kube, tmp_path, monkeypatch):
    kube.add({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": ME, "namespace": NS, "labels": {pending_peers.WORKFLOW_LABEL: RUN},
            "ownerReferences": [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                                 "name": RUN, "uid": "wf-uid-1", "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "spec": {"containers": [{"name": "wait", "image": "argoexec:v3.5"},
                                {"name": "main", "image": IMAGE}]},
    })  # fmt: skip
    namespace_file = tmp_path / "namespace"
    namespace_file.write_text(NS)
    monkeypatch.setattr(pending_peers, "POD_NAMESPACE_FILE", str(namespace_file))
    monkeypatch.setattr(
        pending_peers,
        "_api_client",
        lambda: kube_config.new_client_from_config(str(kube.kubeconfig), persist_config=False),
    )
    monkeypatch.setenv("KFP_POD_NAME", ME)
    config = json.dumps({"storage": {"lineage": "l1"}, "asynchronous": {"enabled": True, "trainers": 2,
                                                            "trainer_nodes": 2}})  # fmt: skip
    drive(kube, condition("Complete", "done"))
    job = trainjob.launch_trainer(config=config, owner="run-1", segment_id=SEGMENT, poll_s=0.02)
    assert job["metadata"]["ownerReferences"] == [
        {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": RUN,
         "uid": "wf-uid-1", "controller": False, "blockOwnerDeletion": False}
    ]  # fmt: skip
    assert job["spec"]["trainer"]["image"] == IMAGE
    assert job["spec"]["trainer"]["args"][-2:] == ["--segment-id", SEGMENT]
    assert job["spec"]["activeDeadlineSeconds"] == 6 * 3600  # kubernetes.gpu_step_timeout_s
    with pytest.raises(ReplayRLError, match="launch_trainer is for asynchronous.trainer_nodes > 1"):
        trainjob.launch_trainer(config="{}", owner="run-1", segment_id=SEGMENT)


def test_the_launcher_component_compiles_as_the_trainer_task_and_refuses_kfp_local(tmp_path):
    from kfp import compiler, dsl

    from replayrl.kfp.trainjob_component import async_trainer

    @dsl.pipeline(name="launcher")
    def launcher():  # no parameters: this module's annotations are strings
        async_trainer(config="{}", owner="run-1", segment_id=SEGMENT)

    out = tmp_path / "launcher.yaml"
    compiler.Compiler().compile(launcher, str(out))
    spec = out.read_text()
    assert "async-trainer" in spec and "trainjob.launch_trainer" in spec
    # Outside a Kubeflow pod: one line, no traceback (user_errors_as_exit).
    config = json.dumps({"asynchronous": {"enabled": True, "trainers": 2, "trainer_nodes": 2}})
    with pytest.raises(SystemExit, match="from a Kubeflow pod"):
        async_trainer.python_func(config=config, owner="run-1", segment_id=SEGMENT, metrics=None)
