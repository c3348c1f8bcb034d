"""The kustomize manifests under k8s/, rendered with `kubectl kustomize` (offline) and checked
as objects: valid, strictly (an unknown field is an error), against the Kubernetes API schemas
of the oldest Kubernetes we support (`kubernetes-validate`, offline), and of the newest it
ships; nothing that Kubeflow owns in a run's namespace is created, changed or deleted; the
pipeline runner's RBAC is what KFP and Argo need and no more; images pinned, resources and
probes set, names and keys consistent with what the compiled pipelines read, and no
real-looking secrets anywhere.

Nothing is applied to a cluster; a rendering failure or a wrong object fails here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
COMPILED = sorted((ROOT / "pipelines" / "compiled").glob("*.yaml"))
OVERLAYS = ("dev", "prod")
# The oldest Kubernetes the manifests must work on (k8s/README.md says why): the oldest that
# KFP 2.15, the oldest KFP backend replayrl supports, is tested on in KFP's own CI.
OLDEST_KUBERNETES = "1.29"
# Kinds that kubernetes-validate has no schema for (CRDs), each with the reason it is rendered;
# validation skips exactly these. None today: the overlays render built-in kinds only.
NO_KUBERNETES_SCHEMA: dict[tuple[str, str], str] = {}
# What Kubeflow creates in a namespace where pipelines run: KFP's standalone install in its own
# namespace, and in a profile namespace the Profile (the namespace, default-editor,
# default-viewer) and the pipelines profile controller (its sync.py: kfp-launcher,
# metadata-grpc-configmap, artifact-repositories, mlpipeline-minio-artifact,
# ml-pipeline-ui-artifact). An overlay that rendered one would overwrite it on `kubectl apply
# -k` and delete it on `kubectl delete -k`.
KUBEFLOW_OWNED = {
    ("ConfigMap", "kfp-launcher"),
    ("ConfigMap", "metadata-grpc-configmap"),
    ("ConfigMap", "artifact-repositories"),
    ("Secret", "mlpipeline-minio-artifact"),
    ("ServiceAccount", "pipeline-runner"),
    ("ServiceAccount", "default-editor"),
    ("ServiceAccount", "default-viewer"),
    ("Deployment", "ml-pipeline-ui-artifact"),
    ("Service", "ml-pipeline-ui-artifact"),
}
RUNNER = "replayrl-pipeline-runner"
# What KFP v2's driver and launcher (2.15-2.17) and Argo's executor (3.4 and later) do with a
# run's service account token in its namespace (k8s/base/rbac.yaml says which does what):
# (verb, API group, resource, name).
RUNNER_NEEDS = [
    ("get", "", "configmaps", "kfp-launcher"),
    ("get", "", "secrets", "mlpipeline-minio-artifact"),
    ("get", "", "pods", "replay-loop-abcde-system-container-impl-123"),
    ("create", "argoproj.io", "workflowtaskresults", None),
    ("patch", "argoproj.io", "workflowtaskresults", "replay-loop-abcde-123"),
    # A given-up asynchronous segment stops its run when a peer pod stays Pending.
    ("list", "", "pods", None),
    ("patch", "argoproj.io", "workflows", "async-segment-abcde"),
    # A trainer on several nodes: the launcher's TrainJob (src/replayrl/kfp/trainjob.py).
    ("create", "trainer.kubeflow.org", "trainjobs", None),
    ("get", "trainer.kubeflow.org", "trainjobs", "replayrl-trainer-0a1b2c3d4e5f"),
    ("delete", "trainer.kubeflow.org", "trainjobs", "replayrl-trainer-0a1b2c3d4e5f"),
]
# ...and what it must not be able to do: the Secrets the steps read reach them as env through
# the kubelet, and nothing in a run changes KFP's config or other pods (it stops its own
# workflow, which has Argo end them).
RUNNER_MUST_NOT = [
    ("get", "", "secrets", "replayrl-s3"),
    ("list", "", "secrets", None),
    ("get", "", "configmaps", "replayrl-endpoints"),
    ("update", "", "configmaps", "kfp-launcher"),
    ("delete", "", "pods", "replay-loop-abcde-system-container-impl-123"),
    ("create", "", "pods", None),
    ("patch", "", "pods", "replay-loop-abcde-system-container-impl-123"),
    ("get", "argoproj.io", "workflows", "replay-loop-abcde"),
    ("delete", "argoproj.io", "workflows", "replay-loop-abcde"),
    ("update", "argoproj.io", "workflows", "replay-loop-abcde"),
    ("list", "trainer.kubeflow.org", "trainjobs", None),
    ("patch", "trainer.kubeflow.org", "trainjobs", "replayrl-trainer-0a1b2c3d4e5f"),
    ("create", "trainer.kubeflow.org", "clustertrainingruntimes", None),
]
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
# A Secret value in the repository is a template: empty ("not set") or an obvious placeholder.
PLACEHOLDER = re.compile(r"^(CHANGE-ME[-a-z]*)?$")
CREDENTIAL_LOOKALIKES = (
    re.compile(r"AKIA[0-9A-Z]{16}"),  # AWS access key id
    re.compile(r"(?<![A-Za-z0-9/+])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])"),  # AWS secret key shape
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"gh[pousr]_[A-Za-z0-9]{36}"),
)


@cache
def render(target: str) -> tuple[dict, ...]:
    if not Path(KUBECTL).exists():
        pytest.fail("kubectl is needed to render k8s/ (kubectl kustomize works offline)")
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / target)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, f"kubectl kustomize {target} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def objects(target: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in render(target) if o["kind"] == kind}


def pod_specs(target: str):
    for o in render(target):
        if o["kind"] in WORKLOADS:
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]


def secret_data(secret: dict) -> dict[str, str]:
    import base64

    data = dict(secret.get("stringData") or {})
    for key, value in (secret.get("data") or {}).items():
        data[key] = base64.b64decode(value).decode()
    return data


def manifest_documents() -> list[dict]:
    """Every object and patch under k8s/: the YAML files' documents, and the inline patches
    and patch targets of the kustomizations."""
    docs = []
    for path in K8S.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            docs.append(doc)
            for patch in (
                doc.get("patches", []) if doc["kind"] in ("Kustomization", "Component") else []
            ):
                if "patch" in patch:
                    docs += [d for d in yaml.safe_load_all(patch["patch"]) if isinstance(d, dict)]
                if "target" in patch:
                    target = patch["target"]
                    docs.append(
                        {"kind": target.get("kind"), "metadata": {"name": target.get("name")}}
                    )
    return docs


@cache
def pipeline_references() -> dict[str, list[tuple[str, str, set[str], bool]]]:
    """From the compiled pipelines' Kubernetes platform spec: (executor, name, keys, optional)
    of every Secret and ConfigMap set as env."""
    refs: dict[str, list] = {"Secret": [], "ConfigMap": []}
    for path in COMPILED:
        for doc in yaml.safe_load_all(path.read_text()):
            executors = (
                (doc or {})
                .get("platforms", {})
                .get("kubernetes", {})
                .get("deploymentSpec", {})
                .get("executors", {})
            )
            for executor, spec in executors.items():
                for s in spec.get("secretAsEnv", []):
                    keys = {k["secretKey"] for k in s["keyToEnv"]}
                    refs["Secret"].append((executor, s["secretName"], keys, s.get("optional")))
                for c in spec.get("configMapAsEnv", []):
                    keys = {k["configMapKey"] for k in c["keyToEnv"]}
                    refs["ConfigMap"].append(
                        (executor, c["configMapName"], keys, c.get("optional"))
                    )
    return refs


def test_the_compiled_pipelines_reference_secrets_and_config_maps():
    # Guards the checks below against passing vacuously on an empty platform spec.
    refs = pipeline_references()
    assert COMPILED, "pipelines/compiled/*.yaml is missing; run `replayrl compile`"
    assert {name for _, name, _, _ in refs["Secret"]} == {
        "replayrl-s3",
        "replayrl-mlflow",
        "replayrl-hf",
    }
    assert {name for _, name, _, _ in refs["ConfigMap"]} == {"replayrl-endpoints"}


def allowed(rules: list[dict], verb: str, group: str, resource: str, name: str | None) -> bool:
    """Whether RBAC `rules` allow a request, as the API server decides it: a rule with
    resourceNames never matches a request without a name (list, create)."""
    for rule in rules:
        names = rule.get("resourceNames")
        if (
            group in rule.get("apiGroups", [])
            and resource in rule.get("resources", [])
            and (verb in rule.get("verbs", []) or "*" in rule.get("verbs", []))
            and (not names or name in names)
        ):
            return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_the_runner_in_one_namespace(overlay):
    target = f"overlays/{overlay}"
    namespaces = {o["metadata"].get("namespace") for o in render(target)} - {None}
    assert len(namespaces) == 1, f"{overlay}: objects spread over namespaces {namespaces}"
    (namespace,) = namespaces
    assert RUNNER in objects(target, "ServiceAccount")
    binding = objects(target, "RoleBinding")[RUNNER]
    assert binding["roleRef"]["name"] in objects(target, "Role")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": RUNNER, "namespace": namespace}
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_runner_may_do_what_kfp_and_argo_need_and_no_more(overlay):
    rules = objects(f"overlays/{overlay}", "Role")[RUNNER]["rules"]
    for request in RUNNER_NEEDS:
        assert allowed(rules, *request), f"{overlay}: {RUNNER} may not {request}"
    for request in RUNNER_MUST_NOT:
        assert not allowed(rules, *request), f"{overlay}: {RUNNER} may {request}"
    assert not any("*" in rule.get(key, []) for rule in rules for key in rule), "no wildcards"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_overlay_renders_a_namespace_or_anything_kubeflow_owns(overlay):
    # Neither a Namespace (the KFP install or the Profile creates it; a Profile will not adopt
    # one that exists) nor KFP's own objects, kfp-launcher above all: the pipeline root is
    # `kubernetes.pipeline_root`, compiled into the pipelines.
    rendered = render(f"overlays/{overlay}")
    assert not [o for o in rendered if o["kind"] == "Namespace"]
    owned = {(o["kind"], o["metadata"]["name"]) for o in rendered} & KUBEFLOW_OWNED
    assert not owned, f"{overlay} renders objects Kubeflow owns: {sorted(owned)}"


def test_no_file_creates_patches_or_deletes_a_namespace_or_anything_kubeflow_owns():
    # A patch of an object no overlay renders, or a `$patch: delete`, renders nothing, yet
    # `kubectl apply -k` / `kubectl delete -k` would still reach the object.
    assert not [d for d in manifest_documents() if d["kind"] == "Namespace"]
    patched = {(d["kind"], d.get("metadata", {}).get("name")) for d in manifest_documents()}
    assert not patched & KUBEFLOW_OWNED, sorted(patched & KUBEFLOW_OWNED)


def test_dev_stays_in_kfps_namespace_and_prod_only_in_the_profiles():
    # Standalone KFP runs pipeline pods in its own namespace; a profile's owner may create
    # objects only in the profile's namespace, so prod holds no cluster-scoped object.
    assert {o["metadata"].get("namespace") for o in render("overlays/dev")} <= {"kubeflow", None}
    assert {o["metadata"].get("namespace") for o in render("overlays/prod")} == {"replayrl"}
    assert objects("overlays/prod", "PriorityClass") == {}
    for target in ("overlays/dev", "cluster"):
        priority = objects(target, "PriorityClass")["replayrl-gpu"]
        assert priority["value"] > 0 and not priority.get("globalDefault", False)


def validation_errors(obj: dict, version: str) -> list[str]:
    """Why `obj` is not a valid object of Kubernetes `version`, strictly (no unknown fields)."""
    where = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError as e:
        return [
            f"{where}: {e.message}: an API that Kubernetes {version} does not serve, or a CRD "
            f"(then name it in NO_KUBERNETES_SCHEMA with the reason)"
        ]
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.absolute_path)
        return [f"{where}: {path}: {e.message}"]
    return []


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_is_valid_strictly_for_kubernetes(overlay, version):
    # The oldest version we support, and the newest schemas shipped (an API removed since).
    errors = []
    for obj in render(f"overlays/{overlay}"):
        if (obj["apiVersion"], obj["kind"]) not in NO_KUBERNETES_SCHEMA:
            errors += validation_errors(obj, version)
    assert not errors, "\n".join(errors)
    rendered = {(o["apiVersion"], o["kind"]) for t in OVERLAYS for o in render(f"overlays/{t}")}
    assert set(NO_KUBERNETES_SCHEMA) <= rendered, "NO_KUBERNETES_SCHEMA names a kind not rendered"


def test_strict_validation_rejects_an_unknown_field_and_an_api_too_new():
    # The check above can fail: a misspelt field, and an API that 1.29 does not serve.
    statefulset = next(o for o in render("overlays/dev") if o["kind"] == "StatefulSet")
    assert validation_errors(statefulset, OLDEST_KUBERNETES) == []
    bad = yaml.safe_load(yaml.safe_dump(statefulset))
    bad["spec"]["template"]["spec"]["containers"][0]["resource"] = {"limits": {"cpu": "1"}}
    assert "'resource' was unexpected" in validation_errors(bad, OLDEST_KUBERNETES)[0]
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1beta1",
        "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": "replayrl-gpu-priority"},
        "spec": {},
    }
    assert "does not serve" in validation_errors(policy, OLDEST_KUBERNETES)[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_config_maps_the_pipelines_read_exist_with_their_keys(overlay):
    config_maps = objects(f"overlays/{overlay}", "ConfigMap")
    for executor, name, keys, _ in pipeline_references()["ConfigMap"]:
        assert name in config_maps, f"{overlay}: ConfigMap {name} (read by {executor}) missing"
        missing = keys - set(config_maps[name]["data"])
        assert not missing, f"{overlay}: ConfigMap {name} lacks keys {missing}"
    endpoints = config_maps["replayrl-endpoints"]["data"]
    assert endpoints["AWS_ENDPOINT_URL"].startswith(("http://", "https://"))
    assert endpoints["MLFLOW_TRACKING_URI"].startswith(("http://", "https://"))


def test_dev_renders_every_secret_the_pipelines_read_with_its_keys():
    secrets = objects("overlays/dev", "Secret")
    for executor, name, keys, _ in pipeline_references()["Secret"]:
        assert name in secrets, f"dev: Secret {name} (read by {executor}) missing"
        missing = keys - set(secret_data(secrets[name]))
        assert not missing, f"dev: Secret {name} lacks keys {missing}"


def test_prod_renders_no_secret_so_apply_never_overwrites_real_ones():
    # The pipelines' Secrets are references there, created out of band; a rendered template
    # would replace real credentials with placeholders on every `kubectl apply -k`.
    assert objects("overlays/prod", "Secret") == {}
    required = {name for _, name, _, optional in pipeline_references()["Secret"] if not optional}
    text = (K8S / "overlays" / "prod" / "kustomization.yaml").read_text()
    for name in required:
        assert f"create secret generic {name}" in text, f"prod does not say how to create {name}"


def test_dev_servers_are_pinned_resourced_and_probed():
    specs = dict(pod_specs("overlays/dev"))
    assert set(specs) == {"replayrl-seaweedfs", "replayrl-postgres", "replayrl-mlflow-server"}
    for name, spec in specs.items():
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name}/{container['name']}"
            image = container["image"]
            assert re.search(r"(:[\w][\w.-]*|@sha256:[0-9a-f]{64})$", image.split("/")[-1]), (
                f"{where}: image {image} is not pinned by tag or digest"
            )
            assert not image.endswith(":latest"), f"{where}: {image} uses :latest"
            resources = container.get("resources", {})
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(bound, {})), (
                    f"{where}: resources.{bound} needs cpu and memory"
                )
        for container in spec["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in container, f"{name}: server container without {probe}"


def test_dev_servers_reference_only_rendered_secrets_and_services():
    rendered = render("overlays/dev")
    secrets = {n: set(secret_data(s)) for n, s in objects("overlays/dev", "Secret").items()}
    services = objects("overlays/dev", "Service")
    for name, spec in pod_specs("overlays/dev"):
        for container in spec["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets.get(ref["name"], set()), (
                        f"{name}: env {env['name']} reads missing {ref['name']}/{ref['key']}"
                    )
    # Every Service selects the pods of a rendered workload.
    for svc_name, svc in services.items():
        selector = svc["spec"]["selector"]
        assert any(
            o["kind"] in WORKLOADS
            and selector.items() <= o["spec"]["template"]["metadata"]["labels"].items()
            for o in rendered
        ), f"Service {svc_name} selects no pod"
    # The endpoints the pipelines get point at the dev Services, on their ports.
    endpoints = objects("overlays/dev", "ConfigMap")["replayrl-endpoints"]["data"]
    for url in (endpoints["AWS_ENDPOINT_URL"], endpoints["MLFLOW_TRACKING_URI"]):
        host, port = re.fullmatch(r"http://([\w-]+):(\d+)", url).groups()
        assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}, url


@pytest.mark.parametrize(
    "target",
    ["base", "cluster", "components/secret-templates", *[f"overlays/{o}" for o in OVERLAYS]],
)
def test_no_real_looking_secrets(target):
    if target.startswith("components/"):
        docs = [d for d in yaml.safe_load_all((K8S / target / "secrets.yaml").read_text()) if d]
    else:
        docs = list(render(target))
    for doc in docs:
        if doc["kind"] == "Secret":
            for key, value in secret_data(doc).items():
                assert PLACEHOLDER.match(value), (
                    f"{target}: Secret {doc['metadata']['name']}/{key} holds {value!r}; commit "
                    f"only empty values or CHANGE-ME placeholders"
                )


def test_no_file_under_k8s_looks_like_a_credential():
    for path in sorted(K8S.rglob("*")):
        if path.is_file():
            text = path.read_text()
            for pattern in CREDENTIAL_LOOKALIKES:
                match = pattern.search(text)
                assert match is None, f"{path.relative_to(ROOT)}: {match.group(0)!r}"


def test_the_placeholder_rule_rejects_a_real_looking_value():
    # The checks above can fail: a key-shaped value is neither empty nor a placeholder.
    assert not PLACEHOLDER.match("AKIAIOSFODNN7EXAMPLE")
    assert any(p.search("AKIAIOSFODNN7EXAMPLE") for p in CREDENTIAL_LOOKALIKES)
    assert PLACEHOLDER.match("CHANGE-ME-secret-access-key") and PLACEHOLDER.match("")
