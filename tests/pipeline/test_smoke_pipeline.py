"""The cluster self-test pipeline, `replayrl_smoke`: it compiles (the library defaults, and a
GPU preset with an image), and its two tasks run under kfp.local against a real S3 server
(SeaweedFS) and a real MLflow server, the integration tier's (`real_servers`): the CPU task's
checks pass; the GPU task, on this machine without CUDA, reports "no GPU" as a finding and
succeeds. A run root in a bucket that does not exist is one ✗ line, and fails the task.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kfp import compiler
from kfp.dsl import Markdown, Metrics
from mlflow.tracking import MlflowClient
from real_servers import servers

from replayrl.config import load_config
from replayrl.kfp.pipelines import one_line_config
from replayrl.kfp.smoke import check_namespace, smoke_pipeline

pytestmark = [pytest.mark.pipeline, pytest.mark.xdist_group("smoke-servers")]

ROOT = Path(__file__).parents[2]
GPU_PRESET = ROOT / "configs" / "qwen2.5-0.5b-gsm8k.yaml"
IMAGE = "registry.example.com/replayrl:1.2.3"
# The integration tier's fixtures, by name (they need each other: s3_root -> s3_env -> s3_server).
s3_server = servers().s3_server
s3_env = servers().s3_env
s3_root = servers().s3_root
mlflow_server = servers().mlflow_server


def compiled(path: Path) -> tuple[dict, dict]:
    spec, platform = yaml.safe_load_all(path.read_text())
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def test_the_smoke_pipeline_compiles_with_the_defaults_and_a_gpu_preset(tmp_path):
    compiler.Compiler().compile(smoke_pipeline(), str(tmp_path / "default.yaml"))
    spec, _ = compiled(tmp_path / "default.yaml")
    assert spec["pipelineInfo"]["name"] == "replayrl-smoke"

    cfg = load_config(GPU_PRESET)
    built = smoke_pipeline(
        image=IMAGE, k8s=cfg.kubernetes, default_config=one_line_config(GPU_PRESET)
    )
    compiler.Compiler().compile(built, str(tmp_path / "gpu.yaml"))
    spec, pods = compiled(tmp_path / "gpu.yaml")
    inputs = spec["root"]["inputDefinitions"]["parameters"]
    assert "defaultValue" not in inputs["run_root_s3_uri"]  # the form asks for it
    assert json.loads(inputs["config"]["defaultValue"]) == json.loads(one_line_config(GPU_PRESET))
    containers = {k: v["container"] for k, v in spec["deploymentSpec"]["executors"].items()}
    assert {c["image"] for c in containers.values()} == {IMAGE}
    gpus = max(
        cfg.kubernetes.generate_gpus, cfg.kubernetes.train_gpus, cfg.kubernetes.evaluate_gpus
    )
    accelerator = containers["exec-check-gpus"]["resources"]["accelerator"]
    assert int(accelerator["resourceCount"]) == gpus
    assert "accelerator" not in containers["exec-check-namespace"].get("resources", {})
    # The CPU task takes the Secrets and ConfigMap the task that opens a lineage takes.
    secrets = {s["secretName"] for s in pods["exec-check-namespace"]["secretAsEnv"]}
    assert secrets == {
        cfg.kubernetes.s3_secret,
        cfg.kubernetes.mlflow_secret,
        cfg.kubernetes.hf_secret,
    }
    assert pods["exec-check-namespace"]["configMapAsEnv"][0]["configMapName"] == (
        cfg.kubernetes.endpoints_config_map
    )
    # No retries: a failed check is the answer.
    assert not any("retryPolicy" in t for t in spec["root"]["dag"]["tasks"].values())


def test_its_tasks_run_under_kfp_local(tmp_path, s3_root, mlflow_server, monkeypatch, capfd):
    from kfp import local

    monkeypatch.delenv("HF_TOKEN", raising=False)
    config = json.dumps({"tracking": {"uri": mlflow_server.uri, "experiment": "smoke-test"}})
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "kfp-local"),
        raise_on_error=True,
    )
    # The default pod settings: the GPU task asks for a GPU (REPLAYRL_REQUIRE_GPU=1 reaches its
    # subprocess) on a machine without CUDA, and still runs every check.
    smoke_pipeline()(run_root_s3_uri=s3_root, config=config)

    out = capfd.readouterr().out
    # kfp.local streams each task's log, indented
    namespace = [
        line.strip() for line in out.splitlines() if line.strip()[:2] in ("✓ ", "✗ ", "? ")
    ]
    assert not [line for line in namespace if line.startswith("✗")], out[-3000:]
    assert f"✓ run root {s3_root} is writable and its store honours conditional writes" in namespace
    assert any(
        line.startswith(f"✓ MLflow {mlflow_server.uri}: experiment 'smoke-test' (id ")
        for line in namespace
    )
    assert "? hub token: HF_TOKEN not set: public Hugging Face repositories only" in namespace
    assert any(line.startswith("? no GPU: torch ") for line in namespace), out[-3000:]
    assert MlflowClient(mlflow_server.uri).get_experiment_by_name("smoke-test") is not None
    tasks = {p.parent.name: p.parent for p in (tmp_path / "kfp-local").rglob("report")}
    reports = {name: (task / "report").read_text() for name, task in tasks.items()}
    output = json.loads((tasks["check-namespace"] / "executor_output.json").read_text())
    (metrics,) = output["artifacts"]["metrics"]["artifacts"]
    assert metrics["metadata"] == {
        "config": 1.0,
        "environment": 1.0,
        "bucket": 1.0,
        "mlflow": 1.0,
        "failed": 0.0,
    }
    (cpu,) = [text for name, text in reports.items() if "namespace" in name]
    (gpu,) = [text for name, text in reports.items() if "gpus" in name]
    assert f"- ✓ run root {s3_root} is writable" in cpu
    assert "- ? no GPU: torch " in gpu and "- ? NVIDIA driver: none found" in gpu


def test_a_bucket_that_does_not_exist_is_one_failed_line(
    tmp_path, s3_env, mlflow_server, monkeypatch, capsys
):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")  # set: checked only where the hub is on
    config = json.dumps({"tracking": {"uri": mlflow_server.uri, "experiment": "smoke-test"}})
    report = Markdown(name="report", uri=str(tmp_path / "report.md"))
    metrics = Metrics(name="metrics", uri=str(tmp_path / "metrics"))
    with pytest.raises(SystemExit) as e:
        check_namespace.python_func(
            config=config,
            run_root="s3://no-such-bucket/runs",
            sources=json.dumps(
                {"Secret replayrl-s3": ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]}
            ),
            report=report,
            metrics=metrics,
        )
    assert str(e.value) == (
        "replayrl: error: self-test: 1 of 5 checks failed (bucket); the ✗ lines above say what "
        "was found and how to fix it."
    )
    out = capsys.readouterr().out
    (failed,) = [line for line in out.splitlines() if line.startswith("✗")]
    assert failed.startswith("✗ run root s3://no-such-bucket/runs: "), out
    assert "? hub token: HF_TOKEN is set; not checked: HF_HUB_OFFLINE is on" in out
    assert "hf_not_a_real_token" not in out
    assert metrics.metadata == {
        "config": 1.0,
        "environment": 1.0,
        "bucket": 0.0,
        "mlflow": 1.0,
        "failed": 1.0,
    }
    assert failed[2:] in Path(report.path).read_text()
