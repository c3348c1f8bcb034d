"""A stand-in for the Kubernetes API (core/v1 reads, one Argo write, Kubeflow Trainer's
TrainJobs), for the tests of `replayrl preflight`, of a given-up segment's pods
(`replayrl.kfp.pending_peers`) and of the trainer launcher (`replayrl.kfp.trainjob`).

NOT Kubernetes: a small HTTP server on 127.0.0.1 (`serve`) that answers the core/v1 reads
those make (`IMPLEMENTED`) and the one write, a JSON merge patch of an Argo Workflow
(`WRITES`), from objects a test puts in `KubeState`, and records every request. No cluster
runs here.

Checked against what the `kubernetes` Python client ships (the version kfp installs), which
openapi-generator wrote from the Kubernetes OpenAPI document:

- requests: `OPERATIONS` reads every operation of `kubernetes.client.CoreV1Api` and
  `CustomObjectsApi` from their source (path template, HTTP method, the query parameters it
  may send, the response type, the Content-Type of its body). A request whose method and
  path are no such operation, an operation the stand-in does not implement, a write other
  than `WRITES` (the preflight only reads; a given-up segment deletes no pod), a query
  parameter the operation does not take, a body of another Content-Type, or a request
  without the kubeconfig's bearer token goes into `rejected` (answered 400/401/405/501), and
  the fixture fails the test unless it is empty;
- objects and answers: `check_model` holds each JSON object to its model in
  `kubernetes.client.models` (`openapi_types`, `attribute_map`): every key must be a field
  of the model under its JSON name, every value of the field's type (list, map, nested model,
  string, integer, boolean, date-time); then the client's own `ApiClient().deserialize` reads
  it back with client-side validation on, which refuses a model without a required field
  (a Taint without `effect`). `KubeState.add` checks a test's objects when they are put in
  (a malformed fixture fails there), and `handle` checks every answer before it is sent.

What it serves: a Namespace by name; a ServiceAccount, Secret, ConfigMap or Pod by namespace
and name (404 with a `Status`, reason NotFound, as the API server answers, when absent); the
node list; a namespace's pods, filtered by an equality `labelSelector` (`k=v,k2=v2`); the
cluster-scoped custom objects of a kind in `KubeState.custom_objects` (Karpenter's NodePools),
404 for a kind it has none of, as for a CRD that is not installed. Namespaced custom objects
of a kind in `KubeState.namespaced` (TrainJobs) are created (409 AlreadyExists, reason
AlreadyExists, for a name taken; 422 Invalid when the kind's `validators` entry finds faults,
as an API server holds a custom object to its CRD's schema; uid, resourceVersion and
creationTimestamp set), read (404) and deleted (kept in `deletions` with the query, e.g.
propagationPolicy); a test sets an object's `status` in `namespaced` to drive it. It
applies a merge patch to an Argo Workflow in `KubeState.workflows` (keeping each patch in
`patches`) and answers the patched object. An operation listed in `forbidden` is answered
403 Forbidden, as for a caller whose RBAC does not allow it (a Kubeflow profile's owner may
not list nodes).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlparse

import kubernetes
import kubernetes.client.api.core_v1_api as core_v1_api
import kubernetes.client.api.custom_objects_api as custom_objects_api
from kubernetes import client as k8s

VERSION = kubernetes.__version__
IMPLEMENTED = {
    "read_namespace",
    "read_namespaced_service_account",
    "read_namespaced_secret",
    "read_namespaced_config_map",
    "list_node",
    "read_namespaced_pod",
    "list_namespaced_pod",
    "patch_namespaced_custom_object",
    "list_cluster_custom_object",
    "create_namespaced_custom_object",
    "get_namespaced_custom_object",
    "delete_namespaced_custom_object",
}
TRAINJOBS = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
# The writes the stand-in takes: (operation, the group/version/plural it may change).
WRITES = {
    ("patch_namespaced_custom_object", ("argoproj.io", "v1alpha1", "workflows")),
    ("create_namespaced_custom_object", TRAINJOBS),
    ("delete_namespaced_custom_object", TRAINJOBS),
}
# The kubernetes client's default Content-Type for an operation that names none.
_DEFAULT_CONTENT_TYPE = "application/json"
# The resource each implemented read serves, as the API server names it in a Status.
_RESOURCE = {
    "read_namespace": "namespaces",
    "read_namespaced_service_account": "serviceaccounts",
    "read_namespaced_secret": "secrets",
    "read_namespaced_config_map": "configmaps",
    "read_namespaced_pod": "pods",
}
_KIND = {
    "ServiceAccount": "serviceaccounts",
    "Secret": "secrets",
    "ConfigMap": "configmaps",
    "Pod": "pods",
}


class Violation(Exception):
    """A request or object the client's API description does not allow."""


@dataclass(frozen=True)
class Operation:
    name: str
    method: str
    path: str  # template, e.g. /api/v1/namespaces/{namespace}/secrets/{name}
    query: frozenset[str]  # the wire names it may send
    response: str  # a model name, e.g. V1Secret
    content_types: tuple[str, ...] = ()  # what its body may be sent as

    def match(self, path: str) -> dict[str, str] | None:
        pattern = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(self.path))
        m = re.fullmatch(pattern, path)
        return {k: unquote(v) for k, v in m.groupdict().items()} if m else None


def _operations() -> list[Operation]:
    """Every CoreV1Api and CustomObjectsApi operation, from the generated source (one
    `*_with_http_info` method each, whose body names the path, method, query parameters,
    response type and body Content-Types)."""
    found = []
    for module in (core_v1_api, custom_objects_api):
        for block in re.split(r"\n    def ", Path(module.__file__).read_text()):
            head = re.match(r"(\w+)_with_http_info\(", block)
            call = re.search(r"call_api\(\s*'([^']+)',\s*'(\w+)'", block)
            if not head or not call:
                continue
            response = re.search(r"response_type='(\w+)'", block)
            query = re.findall(r"query_params\.append\(\('(\w+)'", block)
            types = re.search(r"select_header_content_type\(\s*#[^\n]*\n\s*\[([^\]]*)\]", block)
            found.append(
                Operation(
                    head[1],
                    call[2],
                    call[1],
                    frozenset(query),
                    response[1] if response else "",
                    tuple(re.findall(r"'([^']+)'", types[1])) if types else (),
                )
            )
    return found


OPERATIONS = _operations()


# ---------------------------------------------------------------- models


def _model(name: str):
    cls = getattr(k8s.models, name, None) if name[:1].isupper() else None
    if cls is None or not hasattr(cls, "openapi_types"):
        raise Violation(f"no model {name} in kubernetes.client {VERSION}")
    return cls


def check_model(value: Any, type_name: str, where: str = "") -> None:
    """Hold JSON `value` to `type_name` (a model name or the client's type notation:
    list[X], dict(str, X), str, int, bool, float, object, datetime, date)."""
    where = where or type_name
    if type_name.startswith("list["):
        if not isinstance(value, list):
            raise Violation(f"{where}: expected a list, got {value!r}")
        for i, item in enumerate(value):
            check_model(item, type_name[5:-1], f"{where}[{i}]")
        return
    if type_name.startswith("dict("):
        inner = re.match(r"dict\(([^,]*), (.*)\)$", type_name)[2]
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise Violation(f"{where}: expected a map, got {value!r}")
        for k, v in value.items():
            check_model(v, inner, f"{where}.{k}")
        return
    primitive = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}
    if type_name in primitive:
        ok = isinstance(value, primitive[type_name]) and not (
            type_name in ("int", "float") and isinstance(value, bool)
        )
        if not ok:
            raise Violation(f"{where}: expected {type_name}, got {value!r}")
        return
    if type_name in ("datetime", "date"):
        try:
            datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            raise Violation(f"{where}: expected an RFC 3339 {type_name}, got {value!r}") from None
        return
    cls = _model(type_name)
    if not isinstance(value, dict):
        raise Violation(f"{where}: expected a {type_name} object, got {value!r}")
    by_json = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    for key, item in value.items():
        if key not in by_json:
            raise Violation(f"{where}: {type_name} has no field {key!r}")
        check_model(item, cls.openapi_types[by_json[key]], f"{where}.{key}")


class _Response:
    def __init__(self, data: Any):
        self.data = json.dumps(data)


def deserialize(value: Any, type_name: str) -> Any:
    """`check_model`, then the client's own reading of it (required fields checked)."""
    check_model(value, type_name)
    try:
        return k8s.ApiClient().deserialize(_Response(value), type_name)
    except ValueError as e:
        raise Violation(f"{type_name}: {e}") from None


# ---------------------------------------------------------------- state and serving


@dataclass
class KubeState:
    """What the stand-in serves, and what it saw."""

    token: str = "standin-token"
    namespaces: dict[str, dict] = field(default_factory=dict)
    objects: dict[tuple[str, str, str], dict] = field(default_factory=dict)  # kind, ns, name
    nodes: list[dict] = field(default_factory=list)
    workflows: dict[tuple[str, str], dict] = field(default_factory=dict)  # ns, name
    # (group, version, plural) -> cluster-scoped objects; a kind not here is not installed
    custom_objects: dict[tuple[str, str, str], list[dict]] = field(default_factory=dict)
    patches: list[tuple[str, str, dict]] = field(default_factory=list)  # ns, name, patch
    # (group, version, plural) -> {(ns, name): object}: namespaced custom objects (TrainJobs)
    namespaced: dict[tuple[str, str, str], dict[tuple[str, str], dict]] = field(
        default_factory=lambda: {TRAINJOBS: {}}
    )
    # (group, version, plural) -> a check of a created object: its faults, [] when valid
    validators: dict[tuple[str, str, str], Any] = field(default_factory=dict)
    deletions: list[tuple[str, str, dict]] = field(default_factory=list)  # ns, name, query
    forbidden: set[str] = field(default_factory=set)  # operations answered 403
    requests: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)

    def add(self, obj: dict) -> dict:
        """Put a Namespace, ServiceAccount, Secret, ConfigMap, Pod or Node in, checked against
        its model first (a malformed fixture raises Violation here)."""
        kind = obj.get("kind", "")
        deserialize(obj, f"V1{kind}")
        meta = obj["metadata"]
        if kind == "Namespace":
            self.namespaces[meta["name"]] = obj
        elif kind == "Node":
            self.nodes.append(obj)
        elif kind in _KIND:
            self.objects[(_KIND[kind], meta["namespace"], meta["name"])] = obj
        else:
            raise Violation(f"the stand-in serves no {kind}")
        return obj


def _status(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


def _selected(labels: dict, selector: str) -> bool:
    """Whether `labels` match an equality label selector (`k=v,k2==v2`)."""
    for term in filter(None, selector.split(",")):
        key, value = re.split(r"==?", term, maxsplit=1)
        if labels.get(key.strip()) != value.strip():
            return False
    return True


def _merge(target: dict, patch: dict) -> dict:
    """A JSON merge patch (RFC 7386) of `target`."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _serve_namespaced(
    state: KubeState, op: Operation, params: dict[str, str], query: dict[str, str], body: bytes
):
    """create/get/delete of a namespaced custom object (a TrainJob)."""
    kind = (params["group"], params["version"], params["plural"])
    store = state.namespaced.get(kind)
    if store is None:
        return 404, _status(404, "NotFound", "the server could not find the requested resource")
    ns, resource = params["namespace"], f"{kind[2]}.{kind[0]}"
    if op.name == "create_namespaced_custom_object":
        obj = json.loads(body)
        name = (obj.get("metadata") or {}).get("name", "")
        details = {"name": name, "group": kind[0], "kind": kind[2]}
        faults = list(state.validators[kind](obj)) if kind in state.validators else []
        if faults:
            message = f'{resource} "{name}" is invalid: {"; ".join(faults)}'
            return 422, _status(422, "Invalid", message, details)
        if (ns, name) in store:
            message = f'{resource} "{name}" already exists'
            return 409, _status(409, "AlreadyExists", message, details)
        meta = obj["metadata"]
        meta.setdefault("namespace", ns)
        meta["uid"] = f"uid-{len(state.requests)}"
        meta["resourceVersion"] = str(len(state.requests))
        meta["creationTimestamp"] = "2026-01-01T00:00:00Z"
        store[(ns, name)] = obj
        return 201, obj
    name = params["name"]
    if (ns, name) not in store:
        details = {"name": name, "group": kind[0], "kind": kind[2]}
        return 404, _status(404, "NotFound", f'{resource} "{name}" not found', details)
    if op.name == "get_namespaced_custom_object":
        return 200, store[(ns, name)]
    state.deletions.append((ns, name, query))
    del store[(ns, name)]
    return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                 "details": {"name": name, "group": kind[0], "kind": kind[2]}}  # fmt: skip


def _serve_operation(
    state: KubeState, op: Operation, params: dict[str, str], query: dict[str, str], body: bytes
):
    if op.name in (
        "create_namespaced_custom_object",
        "get_namespaced_custom_object",
        "delete_namespaced_custom_object",
    ):
        return _serve_namespaced(state, op, params, query, body)
    if op.name == "patch_namespaced_custom_object":
        key = (params["namespace"], params["name"])
        if key not in state.workflows:
            details = {"name": key[1], "group": "argoproj.io", "kind": "workflows"}
            message = f'workflows.argoproj.io "{key[1]}" not found'
            return 404, _status(404, "NotFound", message, details)
        patch = json.loads(body)
        state.patches.append((*key, patch))
        state.workflows[key] = _merge(state.workflows[key], patch)
        return 200, state.workflows[key]
    if op.name == "list_namespaced_pod":
        selector = query.get("labelSelector", "")
        return 200, {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": "1"},
            "items": [
                pod
                for (kind, namespace, _), pod in sorted(state.objects.items())
                if kind == "pods"
                and namespace == params["namespace"]
                and _selected(pod["metadata"].get("labels", {}), selector)
            ],
        }
    if op.name == "list_cluster_custom_object":
        kind = (params["group"], params["version"], params["plural"])
        if kind not in state.custom_objects:
            return 404, _status(404, "NotFound", "the server could not find the requested resource")
        return 200, {
            "apiVersion": f"{kind[0]}/{kind[1]}",
            "kind": "List",
            "metadata": {"resourceVersion": "1"},
            "items": state.custom_objects[kind],
        }
    if op.name == "list_node":
        return 200, {
            "kind": "NodeList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": "1"},
            "items": state.nodes,
        }
    resource, name = _RESOURCE[op.name], params["name"]
    if op.name == "read_namespace":
        found = state.namespaces.get(name)
    else:
        found = state.objects.get((resource, params["namespace"], name))
    if found is None:
        details = {"name": name, "kind": resource}
        return 404, _status(404, "NotFound", f'{resource} "{name}" not found', details)
    return 200, found


def handle(state: KubeState, method: str, url: str, headers, body: bytes = b"") -> tuple[int, Any]:
    """The status and JSON answer to one request; bad requests are kept in `rejected`."""
    parsed = urlparse(url)
    state.requests.append(f"{method} {url}")
    matches = [(op, p) for op in OPERATIONS if (p := op.match(parsed.path)) is not None]
    matches = [(op, p) for op, p in matches if op.method == method]
    try:
        if not matches:
            raise Violation(f"{method} {parsed.path} is no core/v1 or custom-objects operation")
        # A literal segment beats a parameter (/api/v1/nodes is list_node, not a read).
        op, params = min(matches, key=lambda m: len(m[1]))
        if method != "GET":
            target = (params.get("group"), params.get("version"), params.get("plural"))
            if (op.name, target) not in WRITES:
                raise Violation(f"{method} {parsed.path}: a write the stand-in does not take")
            sent = (headers.get("Content-Type") or "").split(";")[0]
            if sent not in (op.content_types or (_DEFAULT_CONTENT_TYPE,)):
                raise Violation(f"{op.name}: a body sent as {sent!r}, not {op.content_types}")
            sent_body = json.loads(body or b"null")
            if op.name == "delete_namespaced_custom_object":
                if sent_body is not None:
                    check_model(sent_body, "V1DeleteOptions", f"{op.name} body")
            elif not isinstance(sent_body, dict):
                raise Violation(f"{op.name}: the body must be a JSON object, got {body!r}")
        unknown = {k for k, _ in parse_qsl(parsed.query)} - op.query
        if unknown:
            raise Violation(f"{op.name} takes no query parameter(s) {sorted(unknown)}")
    except Violation as e:
        state.rejected.append(str(e))
        return (405 if method != "GET" else 400), _status(400, "BadRequest", str(e))
    if headers.get("Authorization") != f"Bearer {state.token}":
        state.rejected.append(f"{op.name}: no bearer token from the kubeconfig")
        return 401, _status(401, "Unauthorized", "Unauthorized")
    if op.name not in IMPLEMENTED:
        state.rejected.append(f"the stand-in does not implement {op.name}")
        return 501, _status(501, "NotImplemented", op.name)
    if op.name in state.forbidden:
        message = f"{op.name} is forbidden for this user"
        return 403, _status(403, "Forbidden", message)
    status, answer = _serve_operation(state, op, params, dict(parse_qsl(parsed.query)), body)
    try:
        deserialize(answer, op.response if status in (200, 201) else "V1Status")
    except Violation as e:
        state.rejected.append(f"the stand-in's answer to {op.name}: {e}")
        return 500, _status(500, "InternalError", str(e))
    return status, answer


@contextlib.contextmanager
def serve(state: KubeState):
    """Serve `state` on a free loopback port; yields the base URL."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            with lock:
                status, answer = handle(state, method, self.path, self.headers, body)
            blob = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(blob)))
            self.end_headers()
            self.wfile.write(blob)

        def do_GET(self):  # noqa: N802
            self._serve("GET")

        def do_POST(self):  # noqa: N802
            self._serve("POST")

        def do_PUT(self):  # noqa: N802
            self._serve("PUT")

        def do_PATCH(self):  # noqa: N802
            self._serve("PATCH")

        def do_DELETE(self):  # noqa: N802
            self._serve("DELETE")

        def log_message(self, *args):  # keep pytest output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def kubeconfig(url: str, token: str, path: Path, *, namespace: str | None = None) -> Path:
    """A kubeconfig file for the stand-in at `url`, bearer `token`."""
    context: dict[str, str] = {"cluster": "standin", "user": "standin"}
    if namespace:
        context["namespace"] = namespace
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "standin", "cluster": {"server": url}}],
                "users": [{"name": "standin", "user": {"token": token}}],
                "contexts": [{"name": "standin", "context": context}],
                "current-context": "standin",
            }
        )
    )
    return path
