"""Our MLflow settings win in a Kubeflow pod, and the pod's log says which store it uses.

KFP 2.17's MLflow plugin, where an administrator enables it, injects into every step's
container `MLFLOW_TRACKING_URI` (its own server), `MLFLOW_RUN_ID` and `MLFLOW_EXPERIMENT_ID`
(a nested run it opened for the task), `MLFLOW_WORKSPACE`, `MLFLOW_TRACKING_AUTH` and
credentials. Beside the `replayrl-endpoints` ConfigMap's `MLFLOW_TRACKING_URI`, which one a
container sees depends on the order of its env entries, so it is not ours to rely on.
`settle` makes the config's choice explicit before any tracker is built: `tracking.uri`
when the config sets one (then also written over `$MLFLOW_TRACKING_URI`, as
`mlflow.set_tracking_uri` would, so any MLflow call in the pod or its child processes
agrees), else `$MLFLOW_TRACKING_URI`; the plugin's run and experiment
ids are dropped from the pod's environment, since every lineage logs to a run of its own
(a resumed lineage keeps the store its state.json names). It returns the one line a
component prints, credentials removed (`replayrl.logs`).

Knows nothing about pipelines or steps; changes the environment only inside a KFP pod.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from replayrl import logs
from replayrl.config import RunConfig

URI_ENV = "MLFLOW_TRACKING_URI"
# What the plugin sets that would send an MLflow call to its run instead of the lineage's.
PLUGIN_RUN_ENV = ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME")


def settle(cfg: RunConfig, environ: MutableMapping[str, str], *, in_pod: bool) -> str:
    """Apply `cfg`'s tracking settings over the environment (`in_pod`: a KFP pod, whose
    environment this process owns) and say which URI the step uses, in one line."""
    from_env = environ.get(URI_ENV) or None
    uri = cfg.tracking.uri or from_env
    dropped: list[str] = []
    if in_pod:
        if cfg.tracking.uri:
            logs.register(_password(cfg.tracking.uri))
            # What mlflow.set_tracking_uri does, without its process-wide state: MLflow's
            # default store, and the store of any process this step starts (the trainer's
            # `accelerate` workers), is then ours.
            environ[URI_ENV] = cfg.tracking.uri
        for key in PLUGIN_RUN_ENV:
            if environ.pop(key, None) is not None:
                dropped.append(key)
    if uri is None:
        line = "MLflow tracking: the run root's own store (tracking.uri and $MLFLOW_TRACKING_URI unset)"
    else:
        source = "tracking.uri" if cfg.tracking.uri else f"${URI_ENV}"
        line = f"MLflow tracking URI: {logs.without_credentials(uri)} (from {source})"
    if cfg.tracking.uri and from_env and from_env != cfg.tracking.uri:
        line += (
            f"; ${URI_ENV} ({logs.without_credentials(from_env)}, e.g. set by KFP's MLflow "
            f"plugin) is not used"
        )
    if dropped:
        line += f"; ignored {', '.join(dropped)} from the environment"
    return logs.redact(line)


def _password(uri: str) -> str | None:
    from urllib.parse import urlsplit

    return urlsplit(uri).password
