"""The kustomize manifests under k8s/, rendered with `kubectl kustomize` (offline) and checked
as objects: images pinned, resources and probes set, names and keys consistent with what the
compiled pipelines read, and no real-looking secrets anywhere.

Nothing is applied to a cluster; a rendering failure or a wrong object fails here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
COMPILED = sorted((ROOT / "pipelines" / "compiled").glob("*.yaml"))
OVERLAYS = ("dev", "prod")
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
    assert {name for _, name, _, _ in refs["Secret"]} == {"replayrl-s3", "replayrl-mlflow"}
    assert {name for _, name, _, _ in refs["ConfigMap"]} == {"replayrl-endpoints"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_the_namespace_basics(overlay):
    target = f"overlays/{overlay}"
    namespaces = {o["metadata"].get("namespace") for o in render(target)} - {None}
    assert len(namespaces) == 1, f"{overlay}: objects spread over namespaces {namespaces}"
    (namespace,) = namespaces
    assert "replayrl-pipeline-runner" in objects(target, "ServiceAccount")
    binding = objects(target, "RoleBinding")["replayrl-pipeline-runner"]
    assert binding["roleRef"]["name"] in objects(target, "Role")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "replayrl-pipeline-runner", "namespace": namespace}
    ]
    priority = objects(target, "PriorityClass")["replayrl-gpu"]
    assert priority["value"] > 0 and not priority.get("globalDefault", False)


def test_dev_never_creates_or_deletes_kfps_namespace():
    # Standalone KFP runs pipeline pods in its own namespace, which its install owns.
    assert objects("overlays/dev", "Namespace") == {}
    assert {o["metadata"].get("namespace") for o in render("overlays/dev")} <= {"kubeflow", None}
    assert set(objects("overlays/prod", "Namespace")) == {"replayrl"}


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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kfp_launcher_sets_an_s3_pipeline_root_with_existing_credentials(overlay):
    launcher = objects(f"overlays/{overlay}", "ConfigMap")["kfp-launcher"]["data"]
    assert re.fullmatch(r"s3://[a-z0-9.-]+/\S+", launcher["defaultPipelineRoot"])
    providers = yaml.safe_load(launcher["providers"])
    ref = providers["s3"]["default"]["credentials"]["secretRef"]
    s3_keys = next(k for _, n, k, _ in pipeline_references()["Secret"] if n == ref["secretName"])
    assert {ref["accessKeyKey"], ref["secretKeyKey"]} <= s3_keys


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
    "target", ["base", "components/secret-templates", *[f"overlays/{o}" for o in OVERLAYS]]
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
