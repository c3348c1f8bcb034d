"""Submitting to a Kubeflow Pipelines backend: upload, run, schedule, pause, resume.

Uses `kfp.Client` (the KFP v2beta1 REST API). Before anything else it reads the server's
healthz (`check_backend`): a backend older than `MIN_BACKEND` (KFP 2.15) is refused, with
the reason; a build that reports no release number ("unknown", "master") gets a warning; a
multi-user server needs a namespace.

Where things live (as the KFP 2.15 API server applies namespaces):

- single-user: one pool; the server ignores any namespace a request names.
- multi-user: the pipeline, its versions, the experiment, runs and recurring runs all live
  in the profile namespace (`Connection.namespace`): pipelines are listed and created there
  (not among the shared pipelines, which a list without namespace returns), the experiment
  is found or created there, and runs and recurring runs take its namespace.

A pipeline is created once under its name (the unique key within a namespace); each
different YAML becomes a version of it named after its content hash, so submitting unchanged
code reuses the version already there. Runs and recurring runs go into an experiment
(created on first use) and run as `service_account` (the config's
`kubernetes.service_account`; None: the namespace's default account). A recurring run of
`replay_iteration` is created with max concurrency 1 and no catch-up: one iteration at a
time, and a paused schedule does not fire a backlog of runs when it is resumed.

Knows nothing about steps or storage: it sends YAML files and parameters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayrl.errors import ReplayRLError

log = logging.getLogger(__name__)

# The oldest KFP backend replayrl's pipelines run on. Their pods take MLflow credentials and
# the endpoints from Secrets/ConfigMaps marked optional (kfp-kubernetes `optional=True`);
# KFP's driver sets that field on the pod only from 2.15.0 (kubeflow/pipelines#12216,
# backend/src/v2/driver/k8s.go), and an older one drops it, so a pod whose Secret or key is
# missing waits in CreateContainerConfigError, holding its GPU.
MIN_BACKEND = (2, 15, 0)
# A release number as the API server reports it in healthz `tag_name` (the TAG_NAME its
# image was built with: "2.15.0"; "unknown" when built without one, "master" from master).
_RELEASE = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-+.][0-9A-Za-z.-]*)?")


@dataclass(frozen=True)
class Connection:
    host: str | None  # e.g. https://kubeflow.example.com/pipeline; None: kfp.Client's default
    token: str | None = None  # bearer token (e.g. a service account token)
    namespace: str | None = None  # the profile namespace of a multi-user deployment
    # The session cookie of the Kubeflow login, copied from the browser: "oauth2_proxy=..."
    # behind oauth2-proxy (Kubeflow 1.9 and later); "authservice_session=..." before 1.9.
    cookies: str | None = None


@dataclass(frozen=True)
class Backend:
    """What the server's healthz says: `tag_name`, `multi_user`."""

    version: str  # e.g. "2.15.0"; "unknown" for a build without a release number
    multi_user: bool


@dataclass(frozen=True)
class Uploaded:
    pipeline_id: str
    version_id: str
    version_name: str


@dataclass(frozen=True)
class Submitted:
    uploaded: Uploaded
    experiment_id: str
    run_id: str
    namespace: str | None  # where it went; None on a single-user server


@dataclass(frozen=True)
class Scheduled:
    uploaded: Uploaded
    experiment_id: str
    recurring_run_id: str
    cron: str
    namespace: str | None


def connect(conn: Connection):
    """A kfp.Client, or a ReplayRLError that says which host failed and how to fix it."""
    import kfp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "only works with KFP v2.0.0-beta.2+"
        try:
            return kfp.Client(
                host=conn.host,
                existing_token=conn.token,
                namespace=conn.namespace or "kubeflow",
                cookies=conn.cookies,
            )
        except Exception as e:
            raise _unreachable(conn, e) from None


def _unreachable(conn: Connection, e: Exception) -> ReplayRLError:
    host = conn.host or "the in-cluster default (no --host, no KF_PIPELINES_ENDPOINT)"
    return ReplayRLError(
        f"Cannot talk to Kubeflow Pipelines at {host}: {e.__class__.__name__}: {_short(e)}. "
        f"Pass --host (or set KF_PIPELINES_ENDPOINT) and, if the endpoint needs auth, --token "
        f"or --cookies."
    )


def _short(e: Exception) -> str:
    body = getattr(e, "body", None)
    text = f"{getattr(e, 'status', '')} {body}" if body else str(e)
    return " ".join(text.split())[:400]


def _call(conn: Connection, what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ReplayRLError:
        raise
    except Exception as e:
        raise _failed(conn, what, e) from None


def _failed(conn: Connection, what: str, e: Exception) -> ReplayRLError:
    if e.__class__.__name__ == "ApiException":
        return ReplayRLError(
            f"Kubeflow Pipelines refused to {what}: {_short(e)}. Check --namespace and that "
            f"your credentials may {what}."
        )
    return _unreachable(conn, e)


def _equals(key: str, value: str) -> str:
    """A list filter `key == value`. Keys the server accepts per resource are in the
    APIToModelFieldMap of backend/src/apiserver/model/*.go: pipelines and pipeline versions
    have `name` (their unique key) and `display_name`; experiments `display_name` (their
    unique Name column); recurring runs `display_name`."""
    return json.dumps({"predicates": [{"key": key, "operation": "EQUALS", "string_value": value}]})


def parse_version(tag: str) -> tuple[int, int, int] | None:
    """(2, 15, 0) from "2.15.0", "v2.15.0" or "2.15.0-rc.1"; None from "unknown", "master"."""
    m = _RELEASE.fullmatch(tag.strip())
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def read_backend(client, conn: Connection) -> Backend:
    """The server's healthz: its version and whether it is multi-user; a ReplayRLError when
    it cannot be read (no KFP 2 API server there, or unreachable)."""
    host = conn.host or "the in-cluster endpoint"
    try:
        # The raw answer: apiserver/main.go writes tag_name and commit_sha beside the
        # documented multi_user and pipeline_store, and the generated model drops them.
        raw = client._healthz_api.healthz_service_get_healthz(_preload_content=False)
        health = json.loads(raw.data or b"{}")
    except ValueError:  # not JSON: no version to read
        health = {}
    except Exception as e:
        if getattr(e, "status", None) == 404:
            raise ReplayRLError(
                f"{host} has no /apis/v2beta1/healthz: not a Kubeflow Pipelines 2 API server "
                f"(replayrl needs KFP {_dotted(MIN_BACKEND)} or newer); check --host."
            ) from None
        raise _failed(conn, "report its health", e) from None
    if not isinstance(health, dict):
        health = {}
    backend = Backend(str(health.get("tag_name") or "unknown"), health.get("multi_user") is True)
    return backend


def check_backend(client, conn: Connection) -> tuple[Backend, Connection]:
    """Read the server's healthz; refuse a backend older than MIN_BACKEND and a multi-user
    one without a namespace. Returns it and the connection with the namespace to use: on a
    multi-user server the one given, else the one kfp.Client found (its context file, or in
    a pod the pod's namespace); on a single-user server None."""
    host = conn.host or "the in-cluster endpoint"
    backend = read_backend(client, conn)
    found = parse_version(backend.version)
    if found is None:
        log.warning(
            "Kubeflow Pipelines at %s reports version %r, not a release number, so replayrl "
            "cannot check that it is %s or newer (older drivers drop the optional Secrets and "
            "ConfigMaps the pods use); going on.",
            host,
            backend.version,
            _dotted(MIN_BACKEND),
        )
    elif found < MIN_BACKEND:
        raise ReplayRLError(
            f"Kubeflow Pipelines at {host} is version {backend.version}; replayrl needs "
            f"{_dotted(MIN_BACKEND)} or newer: its pods take MLflow credentials and endpoints "
            f"from optional Secrets/ConfigMaps, which older KFP drivers make required, so a pod "
            f"whose Secret or key is missing waits in CreateContainerConfigError holding its "
            f"GPU. Upgrade Kubeflow Pipelines."
        )
    namespace = conn.namespace or client.get_user_namespace() or None
    if not backend.multi_user:
        # A single-user server puts everything in one pool and ignores any namespace
        # (ResourceManager.ReplaceNamespace, resource/resource_manager.go): send none.
        if conn.namespace:
            log.info("%s is single-user: namespace %s does not apply", host, conn.namespace)
        namespace = None
    elif not namespace:
        raise ReplayRLError(
            f"Kubeflow Pipelines at {host} is multi-user: pass --namespace (or set "
            f"KF_PIPELINES_NAMESPACE) with your profile namespace."
        )
    return backend, dataclasses.replace(conn, namespace=namespace)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def parameter_guide(package: Path, *, limit: int = 1500) -> str:
    """A short guide to a compiled pipeline's run parameters, from their descriptions in the
    YAML (the pipeline function's docstring), for the pipeline version's description: the
    KFP UI shows a version's description on its page, while neither the UI nor the API
    server reads `pipelineInfo.description` or the parameters' own descriptions (the run form
    labels a parameter `name - STRING`). Empty for an archive package."""
    if Path(package).suffix not in (".yaml", ".yml"):
        return ""
    import yaml

    spec = next(yaml.safe_load_all(Path(package).read_text()), None) or {}
    params = spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    lines = [spec.get("pipelineInfo", {}).get("description", "").strip()]
    lines += [f"{name}: {p.get('description', '').strip()}" for name, p in params.items()]
    text = "\n".join(line for line in lines if line)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def upload(client, conn: Connection, *, package: Path, pipeline_name: str) -> Uploaded:
    """Make sure `package` is a version of pipeline `pipeline_name` in `conn.namespace`:
    versions are named `<pipeline>-<sha256 of the YAML>`, so an unchanged YAML reuses its
    version."""
    import kfp_server_api

    digest = hashlib.sha256(Path(package).read_bytes()).hexdigest()[:12]
    version_name = f"{pipeline_name}-{digest}"
    # Within the namespace: the server lists exactly the pipelines whose namespace is the one
    # asked for (storage/pipeline_store.go ListPipelines), so without it a multi-user server
    # answers the shared pipelines and the second submit would try to create a duplicate.
    found = _call(
        conn,
        "list pipelines",
        client.list_pipelines,
        namespace=conn.namespace,
        filter=_equals("name", pipeline_name),
    )
    if not found.pipelines:
        # An empty pipeline, then the YAML as its first version: `upload_pipeline` would name
        # the first version after the pipeline, and the next submit could not recognise it.
        pipeline = _call(
            conn,
            "create a pipeline",
            client._pipelines_api.pipeline_service_create_pipeline,
            pipeline=kfp_server_api.V2beta1Pipeline(
                name=pipeline_name,
                display_name=pipeline_name,
                description="replayrl: RL post-training with experience replay",
                namespace=conn.namespace,
            ),
        )
        pipeline_id = pipeline.pipeline_id
    else:
        pipeline_id = found.pipelines[0].pipeline_id
        existing = _call(
            conn,
            "list pipeline versions",
            client.list_pipeline_versions,
            pipeline_id,
            filter=_equals("name", version_name),
        )
        if existing.pipeline_versions:
            found = existing.pipeline_versions[0]
            log.info("pipeline %s: version %s is already uploaded", pipeline_name, version_name)
            return Uploaded(pipeline_id, found.pipeline_version_id, version_name)
    version = _call(
        conn,
        "upload a pipeline version",
        client.upload_pipeline_version,
        str(package),
        pipeline_version_name=version_name,
        pipeline_id=pipeline_id,
        description=parameter_guide(package) or None,
    )
    return Uploaded(pipeline_id, version.pipeline_version_id, version_name)


def pipeline_name(package: Path, default: str) -> str:
    """The name a compiled YAML package gives its pipeline (`pipelineInfo.name`, e.g.
    replay-loop for replay_loop.yaml): what it is uploaded as, so the file, the spec and the
    KFP UI's pipeline list say one name. `default` for an archive package."""
    if Path(package).suffix not in (".yaml", ".yml"):
        return default
    import yaml

    spec = next(yaml.safe_load_all(Path(package).read_text()), None)
    return (spec or {}).get("pipelineInfo", {}).get("name") or default


def pipeline_root(package: Path) -> str | None:
    """The pipeline root compiled into a YAML package (`kubernetes.pipeline_root`), or None.

    A KFP backend takes a run's pipeline root only from the run request, else from the
    namespace's kfp-launcher ConfigMap: its driver never reads the spec's `defaultPipelineRoot`
    (only the UI's run form fills it in). So submit and schedule send it with every run."""
    if Path(package).suffix not in (".yaml", ".yml"):
        return None  # an archive package: KFP's default applies
    import yaml

    spec = next(yaml.safe_load_all(Path(package).read_text()), None)
    return (spec or {}).get("defaultPipelineRoot") or None


def _find_experiment(client, conn: Connection, name: str) -> str | None:
    # Experiments are listed in exactly the namespace asked for; a multi-user server refuses
    # an empty one (server/experiment_server.go listExperiments, canAccessExperiment).
    found = _call(
        conn,
        "list experiments",
        client._experiment_api.experiment_service_list_experiments,
        namespace=conn.namespace,
        filter=_equals("display_name", name),
    )
    return found.experiments[0].experiment_id if found.experiments else None


def _experiment_id(client, conn: Connection, name: str) -> str:
    """The experiment `name` in the namespace, created there if missing."""
    import kfp_server_api

    found = _find_experiment(client, conn, name)
    if found is not None:
        return found
    experiment = _call(
        conn,
        "create an experiment",
        client._experiment_api.experiment_service_create_experiment,
        experiment=kfp_server_api.V2beta1Experiment(display_name=name, namespace=conn.namespace),
    )
    return experiment.experiment_id


def submit(
    conn: Connection,
    *,
    package: Path,
    pipeline_name: str,
    experiment: str,
    run_name: str,
    params: dict[str, Any],
    service_account: str | None = None,
) -> Submitted:
    """Upload (or reuse) the pipeline version and start one run of it, as `service_account`
    (None or "": the namespace's default account)."""
    client = connect(conn)
    _, conn = check_backend(client, conn)
    uploaded = upload(client, conn, package=package, pipeline_name=pipeline_name)
    experiment_id = _experiment_id(client, conn, experiment)
    run = _call(
        conn,
        "create a run",
        client.run_pipeline,
        experiment_id=experiment_id,
        job_name=run_name,
        pipeline_root=pipeline_root(package),
        params=params,
        pipeline_id=uploaded.pipeline_id,
        version_id=uploaded.version_id,
        service_account=service_account or None,
    )
    return Submitted(uploaded, experiment_id, run.run_id, conn.namespace)


def normalize_cron(expression: str) -> str:
    """KFP's cron has six fields (seconds first); a usual five-field expression gets "0 "."""
    fields = expression.split()
    if len(fields) == 5:
        fields = ["0", *fields]
    if len(fields) != 6:
        raise ReplayRLError(
            f"--cron '{expression}' is not a cron expression: use five fields "
            f"('0 * * * *' = hourly) or KFP's six (seconds first: '0 0 * * * *')."
        )
    return " ".join(fields)


def schedule(
    conn: Connection,
    *,
    package: Path,
    pipeline_name: str,
    experiment: str,
    job_name: str,
    cron: str,
    params: dict[str, Any],
    service_account: str | None = None,
) -> Scheduled:
    """A recurring run: max concurrency 1, no catch-up, enabled, as `service_account`."""
    cron = normalize_cron(cron)
    client = connect(conn)
    _, conn = check_backend(client, conn)
    uploaded = upload(client, conn, package=package, pipeline_name=pipeline_name)
    experiment_id = _experiment_id(client, conn, experiment)
    existing = _find_recurring(client, conn, experiment_id, job_name)
    if existing is not None:
        raise ReplayRLError(
            f"A recurring run named '{job_name}' already exists ({existing}); pause it with "
            f"`replayrl schedule pause --name {job_name}`, or pick another --name."
        )
    job = _call(
        conn,
        "create a recurring run",
        client.create_recurring_run,
        experiment_id=experiment_id,
        job_name=job_name,
        pipeline_root=pipeline_root(package),
        description="replayrl: one iteration per trigger",
        cron_expression=cron,
        max_concurrency=1,
        no_catchup=True,
        params=params,
        pipeline_id=uploaded.pipeline_id,
        version_id=uploaded.version_id,
        enabled=True,
        service_account=service_account or None,
    )
    return Scheduled(uploaded, experiment_id, job.recurring_run_id, cron, conn.namespace)


def _find_recurring(client, conn: Connection, experiment_id: str, name: str) -> str | None:
    # By experiment: the server lists the experiment's recurring runs in its namespace
    # (server/job_server.go listJobs); a name is unique only by our convention.
    found = _call(
        conn,
        "list recurring runs",
        client.list_recurring_runs,
        experiment_id=experiment_id,
        filter=_equals("display_name", name),
    )
    runs = found.recurring_runs or []
    return runs[0].recurring_run_id if runs else None


def set_enabled(
    conn: Connection,
    *,
    enabled: bool,
    recurring_run_id: str | None = None,
    name: str | None = None,
    experiment: str = "replayrl",
) -> str:
    """Resume (enabled) or pause a recurring run, by id or by name (in the namespace's
    experiment `experiment`); returns its id."""
    if recurring_run_id is None and not name:
        raise ReplayRLError("Name the recurring run: --name NAME or --id ID.")
    client = connect(conn)
    # Resuming on a backend below the floor would start runs whose pods cannot start.
    _, conn = check_backend(client, conn)
    if recurring_run_id is None:
        experiment_id = _find_experiment(client, conn, experiment)
        if experiment_id is None:
            where = f" in namespace '{conn.namespace}'" if conn.namespace else ""
            raise ReplayRLError(
                f"No experiment '{experiment}'{where} on {conn.host}; check --experiment and "
                f"--namespace."
            )
        recurring_run_id = _find_recurring(client, conn, experiment_id, name)
        if recurring_run_id is None:
            raise ReplayRLError(
                f"No recurring run named '{name}' in experiment '{experiment}'; check --name "
                f"and --experiment."
            )
    action = client.enable_recurring_run if enabled else client.disable_recurring_run
    _call(
        conn,
        "resume a recurring run" if enabled else "pause a recurring run",
        action,
        recurring_run_id,
    )
    return recurring_run_id
