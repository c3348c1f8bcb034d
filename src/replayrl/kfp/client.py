"""Submitting to a Kubeflow Pipelines backend: upload, run, schedule, pause, resume.

Uses `kfp.Client` (the KFP v2beta1 REST API). A pipeline is created once under its name;
each different YAML becomes a version of it named after its content hash, so submitting
unchanged code reuses the version already there. Runs and recurring runs go into an
experiment (created on first use). A recurring run of `replay_iteration` is created with
max concurrency 1 and no catch-up: one iteration at a time, and a paused schedule does not
fire a backlog of runs when it is resumed.

Knows nothing about steps or storage: it sends YAML files and parameters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayrl.errors import ReplayRLError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Connection:
    host: str | None  # e.g. https://kubeflow.example.com/pipeline; None: kfp.Client's default
    token: str | None = None  # bearer token (e.g. a service account token)
    namespace: str | None = None  # the profile namespace of a multi-user deployment
    cookies: str | None = None  # e.g. "authservice_session=..." behind Dex/oauth2-proxy


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


@dataclass(frozen=True)
class Scheduled:
    uploaded: Uploaded
    experiment_id: str
    recurring_run_id: str
    cron: str


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
        if e.__class__.__name__ == "ApiException":
            raise ReplayRLError(
                f"Kubeflow Pipelines refused to {what}: {_short(e)}. Check --namespace and that "
                f"your credentials may {what}."
            ) from None
        raise _unreachable(conn, e) from None


def _filter_by_name(name: str) -> str:
    return json.dumps(
        {"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": name}]}
    )


def upload(client, conn: Connection, *, package: Path, pipeline_name: str) -> Uploaded:
    """Make sure `package` is a version of pipeline `pipeline_name`: versions are named
    `<pipeline>-<sha256 of the YAML>`, so an unchanged YAML reuses its version."""
    import kfp_server_api

    digest = hashlib.sha256(Path(package).read_bytes()).hexdigest()[:12]
    version_name = f"{pipeline_name}-{digest}"
    pipeline_id = _call(conn, "list pipelines", client.get_pipeline_id, pipeline_name)
    if pipeline_id is None:
        # An empty pipeline, then the YAML as its first version: `upload_pipeline` would name
        # the first version after the pipeline, and the next submit could not recognise it.
        pipeline = _call(
            conn,
            "create a pipeline",
            client._pipelines_api.pipeline_service_create_pipeline,
            pipeline=kfp_server_api.V2beta1Pipeline(
                display_name=pipeline_name,
                description="replayrl: RL post-training with experience replay",
                namespace=conn.namespace,
            ),
        )
        pipeline_id = pipeline.pipeline_id
    else:
        existing = _call(
            conn,
            "list pipeline versions",
            client.list_pipeline_versions,
            pipeline_id,
            filter=_filter_by_name(version_name),
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
    )
    return Uploaded(pipeline_id, version.pipeline_version_id, version_name)


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


def _experiment_id(client, conn: Connection, name: str) -> str:
    experiment = _call(
        conn, "create an experiment", client.create_experiment, name, namespace=conn.namespace
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
) -> Submitted:
    """Upload (or reuse) the pipeline version and start one run of it."""
    client = connect(conn)
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
    )
    return Submitted(uploaded, experiment_id, run.run_id)


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
) -> Scheduled:
    """A recurring run: max concurrency 1, no catch-up, enabled."""
    cron = normalize_cron(cron)
    client = connect(conn)
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
    )
    return Scheduled(uploaded, experiment_id, job.recurring_run_id, cron)


def _find_recurring(client, conn: Connection, experiment_id: str, name: str) -> str | None:
    found = _call(
        conn,
        "list recurring runs",
        client.list_recurring_runs,
        experiment_id=experiment_id,
        filter=_filter_by_name(name),
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
    """Resume (enabled) or pause a recurring run, by id or by name; returns its id."""
    client = connect(conn)
    if recurring_run_id is None:
        if not name:
            raise ReplayRLError("Name the recurring run: --name NAME or --id ID.")
        try:
            found = client.get_experiment(experiment_name=experiment, namespace=conn.namespace)
        except ValueError:
            raise ReplayRLError(
                f"No experiment '{experiment}' on {conn.host}; check --experiment."
            ) from None
        except Exception as e:
            raise _unreachable(conn, e) from None
        recurring_run_id = _find_recurring(client, conn, found.experiment_id, name)
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
