"""The preflight's read-only view of the Kubernetes API (`replayrl.kfp.preflight` runs the
checks): a CoreV1Api client from a kubeconfig and context, else from the pod's own service
account (`kube_client`); the namespace of the kubeconfig's context, else the pod's own
(`kube_namespace`); and `Kube`, the lookups the checks make, each one GET or LIST with a
timeout: the object, None when absent (404), `_Forbidden` for 401/403 and `_Unreachable` for
anything else. Knows nothing about what the checks look for, KFP or the compiled pipeline;
reads no environment variable itself (the Kubernetes client reads KUBECONFIG).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from replayrl.errors import ReplayRLError

# Where a pod finds its own namespace (in-cluster).
POD_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_TIMEOUT_S = 15  # each Kubernetes API call


class _Forbidden(Exception):
    pass


class _Unreachable(Exception):
    pass


def kube_client(kubeconfig: str | None = None, context: str | None = None):
    """A CoreV1Api from `kubeconfig` (None: KUBECONFIG or ~/.kube/config) and `context`,
    else, in a pod, from the pod's own service account; a ReplayRLError when neither."""
    from kubernetes import client, config

    default = os.path.expanduser(config.KUBE_CONFIG_DEFAULT_LOCATION)
    try:
        if kubeconfig or os.path.exists(default.split(os.pathsep)[0]):
            api = config.new_client_from_config(
                config_file=kubeconfig, context=context, persist_config=False
            )
        else:
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            api = client.ApiClient(configuration)
    except (config.ConfigException, OSError, TypeError, ValueError) as e:
        raise ReplayRLError(
            f"No Kubernetes credentials for the preflight ({' '.join(str(e).split())[:200]}): "
            f"pass --kubeconfig (or set KUBECONFIG, or run in a pod), or --skip-preflight."
        ) from None
    return client.CoreV1Api(api)


def kube_namespace(kubeconfig: str | None = None, context: str | None = None) -> str | None:
    """The namespace of the kubeconfig's current (or named) context, else the pod's own."""
    from kubernetes import config

    with contextlib.suppress(Exception):
        contexts, current = config.list_kube_config_contexts(config_file=kubeconfig)
        chosen = next((c for c in contexts if c["name"] == context), None) if context else current
        if chosen and chosen.get("context", {}).get("namespace"):
            return chosen["context"]["namespace"]
    with contextlib.suppress(OSError):
        return Path(POD_NAMESPACE_FILE).read_text().strip() or None
    return None


class Kube:
    """Read-only lookups: the object, None when absent; `_Forbidden`, `_Unreachable`."""

    def __init__(self, core):
        self.core = core
        self.host = core.api_client.configuration.host

    def _call(self, fn, *args, **kwargs):
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, _request_timeout=_TIMEOUT_S, **kwargs)
        except ApiException as e:
            if e.status == 404:
                return None
            if e.status in (401, 403):
                raise _Forbidden(f"{e.status} {e.reason}") from None
            raise _Unreachable(f"{e.status} {e.reason}") from None
        except Exception as e:  # urllib3's connection errors
            raise _Unreachable(
                f"{e.__class__.__name__}: {' '.join(str(e).split())[:200]}"
            ) from None

    def namespace(self, name: str):
        return self._call(self.core.read_namespace, name)

    def service_account(self, name: str, namespace: str):
        return self._call(self.core.read_namespaced_service_account, name, namespace)

    def secret(self, name: str, namespace: str):
        return self._call(self.core.read_namespaced_secret, name, namespace)

    def config_map(self, name: str, namespace: str):
        return self._call(self.core.read_namespaced_config_map, name, namespace)

    def nodes(self):
        return self._call(self.core.list_node).items

    def cluster_objects(self, group: str, version: str, plural: str) -> list[dict] | None:
        """Every cluster-scoped custom object of a kind, as JSON; None when the API server
        does not serve the kind (its CRD is not installed)."""
        from kubernetes import client

        api = client.CustomObjectsApi(self.core.api_client)
        found = self._call(api.list_cluster_custom_object, group, version, plural)
        return None if found is None else list(found.get("items") or [])
