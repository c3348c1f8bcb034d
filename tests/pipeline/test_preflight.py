"""`replayrl preflight`, and `submit` / `schedule create` running it first, against
STAND-INS: for the Kubernetes API (`k8s_standin`: core/v1 reads, every request and object
checked against the models of the `kubernetes` client) and for the KFP REST API
(`kfp_standin`), with a real S3 server (SeaweedFS, the integration tier's `S3Server`) for the
run root. No cluster and no KFP backend run here; the tests upload the committed pipeline
YAML (`--package`), so nothing is compiled.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from k8s_standin import KubeState, kubeconfig, serve
from real_servers import servers

from replayrl.cli.main import main

# One worker runs them all, so one SeaweedFS serves the module.
pytestmark = [pytest.mark.pipeline, pytest.mark.xdist_group("preflight-s3")]

ROOT = Path(__file__).parents[2]
LOOP = ROOT / "pipelines" / "compiled" / "replay_loop.yaml"
ITERATION = ROOT / "pipelines" / "compiled" / "replay_iteration.yaml"
NS = "team-a"
PROFILE_OWNER = {
    "apiVersion": "kubeflow.org/v1",
    "kind": "Profile",
    "name": NS,
    "uid": "6a0b6a8e-0000-4000-8000-000000000001",
    "controller": True,
    "blockOwnerDeletion": True,
}


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    server = servers().S3Server(tmp_path_factory.mktemp("seaweedfs") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_root(s3_server, monkeypatch) -> str:
    """This machine's AWS settings pointed at the server; a fresh prefix on its bucket."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return f"s3://{s3_server.bucket}/preflight-{uuid.uuid4().hex[:8]}"


@dataclass
class Kube:
    url: str
    state: KubeState
    config: Path


@pytest.fixture
def kube(tmp_path, monkeypatch):
    """The Kubernetes API stand-in and a kubeconfig for it (context namespace: NS)."""
    monkeypatch.delenv("KF_PIPELINES_NAMESPACE", raising=False)
    state = KubeState()
    with serve(state) as url:
        yield Kube(url, state, kubeconfig(url, state.token, tmp_path / "kube.json", namespace=NS))
    assert state.rejected == [], "requests or objects outside the Kubernetes API"


def meta(name: str, **more) -> dict:
    return {"name": name, "namespace": NS, **more}


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def gpu_node(name: str, gpus: str, *, taints=(), unschedulable=False, labels=None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels or {"kubernetes.io/hostname": name}},
        "spec": {"taints": list(taints), "unschedulable": unschedulable},
        "status": {"allocatable": {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": gpus}},
    }


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def profile_namespace(state: KubeState, *, complete: bool) -> None:
    """A Kubeflow profile's namespace, as its Profile and KFP's profile controller leave it
    (`complete=False`: the bare namespace, owner and label only, nothing in it)."""
    state.add(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": NS,
                "labels": {"app.kubernetes.io/part-of": "kubeflow-profile"},
                "ownerReferences": [PROFILE_OWNER],
            },
        }
    )
    if not complete:
        return
    for account in ("default-editor", "default-viewer"):
        state.add(
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": meta(account, ownerReferences=[PROFILE_OWNER]),
            }
        )
    state.add(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta("kfp-launcher"),
            "data": {"defaultPipelineRoot": "minio://mlpipeline/v2/artifacts"},
        }
    )
    state.add(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": meta("replayrl-s3"),
            "data": {"AWS_ACCESS_KEY_ID": b64("id"), "AWS_SECRET_ACCESS_KEY": b64("key")},
        }
    )
    state.add(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": meta("replayrl-mlflow"),
            "data": {"MLFLOW_TRACKING_TOKEN": b64("token")},
        }
    )
    state.add(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta("replayrl-endpoints"),
            "data": {
                "AWS_ENDPOINT_URL": "https://s3.example.com",
                "AWS_REGION": "us-east-1",
                "MLFLOW_TRACKING_URI": "https://mlflow.example.com",
            },
        }
    )
    # Nodes the GPU pods cannot use, then one they can.
    state.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-1"}})
    state.add(gpu_node("gpu-cordoned", "8", taints=[GPU_TAINT], unschedulable=True))
    dedicated = {"key": "dedicated", "value": "inference", "effect": "NoExecute"}
    state.add(gpu_node("gpu-dedicated", "8", taints=[GPU_TAINT, dedicated]))
    state.add(gpu_node("gpu-7", "8", taints=[GPU_TAINT]))


def preflight(kfp, kube: Kube, *args: str) -> int:
    return main(
        ["preflight", "--host", kfp.url, "--kubeconfig", str(kube.config), "--package", *args]
    )


def lines(out: str, mark: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(mark)]


def test_a_complete_profile_namespace_passes_every_check(kfp_multiuser, kube, s3_root, capsys):
    profile_namespace(kube.state, complete=True)
    args = [str(LOOP), "--namespace", NS, "--run-root", s3_root]
    assert preflight(kfp_multiuser, kube, *args) == 0
    out = capsys.readouterr().out
    assert lines(out, "✗") == [] and lines(out, "?") == [], out
    expected = [
        f"✓ Kubeflow Pipelines 2.15.0 at {kfp_multiuser.url} (multi-user)",
        f"✓ namespace {NS} (a Kubeflow Profile's)",
        "✓ service account default-editor (KFP's default account of the namespace)",
        "✓ Secret replayrl-hf is absent; optional: pods start without HF_TOKEN",
        "✓ Secret replayrl-mlflow (optional; unset in pods: MLFLOW_TRACKING_PASSWORD, "
        "MLFLOW_TRACKING_USERNAME)",
        "✓ Secret replayrl-s3 (required)",
        "✓ ConfigMap replayrl-endpoints (optional)",
        "✓ ConfigMap kfp-launcher (default pipeline root minio://mlpipeline/v2/artifacts)",
        "✓ node gpu-7 offers 1 nvidia.com/gpu (8 allocatable)",
        f"✓ run root {s3_root} is writable and its store honours conditional writes",
        "✓ image ghcr.io/replayrl/replayrl:0.1.0 is pinned by tag 0.1.0 (a tag can be "
        "pushed again; a digest cannot)",
    ]
    assert lines(out, "✓") == expected
    assert out.rstrip().endswith("preflight: ready to submit")
    assert all(r.startswith("GET ") for r in kube.state.requests)


def test_an_empty_namespace_gets_one_line_per_missing_piece(kfp_standin, kube, s3_root, capsys):
    # A plain namespace (no Profile) on a standalone KFP: KFP's default account there is
    # pipeline-runner. The namespace comes from the kubeconfig's context; the bucket is absent.
    kube.state.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    kube.state.add(
        gpu_node(
            "gpu-dedicated", "8", taints=[GPU_TAINT, {"key": "dedicated", "effect": "NoSchedule"}]
        )
    )
    missing_bucket = "s3://no-such-bucket-preflight/runs"
    assert preflight(kfp_standin, kube, str(LOOP), "--run-root", missing_bucket) == 1
    out = capsys.readouterr().out
    failed = lines(out, "✗")
    assert [line.split(" (")[0].split(": ")[0] for line in failed] == [
        "✗ service account pipeline-runner",
        "✗ Secret replayrl-s3",
        f"✗ ConfigMap kfp-launcher is not in namespace {NS}",
        "✗ no schedulable node offers 1 nvidia.com/gpu with taints the pods tolerate",
        f"✗ run root {missing_bucket}",
    ], out
    # Each ✗ is followed by exactly one line saying what to create or fix.
    text = out.splitlines()
    fixes = [text[text.index(line) + 1] for line in failed]
    assert all(f.startswith("    → ") for f in fixes)
    assert (
        "kubectl -n team-a create secret generic replayrl-s3 --from-literal=AWS_ACCESS_KEY_ID="
        in fixes[1]
    )
    assert "gpu-dedicated: taint dedicated=:NoSchedule" in failed[3]
    assert "bucket 'no-such-bucket-preflight' does not exist" in failed[4]
    assert fixes[4].startswith("    → Create it")
    assert "✓ Secret replayrl-mlflow is absent; optional" in out
    assert "✓ Kubeflow Pipelines 2.15.0" in out
    assert out.rstrip().endswith("preflight: 5 check(s) failed")


def test_a_named_account_must_exist_and_unreadable_pieces_do_not_fail(
    kfp_multiuser, kube, s3_root, tmp_path, capsys
):
    # A profile owner may read neither the namespace object nor the node list: the Profile is
    # recognised by default-editor's owner, and the GPU check is left open (?), not failed.
    profile_namespace(kube.state, complete=True)
    kube.state.forbidden |= {"read_namespace", "list_node"}
    config = tmp_path / "named.yaml"
    config.write_text("kubernetes:\n  service_account: replayrl-pipeline-runner\n")
    args = [str(LOOP), "--namespace", NS, "--run-root", s3_root, "--config", str(config)]
    assert preflight(kfp_multiuser, kube, *args) == 1
    out = capsys.readouterr().out
    (failed,) = lines(out, "✗")
    assert failed.startswith("✗ service account replayrl-pipeline-runner (kubernetes.service")
    assert "k8s/base" in out and "service_account: null" in out
    assert lines(out, "?") == ["? GPU nodes: nodes may not be listed here (403 Forbidden)"]
    assert f"✓ namespace {NS} (it may not be read here; a Kubeflow Profile's)" in out

    kube.state.add(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta("replayrl-pipeline-runner")}
    )
    assert preflight(kfp_multiuser, kube, *args) == 0
    assert "✓ service account replayrl-pipeline-runner (kubernetes.service_account)" in (
        capsys.readouterr().out
    )


def test_an_old_backend_and_a_floating_image_fail(kfp_standin, kube, s3_root, tmp_path, capsys):
    profile_namespace(kube.state, complete=True)
    kfp_standin.state.tag_name = "2.14.4"
    package = tmp_path / "latest.yaml"
    package.write_text(
        LOOP.read_text().replace("ghcr.io/replayrl/replayrl:0.1.0", "ghcr.io/replayrl/replayrl")
    )
    assert preflight(kfp_standin, kube, str(package), "--run-root", s3_root) == 1
    out = capsys.readouterr().out
    assert lines(out, "✗") == [
        f"✗ Kubeflow Pipelines 2.14.4 at {kfp_standin.url} is older than 2.15.0",
        "✗ image ghcr.io/replayrl/replayrl is not pinned (no tag, or latest)",
    ]
    assert "upgrade Kubeflow Pipelines to 2.15.0 or newer" in out
    assert "--image name@sha256:<digest>" in out


def test_submit_and_schedule_run_the_preflight_first_and_can_skip_it(
    kfp_multiuser, kube, s3_root, capsys
):
    def cli(*args: str) -> int:
        kfp = ["--host", kfp_multiuser.url, "--namespace", NS, "--run-root", s3_root]
        return main([*args, *kfp, "--kubeconfig", str(kube.config)])

    kube.state.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    state = kfp_multiuser.state
    # An empty namespace: the preflight stops both before anything is sent to KFP.
    assert cli("submit", "--package", str(LOOP)) == 2
    assert cli("schedule", "create", "--cron", "0 * * * *", "--package", str(ITERATION)) == 2
    captured = capsys.readouterr()
    assert "✗ Secret replayrl-s3 (required) is not in namespace team-a" in captured.out
    assert captured.err.count("nothing was submitted") == 2 and "--skip-preflight" in captured.err
    assert state.pipelines == {} and state.runs == {} and state.recurring_runs == {}

    # --skip-preflight: no Kubernetes request at all, and the run goes in.
    seen = len(kube.state.requests)
    assert cli("submit", "--package", str(LOOP), "--skip-preflight") == 0
    assert len(kube.state.requests) == seen and len(state.runs) == 1

    # A complete namespace: the preflight passes and the run names no account, so KFP runs
    # it as the namespace's default (default-editor in a profile namespace).
    kube.state.namespaces.clear()
    profile_namespace(kube.state, complete=True)
    assert cli("submit", "--package", str(LOOP), "--run-name", "checked") == 0
    out = capsys.readouterr().out
    assert "✓ service account default-editor" in out and "✗" not in out
    (run,) = [r for r in state.runs.values() if r["display_name"] == "checked"]
    assert "service_account" not in run
    assert "service account the namespace default" in out


def test_unreachable_apis_are_one_failed_check_each(tmp_path, s3_root, capsys, monkeypatch):
    import socket

    monkeypatch.delenv("KF_PIPELINES_NAMESPACE", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    closed = f"http://127.0.0.1:{port}"
    config = kubeconfig(closed, "token", tmp_path / "kube.json", namespace=NS)
    args = ["preflight", "--host", closed, "--kubeconfig", str(config), "--package", str(LOOP)]
    assert main([*args, "--run-root", s3_root]) == 1
    out = capsys.readouterr().out
    failed = lines(out, "✗")
    assert failed[0] == f"✗ Kubeflow Pipelines at {closed}: no version read"
    assert failed[1].startswith(f"✗ Kubernetes API at {closed}: ")
    assert len(failed) == 2, out  # the run root and the image are still checked
    assert "✓ run root" in out and "✓ image" in out


def test_gpu_nodes_must_match_the_pods_count_labels_and_taints(
    kfp_multiuser, kube, s3_root, tmp_path, capsys
):
    import yaml

    # The committed pipeline, its GPU pods asking for 2 GPUs on H100 nodes.
    spec, platform = yaml.safe_load_all(LOOP.read_text())
    pods = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, executor in spec["deploymentSpec"]["executors"].items():
        accelerator = executor["container"].get("resources", {}).get("accelerator")
        if accelerator:
            accelerator["count"] = accelerator["resourceCount"] = "2"
            pods[name]["nodeSelector"] = {"labels": {"nvidia.com/gpu.product": "H100"}}
    package = tmp_path / "h100.yaml"
    package.write_text(yaml.safe_dump_all([spec, platform]))

    profile_namespace(kube.state, complete=True)
    kube.state.nodes.clear()
    h100 = {"nvidia.com/gpu.product": "H100"}
    kube.state.add(gpu_node("a100", "8", labels={"nvidia.com/gpu.product": "A100"}))
    kube.state.add(gpu_node("h100-small", "1", labels=h100))
    args = [str(package), "--namespace", NS, "--run-root", s3_root]
    assert preflight(kfp_multiuser, kube, *args) == 1
    (failed,) = lines(capsys.readouterr().out, "✗")
    assert failed == (
        "✗ no schedulable node offers 2 nvidia.com/gpu with labels {'nvidia.com/gpu.product': "
        "'H100'} with taints the pods tolerate (found a100: labels do not match; h100-small: "
        "only 1)"
    )
    kube.state.add(gpu_node("h100-big", "8", labels=h100, taints=[GPU_TAINT]))
    assert preflight(kfp_multiuser, kube, *args) == 0
    assert "✓ node h100-big offers 2 nvidia.com/gpu with labels" in capsys.readouterr().out


def nodepool(name: str, limits: dict[str, str] | None = None) -> dict:
    """A Karpenter (v1) NodePool, as much of one as the preflight reads."""
    spec: dict = {"template": {"spec": {"requirements": []}}}
    if limits:
        spec["limits"] = limits
    return {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodePool",
        "metadata": {"name": name},
        "spec": spec,
    }


def test_no_gpu_node_is_unknown_where_an_autoscaler_may_add_one(
    kfp_multiuser, kube, s3_root, capsys
):
    """A GPU pool that scales from zero has no node until a pod asks for one: where the
    cluster autoscaler or Karpenter runs, no GPU node is `?` (the preflight passes), not ✗."""
    profile_namespace(kube.state, complete=True)
    kube.state.nodes.clear()
    kube.state.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-1"}})
    args = [str(LOOP), "--namespace", NS, "--run-root", s3_root]
    want = "1 nvidia.com/gpu with taints the pods tolerate"

    # No autoscaler seen; a NodePool whose limits allow no GPU adds none.
    pools = kube.state.custom_objects[("karpenter.sh", "v1", "nodepools")] = [
        nodepool("cpu", {"cpu": "1000", "nvidia.com/gpu": "0"})
    ]
    assert preflight(kfp_multiuser, kube, *args) == 1
    (failed,) = lines(capsys.readouterr().out, "✗")
    assert failed == f"✗ no schedulable node offers {want} (no node has any)"

    pools.append(nodepool("gpu"))
    assert preflight(kfp_multiuser, kube, *args) == 0
    out = capsys.readouterr().out
    assert lines(out, "✗") == []
    assert lines(out, "?") == [
        f"? no node offers {want} yet (no node has any); an autoscaler may add one "
        "(Karpenter NodePools gpu)"
    ]

    # The cluster autoscaler's status ConfigMap, where NodePools may not be listed.
    kube.state.forbidden.add("list_cluster_custom_object")
    kube.state.add(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cluster-autoscaler-status", "namespace": "kube-system"},
            "data": {"status": "time: 2026-01-01 00:00:00\nautoscalerStatus: Running\n"},
        }
    )
    assert preflight(kfp_multiuser, kube, *args) == 0
    assert lines(capsys.readouterr().out, "?") == [
        f"? no node offers {want} yet (no node has any); an autoscaler may add one "
        "(the cluster autoscaler: ConfigMap kube-system/cluster-autoscaler-status)"
    ]
