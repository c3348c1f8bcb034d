"""A stand-in for the KFP v2beta1 REST API, for the tests of `replayrl submit` and `schedule`.

NOT Kubeflow Pipelines: a small HTTP server on 127.0.0.1 (`serve`) that implements the
operations `kfp.Client` calls for `replayrl submit` and `schedule`, keeps what it was sent
in memory (`StandinState`), and lets tests assert on that state. No KFP backend runs here.

Every request and every answer is checked against the KFP v2beta1 API document
(`kfp_openapi.DOCUMENT`, from the kfp-server-api package): path, method, query parameters,
body. A request the document does not allow, an operation the stand-in does not implement,
or an answer of the stand-in's own that the document does not allow goes into `rejected`
(answered 400, 501 and 500); the fixtures fail the test unless `rejected` is empty at its
end. A valid request that the real server would refuse too (a name taken, a namespace
missing in multi-user mode) is answered as the server would (400/404/409, a
`google.rpc.Status`) and kept in `refused`.

What it implements follows the API server of KFP 2.15 (backend/src/apiserver/):

- Single-user (`multi_user=False`): every namespace a request names is replaced by ""
  (`ResourceManager.ReplaceNamespace`, resource/resource_manager.go), so everything lives in
  one pool and `namespace=` changes nothing.
- Multi-user (`multi_user=True`):
  - pipelines are listed in exactly the namespace asked for, "" listing the shared ones
    (`PipelineStore.ListPipelines`, storage/pipeline_store.go: `pipelines.Namespace = ?`),
    and created in the namespace their body names, "" making a shared pipeline
    (server/pipeline_server.go `createPipeline`); names are unique per namespace
    (model/pipeline.go, unique index `namespace_name`);
  - a pipeline version belongs to its pipeline: listed by pipeline id, its name unique in
    that pipeline (model/pipeline_version.go `idx_pipelineid_name`);
  - experiments need a namespace, to list or to create ("An experiment cannot have an empty
    namespace in multi-user mode", server/experiment_server.go `canAccessExperiment`), are
    listed in exactly that namespace (storage/experiment_store.go), and their names are
    unique per namespace (model/experiment.go `idx_name_namespace`);
  - runs and recurring runs need an experiment and take its namespace
    (`GetValidExperimentNamespacePair`, resource_manager.go); recurring runs are listed by
    experiment (its namespace) or by namespace, which must not be empty
    (server/job_server.go `listJobs`, `canAccessJob`);
  - no authorization: any namespace may be used (the server asks Kubernetes, through a
    SubjectAccessReview, whether the caller may).
- Filters: EQUALS on the keys the server accepts for the resource (the `APIToModelFieldMap`s
  of model/pipeline.go, pipeline_version.go, experiment.go, job.go); another key is refused
  with 400 as the server does ("no support for filtering on unrecognized field",
  filter/filter.go). Other operations, and keys the stand-in does not store (created_at...),
  are not implemented.
- Healthz answers `multi_user`, `pipeline_store` and the configured `tag_name` and
  `commit_sha` (backend/src/apiserver/main.go `newHealthzResponse`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml
from kfp_openapi import DOCUMENT, Request, Violation

# The commit of KFP's 2.15.0 tag, which a 2.15.0 server reports as its commit_sha.
COMMIT_2_15_0 = "8fe8d7bdd88f027bde080f619762a0b3294796db"

# API filter keys each resource accepts (the APIToModelFieldMap of
# backend/src/apiserver/model/*.go, KFP 2.15), and what the stand-in compares them with;
# None: accepted by the server, not stored here.
PIPELINE_KEYS = {
    "id": "id",
    "pipeline_id": "id",
    "name": "name",
    "display_name": "display_name",
    "description": "description",
    "namespace": "namespace",
    "created_at": None,
}
VERSION_KEYS = {
    "id": "id",
    "pipeline_version_id": "id",
    "name": "name",
    "display_name": "display_name",
    "description": "description",
    "created_at": None,
    "status": None,
    "pipeline_spec": None,
}
EXPERIMENT_KEYS = {  # "name" and "display_name" are both the Name column
    "id": "id",
    "experiment_id": "id",
    "name": "display_name",
    "display_name": "display_name",
    "description": "description",
    "namespace": "namespace",
    "created_at": None,
    "last_run_created_at": None,
    "storage_state": None,
}
JOB_KEYS = {  # a recurring run has no namespace or experiment key
    "id": "id",
    "recurring_run_id": "id",
    "name": "display_name",
    "display_name": "display_name",
    "description": "description",
    "created_at": None,
    "updated_at": None,
}


class Refused(Exception):
    """A valid request the real server refuses too: HTTP status and google.rpc code."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.code = {400: 3, 404: 5, 409: 6}[status]  # INVALID_ARGUMENT, NOT_FOUND, ...


class Unsupported(Exception):
    """A valid request the stand-in does not model."""


@dataclass
class StandinState:
    """The server's mode and version, and what it was sent, as a KFP backend stores it."""

    multi_user: bool = False
    tag_name: str = "2.15.0"
    commit_sha: str = COMMIT_2_15_0
    pipelines: dict[str, dict] = field(default_factory=dict)  # id -> record, with "versions"
    experiments: dict[str, dict] = field(default_factory=dict)
    runs: dict[str, dict] = field(default_factory=dict)  # id -> the body, with "namespace"
    recurring_runs: dict[str, dict] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)  # valid requests the server refused
    rejected: list[str] = field(default_factory=list)  # invalid or unmodelled: a test bug
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def new_id(self, kind: str) -> str:
        return f"{kind}-{next(self.ids)}"

    def namespace(self, ns: str | None) -> str:
        """ReplaceNamespace: single-user mode ignores the namespace a request names."""
        return (ns or "") if self.multi_user else ""


# ---------------------------------------------------------------- serving


def handle(state: StandinState, method: str, url: str, headers, body: bytes) -> tuple[int, Any]:
    """The status and JSON answer to one request; records it in `rejected` or `refused`."""
    op = None
    try:
        req = DOCUMENT.request(method, url, headers, body)
        op = req.operation
        handler = HANDLERS.get(op.name)
        if handler is None:
            raise Unsupported(f"the stand-in does not implement {op.name}")
        status, answer = 200, handler(state, req)
    except Violation as e:
        state.rejected.append(f"{method} {url}: {e}")
        status, answer = 400, {"code": 3, "message": f"not in the API document: {e}"}
    except Unsupported as e:
        state.rejected.append(f"{method} {url}: {e}")
        status, answer = 501, {"code": 12, "message": str(e)}
    except Refused as e:
        state.refused.append(f"{method} {url}: {e}")
        status, answer = e.status, {"code": e.code, "message": str(e)}
    try:
        DOCUMENT.response(op, status, answer)
    except Violation as e:
        state.rejected.append(f"the stand-in's answer to {method} {url}: {e}")
        status, answer = 500, {"code": 13, "message": str(e)}
    return status, answer


@contextlib.contextmanager
def serve(state: StandinState):
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


# ---------------------------------------------------------------- the operations


def _proto(d: dict) -> dict:
    """As the gateway writes a message: empty fields left out (EmitUnpopulated: false)."""
    return {k: v for k, v in d.items() if v not in (None, "", [], {}, 0, False)}


def _predicates(req: Request, keys: dict[str, str | None]) -> list[tuple[str, str]]:
    """The request's filter as (stored field, value) pairs. The server checks the filter
    before anything else (validatedListOptions, server/list_request_util.go)."""
    pairs = []
    for p in DOCUMENT.parse_filter(req.query.get("filter", "")):
        key = p.get("key", "")
        if key not in keys:
            raise Refused(400, f"no support for filtering on unrecognized field {key!r}")
        if keys[key] is None or p.get("operation") != "EQUALS" or "string_value" not in p:
            raise Unsupported(f"the stand-in filters only EQUALS on stored keys, got {p}")
        pairs.append((keys[key], p["string_value"]))
    return pairs


def _select(items: dict[str, dict], pairs: list[tuple[str, str]], req: Request) -> list[dict]:
    """The records that match every pair, paged by page_size."""
    found = [r for r in items.values() if all(str(r.get(f, "")) == v for f, v in pairs)]
    size = req.query.get("page_size") or 20  # the server's default page size
    if len(found) > size:
        raise Unsupported(f"{len(found)} results over a page of {size}: paging")
    return found


def _pipeline(p: dict) -> dict:
    return _proto(
        {
            "pipeline_id": p["id"],
            "name": p["name"],
            "display_name": p["display_name"],
            "description": p["description"],
            "namespace": p["namespace"],
        }
    )


def _version(pid: str, v: dict) -> dict:
    return _proto(
        {
            "pipeline_id": pid,
            "pipeline_version_id": v["id"],
            "name": v["name"],
            "display_name": v["display_name"],
        }
    )


def healthz(state: StandinState, req: Request) -> dict:
    # Written by hand in main.go: multi_user is there even when false.
    return {
        "commit_sha": state.commit_sha,
        "tag_name": state.tag_name,
        "multi_user": state.multi_user,
        "pipeline_store": "database",
    }


def list_pipelines(state: StandinState, req: Request) -> dict:
    pairs = _predicates(req, PIPELINE_KEYS)
    ns = state.namespace(req.query.get("namespace"))
    pool = {k: p for k, p in state.pipelines.items() if p["namespace"] == ns}
    found = _select(pool, pairs, req)
    return _proto({"pipelines": [_pipeline(p) for p in found], "total_size": len(found)})


def create_pipeline(state: StandinState, req: Request) -> dict:
    body = req.body
    name = body.get("name") or body.get("display_name") or ""  # toModelPipeline
    if not name:
        raise Refused(400, "name is required")
    ns = state.namespace(body.get("namespace"))
    if any(p["name"] == name and p["namespace"] == ns for p in state.pipelines.values()):
        raise Refused(409, f"a pipeline named {name!r} exists in namespace {ns!r}")
    pid = state.new_id("pipeline")
    state.pipelines[pid] = {
        "id": pid,
        "name": name,
        "display_name": body.get("display_name") or name,
        "description": body.get("description", ""),
        "namespace": ns,
        "versions": {},
    }
    return _pipeline(state.pipelines[pid])


def upload_pipeline_version(state: StandinState, req: Request) -> dict:
    pid = req.query.get("pipelineid", "")
    if pid not in state.pipelines:
        raise Refused(400, f"Failed to create a pipeline version: no pipeline {pid!r}")
    filename, data = req.body["uploadfile"]
    name = req.query.get("name") or req.query.get("display_name") or filename
    docs = list(yaml.safe_load_all(data))
    if not docs or "pipelineInfo" not in docs[0] or "root" not in docs[0]:
        raise Refused(400, "the uploaded file is not a compiled KFP pipeline")
    versions = state.pipelines[pid]["versions"]
    if any(v["name"] == name for v in versions.values()):
        raise Refused(409, f"version {name!r} exists in pipeline {pid}")
    vid = state.new_id("version")
    versions[vid] = {
        "id": vid,
        "name": name,
        "display_name": req.query.get("display_name") or name,
        "description": req.query.get("description", ""),
        "spec": docs[0],
        "parameters": docs[0]["root"].get("inputDefinitions", {}).get("parameters", {}),
    }
    return _version(pid, versions[vid])


def list_pipeline_versions(state: StandinState, req: Request) -> dict:
    pairs = _predicates(req, VERSION_KEYS)
    pid = req.path_params["pipeline_id"]
    if pid not in state.pipelines:
        raise Refused(404, f"no pipeline {pid}")
    found = _select(state.pipelines[pid]["versions"], pairs, req)
    return _proto(
        {"pipeline_versions": [_version(pid, v) for v in found], "total_size": len(found)}
    )


def _experiment_namespace(state: StandinState, ns: str) -> str:
    if state.multi_user and not ns:
        raise Refused(400, "An experiment cannot have an empty namespace in multi-user mode")
    return ns


def list_experiments(state: StandinState, req: Request) -> dict:
    pairs = _predicates(req, EXPERIMENT_KEYS)
    ns = _experiment_namespace(state, state.namespace(req.query.get("namespace")))
    pool = {k: e for k, e in state.experiments.items() if e["namespace"] == ns}
    found = [
        _proto({"experiment_id": e["id"], "display_name": e["display_name"], "namespace": ns})
        for e in _select(pool, pairs, req)
    ]
    return _proto({"experiments": found, "total_size": len(found)})


def create_experiment(state: StandinState, req: Request) -> dict:
    name = req.body.get("display_name", "")
    if not name:
        raise Refused(400, "Experiment must have a non-empty name")
    ns = _experiment_namespace(state, state.namespace(req.body.get("namespace")))
    if any(e["display_name"] == name and e["namespace"] == ns for e in state.experiments.values()):
        raise Refused(409, f"an experiment named {name!r} exists in namespace {ns!r}")
    eid = state.new_id("experiment")
    state.experiments[eid] = {"id": eid, "display_name": name, "namespace": ns}
    return _proto({"experiment_id": eid, "display_name": name, "namespace": ns})


def _check_job(state: StandinState, body: dict, *, recurring: bool) -> str:
    """Refuse what the server refuses of a run or recurring run; its namespace."""
    if not body.get("display_name"):
        raise Refused(400, "The run name is empty. Please specify a valid name")
    eid = body.get("experiment_id", "")
    if not eid:
        if state.multi_user:
            raise Refused(400, "Experiment id can not be empty in multi-user mode")
        raise Unsupported("a run without experiment_id goes to the default experiment")
    if eid not in state.experiments:
        raise Refused(404, f"no experiment {eid}")
    ns = state.experiments[eid]["namespace"]
    if body.get("namespace") and state.namespace(body["namespace"]) != ns:
        raise Refused(400, f"Experiment {eid} belongs to namespace '{ns}'")
    ref = body.get("pipeline_version_reference") or {}
    pipeline = state.pipelines.get(ref.get("pipeline_id"))
    if pipeline is None or ref.get("pipeline_version_id") not in pipeline["versions"]:
        raise Refused(404, f"unknown pipeline version reference {ref}")
    params = (body.get("runtime_config") or {}).get("parameters") or {}
    expected = set(pipeline["versions"][ref["pipeline_version_id"]]["parameters"])
    if not set(params) <= expected:
        raise Refused(400, f"parameters {sorted(set(params) - expected)} are not pipeline inputs")
    if recurring:
        cron = ((body.get("trigger") or {}).get("cron_schedule") or {}).get("cron", "")
        if len(cron.split()) != 6:
            raise Refused(400, f"cron must have 6 fields, got {cron!r}")
        if not 1 <= int(body.get("max_concurrency") or 0) <= 10:
            raise Refused(400, "max concurrency must be in [1, 10]")
    return ns


def create_run(state: StandinState, req: Request) -> dict:
    ns = _check_job(state, req.body, recurring=False)
    rid = state.new_id("run")
    state.runs[rid] = {**req.body, "namespace": ns}
    keep = ("display_name", "experiment_id", "service_account")
    return _proto({"run_id": rid, **{k: req.body.get(k) for k in keep}})


def create_recurring_run(state: StandinState, req: Request) -> dict:
    ns = _check_job(state, req.body, recurring=True)
    rid = state.new_id("recurring")
    state.recurring_runs[rid] = {**req.body, "id": rid, "namespace": ns}
    keep = ("display_name", "experiment_id", "service_account", "mode")
    return _proto({"recurring_run_id": rid, "namespace": ns, **{k: req.body.get(k) for k in keep}})


def list_recurring_runs(state: StandinState, req: Request) -> dict:
    pairs = _predicates(req, JOB_KEYS)
    ns = state.namespace(req.query.get("namespace"))
    eid = req.query.get("experiment_id", "")
    if eid:
        if eid not in state.experiments:
            raise Refused(404, f"no experiment {eid}")
        pool = {k: r for k, r in state.recurring_runs.items() if r["experiment_id"] == eid}
    elif state.multi_user and not ns:
        raise Refused(400, "a recurring run cannot have an empty namespace in multi-user mode")
    else:
        pool = {k: r for k, r in state.recurring_runs.items() if r["namespace"] == ns}
    found = [
        _proto({"recurring_run_id": r["id"], "display_name": r["display_name"]})
        for r in _select(pool, pairs, req)
    ]
    # The proto field is named recurringRuns (backend/api/v2beta1/recurring_run.proto).
    return _proto({"recurringRuns": found, "total_size": len(found)})


def _set_mode(mode: str):
    def handler(state: StandinState, req: Request) -> dict:
        rid = req.path_params["recurring_run_id"]
        if rid not in state.recurring_runs:
            raise Refused(404, f"no recurring run {rid}")
        state.recurring_runs[rid]["mode"] = mode
        return {}

    return handler


HANDLERS = {
    "healthz_service_get_healthz": healthz,
    "pipeline_service_list_pipelines": list_pipelines,
    "pipeline_service_create_pipeline": create_pipeline,
    "upload_pipeline_version": upload_pipeline_version,
    "pipeline_service_list_pipeline_versions": list_pipeline_versions,
    "experiment_service_list_experiments": list_experiments,
    "experiment_service_create_experiment": create_experiment,
    "run_service_create_run": create_run,
    "recurring_run_service_create_recurring_run": create_recurring_run,
    "recurring_run_service_list_recurring_runs": list_recurring_runs,
    "recurring_run_service_enable_recurring_run": _set_mode("ENABLE"),
    "recurring_run_service_disable_recurring_run": _set_mode("DISABLE"),
}
