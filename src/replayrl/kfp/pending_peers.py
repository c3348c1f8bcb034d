"""A given-up segment whose peer pod stays Pending still ends its run: the role stops the run.

The roles of an `async_segment` run give its segment up when a peer has not started within
`asynchronous.peer_start_timeout_s` (`replayrl.engine.asynchronous.peers`), and each one then
ends. But a role whose pod never leaves Pending (no free accelerator, a quota, no node its
selector matches) runs no code and never times out (a pod's `activeDeadlineSeconds` counts
from its start), so the run's Argo workflow would wait for it for ever: no exit task (which
releases the lineage), and with `max_concurrency=1` no next recurring run.

So a role that stops on a given-up segment looks, in the Kubernetes API from inside its pod,
at the pods of its own Argo workflow, and when one of its peers' pods is Pending it stops
that workflow (`spec.shutdown: Stop`, as `argo stop` does). Argo then fails every node
still pending or running, terminates their pods, and runs the exit handlers (KFP compiles
`dsl.ExitHandler` to an Argo exit hook, which a Stop still runs): the exit task releases the
lineage and the run ends (Failed, with the role's one error line). Deleting the Pending pods
would not do: Argo re-creates the pod of a node that is still Pending (its
`podReconciliation` leaves such a node alone and the next pass submits the pod again).

How the pods are found, from what Argo and KFP put on them:

    label       workflows.argoproj.io/workflow = the workflow's name (every pod Argo creates;
                read from this pod's own labels)
    annotation  workflows.argoproj.io/node-name = the node's path in the workflow, its DAG
                task names joined with dots: <workflow>[.exit-handler-1].async-trainer.executor
                (and `executor(1)`... for the retries of a retried task)

KFP names a task after its component (`async-trainer`, `async-evaluator`, `async-worker`,
then `async-worker-2`...), and its driver `<task>-driver`: a pod is a peer when an element
of its node name is a role task's name (`ROLE_TASK`), it is not this pod, and its phase is
Pending.

Best effort: any failure (no API access, RBAC refusing `list pods` or `patch workflows`) is
logged as one warning and the role's own error still stands. Outside a Kubernetes pod
(`kfp.local`, the local engines) it does nothing. Needs, for the pod's service account, in its
namespace: get and list on pods, patch on workflows.argoproj.io (a Kubeflow profile's
`default-editor` has them; `k8s/base/rbac.yaml` grants them to replayrl-pipeline-runner).

Knows nothing about the board or the roles' work; only pods and the workflow.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from replayrl.kfp.runtime import POD_ENV

log = logging.getLogger(__name__)

WORKFLOW_LABEL = "workflows.argoproj.io/workflow"
NODE_NAME_ANNOTATION = "workflows.argoproj.io/node-name"
# The KFP task names of the segment's roles: the components `async_worker`, `async_trainer`,
# `async_evaluator` (replayrl.kfp.components), `-2`, `-3`... for the second, third worker.
ROLE_TASK = re.compile(r"async-(worker(-\d+)?|trainer|evaluator)")
ARGO = {"group": "argoproj.io", "version": "v1alpha1", "plural": "workflows"}
# The pod's name: KFP sets POD_ENV in its pods from the downward API; HOSTNAME is the same.
POD_NAME_ENVS = (POD_ENV, "HOSTNAME")
POD_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_TIMEOUT_S = 20


def role_task_of(node_name: str) -> str | None:
    """The role task a pod of Argo node `node_name` belongs to, or None (a driver, another
    task): `run-x.exit-handler-1.async-worker-2.executor(0)` -> `async-worker-2`."""
    for part in node_name.split("."):
        if ROLE_TASK.fullmatch(re.sub(r"\(\d+\)$", "", part)):
            return part
    return None


def pending_peers(core: Any, *, namespace: str, pod_name: str) -> tuple[str, list[str]]:
    """(this pod's workflow, the names of its peers' Pending pods), through CoreV1Api `core`."""
    own = core.read_namespaced_pod(pod_name, namespace, _request_timeout=_TIMEOUT_S)
    workflow = (own.metadata.labels or {}).get(WORKFLOW_LABEL)
    if not workflow:
        raise LookupError(f"pod {pod_name} has no {WORKFLOW_LABEL} label: not an Argo pod")
    pods = core.list_namespaced_pod(
        namespace, label_selector=f"{WORKFLOW_LABEL}={workflow}", _request_timeout=_TIMEOUT_S
    )
    pending = [
        pod.metadata.name
        for pod in pods.items
        if pod.metadata.name != pod_name
        and (pod.status.phase if pod.status else None) == "Pending"
        and role_task_of((pod.metadata.annotations or {}).get(NODE_NAME_ANNOTATION, ""))
    ]
    return workflow, sorted(pending)


def stop_workflow(custom: Any, *, namespace: str, workflow: str) -> None:
    """`argo stop`: fail the nodes still pending or running, run the exit handlers."""
    custom.patch_namespaced_custom_object(
        **ARGO,
        namespace=namespace,
        name=workflow,
        body={"spec": {"shutdown": "Stop"}},
        _request_timeout=_TIMEOUT_S,
    )


def _in_cluster() -> tuple[str, str] | None:
    """(this pod's name, its namespace) inside a Kubernetes pod, else None."""
    try:
        namespace = Path(POD_NAMESPACE_FILE).read_text().strip()
    except OSError:
        return None
    name = next((os.environ[e] for e in POD_NAME_ENVS if os.environ.get(e)), "")
    return (name, namespace) if name and namespace else None


def _api_client() -> Any:
    """An ApiClient with this pod's service account."""
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_incluster_config(client_configuration=configuration)
    return client.ApiClient(configuration)


def end_pending_peers(segment_id: str) -> list[str]:
    """Stop this pod's workflow when a peer's pod is Pending; returns those pods' names ([]
    when none, outside a pod, or on any failure, which is logged). Never raises."""
    here = _in_cluster()
    if here is None:
        log.debug("segment %s: not in a Kubernetes pod; no peer pods to look at", segment_id)
        return []
    pod_name, namespace = here
    try:
        from kubernetes import client

        api = _api_client()
        workflow, pending = pending_peers(
            client.CoreV1Api(api), namespace=namespace, pod_name=pod_name
        )
        if not pending:
            log.info("segment %s: no peer pod of workflow %s is Pending", segment_id, workflow)
            return []
        stop_workflow(client.CustomObjectsApi(api), namespace=namespace, workflow=workflow)
    except Exception as e:  # best effort: the role's own error must stand
        reason = getattr(e, "reason", None) or type(e).__name__
        status = getattr(e, "status", None)
        log.warning(
            "segment %s was given up, but this pod (%s/%s) could not stop its run's workflow "
            "(%s%s): a peer pod left Pending keeps the run open, and its exit task waiting, "
            "until the pod is scheduled (it then stops at once) or the run is stopped by hand "
            "(`argo stop`, or terminate it in the KFP UI). Its service account needs get and "
            "list on pods and patch on workflows.argoproj.io in the namespace.",
            segment_id,
            namespace,
            pod_name,
            f"{status} " if status else "",
            " ".join(str(reason).split())[:200],
        )
        return []
    log.error(
        "segment %s was given up while %s stayed Pending: stopped workflow %s (its exit task "
        "still runs and releases the lineage)",
        segment_id,
        ", ".join(pending),
        workflow,
    )
    return pending
