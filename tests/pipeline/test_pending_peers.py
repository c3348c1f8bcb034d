"""A given-up segment whose peer pod stays Pending still ends its run: the role that stops
stops its run's Argo workflow (`spec.shutdown: Stop`: Argo fails the pending nodes and still
runs the exit task), and a role that starts after the segment was given up stops at once.

STAND-IN: the Kubernetes API is `k8s_standin` (NOT Kubernetes: every request is checked
against the operations and models of the `kubernetes` client, and the workflow patch is
kept). The board is the real local one; the roles are the real `Peers` and the Kubeflow task
body `async_runtime.async_role`. The pod's in-cluster identity (its name, namespace file and
service-account client) is pointed at the stand-in."""

from __future__ import annotations

import logging
import time

import pytest
from k8s_standin import KubeState, kubeconfig, serve
from kfp import compiler
from kubernetes import config as kube_config
from test_kfp_async import tiny_async
from test_kfp_compile import parse

from replayrl import storage
from replayrl.config import load_config
from replayrl.engine.asynchronous import board, peers
from replayrl.kfp import async_runtime, pending_peers, runtime
from replayrl.kfp.async_pipeline import async_segment_pipeline

pytestmark = pytest.mark.pipeline

NS = "team-a"
RUN, OTHER = "async-segment-x7k2p", "async-segment-q9w8e"
ME = f"{RUN}-system-container-impl-1111"  # this role's pod: worker 0


def pod(name: str, workflow: str, node: str, phase: str) -> dict:
    """A pod as Argo creates it for a KFP task: the workflow label, the node-name annotation."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                pending_peers.WORKFLOW_LABEL: workflow,
                "workflows.argoproj.io/completed": "false",
            },
            "annotations": {
                pending_peers.NODE_NAME_ANNOTATION: f"{workflow}.exit-handler-1.{node}",
                "workflows.argoproj.io/node-id": f"{name}-id",
            },
        },
        "spec": {"containers": [{"name": "main", "image": "registry.example.com/replayrl:1"}]},
        "status": {"phase": phase},
    }


def workflow(name: str) -> dict:
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": name}}


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A namespace with two runs of async_segment: in RUN, this worker runs, the evaluator
    runs, the trainer and worker 1 are Pending (and so is a driver pod); in OTHER, a trainer
    is Pending. This process is pod ME, its client the stand-in's."""
    state = KubeState()
    for p in (
        pod(ME, RUN, "async-worker.executor(0)", "Running"),
        pod(f"{RUN}-system-container-impl-2222", RUN, "async-worker-2.executor(0)", "Pending"),
        pod(f"{RUN}-system-container-impl-3333", RUN, "async-trainer.executor(0)", "Pending"),
        pod(f"{RUN}-system-container-impl-4444", RUN, "async-evaluator.executor(0)", "Running"),
        pod(f"{RUN}-system-container-driver-5555", RUN, "async-trainer-driver", "Pending"),
        pod(f"{OTHER}-system-container-impl-6666", OTHER, "async-trainer.executor", "Pending"),
    ):
        state.add(p)
    state.workflows = {(NS, RUN): workflow(RUN), (NS, OTHER): workflow(OTHER)}
    namespace_file = tmp_path / "namespace"
    namespace_file.write_text(NS)
    with serve(state) as url:
        path = kubeconfig(url, state.token, tmp_path / "kubeconfig")
        monkeypatch.setattr(pending_peers, "POD_NAMESPACE_FILE", str(namespace_file))
        monkeypatch.setattr(
            pending_peers,
            "_api_client",
            lambda: kube_config.new_client_from_config(str(path), persist_config=False),
        )
        # The pod's name from HOSTNAME (KFP_POD_NAME would make the roles refuse a local run
        # root, as they do in a pod).
        monkeypatch.delenv("KFP_POD_NAME", raising=False)
        monkeypatch.setenv("HOSTNAME", ME)
        yield state
    assert state.rejected == [], "requests outside the Kubernetes API"


STOP = [(NS, RUN, {"spec": {"shutdown": "Stop"}})]
PENDING_PEERS = [f"{RUN}-system-container-impl-2222", f"{RUN}-system-container-impl-3333"]


def test_the_role_that_gives_up_stops_its_run_when_peers_are_pending(cluster, tmp_path):
    cfg = load_config(
        text=tiny_async(tmp_path, "asynchronous.workers=2", "asynchronous.peer_start_timeout_s=1")
    )
    paths = storage.paths_of(cfg)
    board.write_segment(paths, board.Segment(id="s1", first_step=0, end_step=8, started_at=0.0))
    worker0 = peers.Peers(cfg, paths, segment_id="s1", role="worker0").start()
    peers.mark_started(paths, "s1", "evaluator")
    time.sleep(1.1)
    with pytest.raises(peers.PeersMissing, match="the trainer, worker 1 had not started"):
        worker0.check()

    # What async_role does on PeersMissing: exactly the peers' Pending pods of this run.
    assert pending_peers.end_pending_peers("s1") == PENDING_PEERS
    assert cluster.patches == STOP
    assert cluster.workflows[(NS, OTHER)] == workflow(OTHER)
    assert not [r for r in cluster.requests if not r.startswith(("GET ", "PATCH "))], "no delete"


def test_a_role_started_after_the_segment_was_given_up_stops_at_once(cluster, tmp_path):
    config = tiny_async(tmp_path, "asynchronous.workers=2")
    cfg, segment_id = async_runtime.begin_async_segment(config=config, owner="run-a", workers=2)
    paths = storage.paths_of(cfg)
    peers.abandon(paths, segment_id, by="worker0", reason="the trainer had not started")

    start = time.monotonic()
    with pytest.raises(peers.PeersMissing) as e:
        async_runtime.async_role(
            config=cfg.to_yaml(), owner="run-a", role="trainer", segment_id=segment_id
        )
    assert time.monotonic() - start < 10
    message = str(e.value)
    assert "\n" not in message
    assert f"recorded in {peers.abandoned_uri(paths)}" in message
    assert "worker 0 gave it up: the trainer had not started" in message
    assert "this trainer stops. Nothing committed is lost" in message
    assert board.read_trainer(paths).gradient_step == 0
    assert cluster.patches == STOP  # its run is stopped too, while peers stay Pending

    # The exit task (which the stop lets run) frees the lineage; the next run's segment
    # (another KFP run id) is not held back by the old record.
    said = runtime.release_run(
        config=cfg.to_yaml(), run_root="", owner="run-a", arms=[""], lineages=[""]
    )
    assert said == [f"released the lease of {paths.root}"]
    next_id = async_runtime.segment_id_for("run-b")
    assert next_id != segment_id and peers.abandoned_reason(paths, next_id) is None
    peers.Peers(cfg, paths, segment_id=next_id, role="trainer").start().check()


def test_a_refused_stop_is_logged_and_the_role_error_stands(cluster, caplog):
    cluster.forbidden.add("patch_namespaced_custom_object")
    with caplog.at_level(logging.WARNING, logger=pending_peers.__name__):
        assert pending_peers.end_pending_peers("s1") == []
    assert cluster.patches == []
    (said,) = [r.getMessage() for r in caplog.records]
    assert "could not stop its run's workflow (403 Forbidden)" in said
    assert "patch on workflows.argoproj.io" in said and "until the pod is scheduled" in said


def test_no_pending_peer_no_stop_and_outside_a_pod_nothing(cluster, monkeypatch):
    for (kind, _, name), obj in cluster.objects.items():
        if kind == "pods" and name != ME:
            obj["status"]["phase"] = "Running"
    assert pending_peers.end_pending_peers("s1") == []
    assert cluster.patches == []

    seen = len(cluster.requests)
    monkeypatch.setattr(pending_peers, "POD_NAMESPACE_FILE", "/nonexistent/namespace")
    assert pending_peers.end_pending_peers("s1") == []
    assert len(cluster.requests) == seen, "no API call outside a pod"


def test_role_tasks_are_the_compiled_role_tasks(tmp_path):
    """The rule that picks peers' pods by Argo node name matches exactly the role tasks KFP
    compiles (W=3), never their drivers or the other tasks."""
    compiler.Compiler().compile(async_segment_pipeline(workers=3), str(tmp_path / "a.yaml"))
    spec, _, _ = parse(tmp_path / "a.yaml")
    dags = [spec.root.dag, *(c.dag for c in spec.components.values() if c.HasField("dag"))]
    names = {name: task.component_ref.name for dag in dags for name, task in dag.tasks.items()}
    roles = {n for n in names if pending_peers.role_task_of(f"wf.{n}.executor(2)")}
    workers = {"async-worker", "async-worker-2", "async-worker-3"}
    assert roles == {*workers, "async-trainer", "async-evaluator"}
    assert {names[n] for n in roles} == {f"comp-{n}" for n in roles}
    assert not any(pending_peers.role_task_of(f"wf.exit-handler-1.{n}-driver") for n in names)
    assert pending_peers.role_task_of(f"{RUN}.exit-handler-1.async-worker-2.executor") == (
        "async-worker-2"
    )
