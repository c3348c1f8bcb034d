"""Compiled pipelines: the committed YAML is fresh, parses strictly back into the KFP
pipeline-spec and Kubernetes platform-spec protos, and carries the pod settings where the
KFP backend reads them (container resources in the deployment spec; tolerations, volumes,
secrets and timeouts in the kubernetes platform spec; retries and caching on the tasks)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from kfp.kubernetes.kubernetes_executor_config_pb2 import KubernetesExecutorConfig
from kfp.pipeline_spec import pipeline_spec_pb2

from replayrl.errors import ReplayRLError
from replayrl.kfp import DEFAULT_IMAGE
from replayrl.kfp.pipelines import (
    ASYNC_FILE,
    COMPARE_FILE,
    ITERATION_FILE,
    LOOP_FILE,
    compile_pipelines,
)
from replayrl.kfp.smoke import SMOKE_FILE

pytestmark = pytest.mark.pipeline
ROOT = Path(__file__).parents[2]
COMMITTED = ROOT / "pipelines" / "compiled"
ACCELERATED = {"evaluate-initial", "generate", "train", "evaluate", "run-iterations"}
CPU_ONLY = {"open-lineage", "compact", "record-iteration", "release-lineage"}
# not open (busy lineage) nor record (the commit point)
RETRIED = {
    "evaluate-initial",
    "generate",
    "compact",
    "train",
    "evaluate",
    "run-iterations",
    "release-lineage",
}
EVERY_PIPELINE = {"open-lineage", "evaluate-initial", "release-lineage"}
COMPONENTS = {
    "task": {*EVERY_PIPELINE, "run-iterations"},
    "step": {*EVERY_PIPELINE, "generate", "train", "evaluate", "compact", "record-iteration"},
}


def layout_config(tmp_path: Path, layout: str, **kubernetes) -> Path:
    """A config file that sets the pipelines' layout (and other pod settings)."""
    path = tmp_path / f"{layout}.yaml"
    path.write_text(yaml.safe_dump({"kubernetes": {"layout": layout, **kubernetes}}))
    return path


def compiled(tmp_path: Path, layout: str) -> Path:
    """The folder with the pipelines of `layout`: the committed ones for the default."""
    if layout == "task":
        return COMMITTED
    out = tmp_path / "out"
    # a few iterations: one pod per step makes a large spec (see the size test below)
    compile_pipelines(out, iterations=2, config_path=layout_config(tmp_path, layout))
    return out


def parse(path: Path):
    """(PipelineSpec, PipelineDeploymentConfig, {executor: KubernetesExecutorConfig}),
    each parsed strictly: an unknown field anywhere fails the test."""
    docs = list(yaml.safe_load_all(path.read_text()))
    assert len(docs) == 2, "expected the pipeline spec and the platform spec"
    spec = json_format.ParseDict(docs[0], pipeline_spec_pb2.PipelineSpec())
    deployment = json_format.ParseDict(
        json_format.MessageToDict(spec.deployment_spec),
        pipeline_spec_pb2.PipelineDeploymentConfig(),
    )
    platform = json_format.ParseDict(docs[1], pipeline_spec_pb2.PlatformSpec())
    executors = platform.platforms["kubernetes"].deployment_spec.executors
    k8s = {
        label: json_format.ParseDict(json_format.MessageToDict(struct), KubernetesExecutorConfig())
        for label, struct in executors.items()
    }
    return spec, deployment, k8s


def tasks(spec: pipeline_spec_pb2.PipelineSpec):
    """Every container task of every DAG: (component name without its -N suffixes, executor
    label, task spec)."""
    out = []
    dags = [spec.root.dag, *(c.dag for c in spec.components.values() if c.HasField("dag"))]
    for dag in dags:
        for task in dag.tasks.values():
            component = spec.components[task.component_ref.name]
            if component.executor_label:
                name = re.sub(r"(-\d+)+$", "", task.component_ref.name.removeprefix("comp-"))
                out.append((name, component.executor_label, task))
    return out


def test_committed_yaml_is_fresh(tmp_path):
    written = compile_pipelines(tmp_path)
    for path in written:
        committed = COMMITTED / path.name
        assert committed.exists(), f"{committed} is missing: run `replayrl compile`"
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `replayrl compile` and commit pipelines/compiled/"
        )
        # Uploaded as it is, it trains the demo: it says so at its top.
        assert committed.read_text().startswith("# TEMPLATE: compiled with the library defaults")


def test_a_pipeline_compiled_with_a_config_is_not_marked_a_template(tmp_path):
    preset = ROOT / "configs" / "tiny-cpu.yaml"
    for path in compile_pipelines(tmp_path, iterations=1, config_path=preset):
        assert path.read_text().startswith("# PIPELINE DEFINITION"), path.name


@pytest.mark.parametrize("layout", ["task", "step"])
@pytest.mark.parametrize("name", [LOOP_FILE, ITERATION_FILE])
def test_compiled_yaml_parses_strictly_with_pod_settings_where_the_backend_reads_them(
    name, layout, tmp_path
):
    spec, deployment, k8s = parse(compiled(tmp_path, layout) / name)
    found = tasks(spec)
    assert {n for n, _, _ in found} == COMPONENTS[layout]
    for component, label, task in found:
        container = deployment.executors[label].container
        config = k8s[label]
        assert container.image == DEFAULT_IMAGE
        assert not task.caching_options.enable_cache, f"{component}: caching must be off"
        assert config.active_deadline_seconds > 0, f"{component}: no pod timeout"
        secrets = {s.secret_name: s for s in config.secret_as_env}
        assert {e.env_var for e in secrets["replayrl-s3"].key_to_env} == {
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
        }
        assert secrets["replayrl-mlflow"].optional
        # Only the task that opens a lineage downloads hub names, so only it gets HF_TOKEN.
        assert ("replayrl-hf" in secrets) == (component == "open-lineage"), component
        if component == "open-lineage":
            assert secrets["replayrl-hf"].optional
            assert [e.env_var for e in secrets["replayrl-hf"].key_to_env] == ["HF_TOKEN"]
        assert [c.config_map_name for c in config.config_map_as_env] == ["replayrl-endpoints"]
        envs = {e.env_var for e in config.config_map_as_env[0].key_to_env}
        assert {"AWS_ENDPOINT_URL", "MLFLOW_TRACKING_URI"} <= envs
        accelerator = container.resources.accelerator
        if component in ACCELERATED:
            assert accelerator.resource_type == "nvidia.com/gpu"
            assert accelerator.resource_count == "1"
            assert [(t.key, t.operator, t.effect) for t in config.tolerations] == [
                ("nvidia.com/gpu", "Exists", "NoSchedule")
            ]
            shm, scratch = config.empty_dir_mounts
            assert (shm.mount_path, shm.medium, shm.size_limit) == ("/dev/shm", "Memory", "16Gi")
            # disk-backed (no medium): the checkpoint downloads and the cache live there
            assert (scratch.mount_path, scratch.medium, scratch.size_limit) == (
                "/scratch",
                "",
                "100Gi",
            )
            assert {e.name: e.value for e in container.env} == {
                "REPLAYRL_REQUIRE_GPU": "1",
                "REPLAYRL_CACHE": "/scratch/replayrl",
                # compiled graphs and kernels on the scratch volume, built once per pod
                "VLLM_CACHE_ROOT": "/scratch/vllm",
                "TORCHINDUCTOR_CACHE_DIR": "/scratch/torchinductor",
                "TRITON_CACHE_DIR": "/scratch/triton",
            }
            assert container.resources.resource_cpu_request == "4"
        else:
            assert not accelerator.resource_type and not config.tolerations
            assert not config.empty_dir_mounts
            assert not container.env  # no GPU check, the cache where the pod's user has it
            assert container.resources.resource_cpu_request == "1"
        if component in RETRIED:
            assert task.retry_policy.max_retry_count == 2, component
            assert task.retry_policy.backoff_duration.seconds == 60
            assert task.retry_policy.backoff_factor == 2.0
        else:
            assert task.retry_policy.max_retry_count == 0, component


def test_loop_unrolls_its_iterations_and_takes_the_run_parameters(tmp_path):
    compile_pipelines(
        tmp_path,
        iterations=2,
        image="registry.example/replayrl:test",
        config_path=layout_config(tmp_path, "step"),
    )
    spec, deployment, _ = parse(tmp_path / LOOP_FILE)
    params = spec.root.input_definitions.parameters
    assert set(params) == {
        "run_root_s3_uri",
        "config",
        "iterations",
        "arm",
        "lineage",
        "model_id",
        "dataset_id",
    }
    # The run form blocks Start until the run root is filled; iterations is a number whose
    # default is the compiled most.
    assert not params["run_root_s3_uri"].is_optional
    assert not params["run_root_s3_uri"].HasField("default_value")
    assert params["iterations"].parameter_type == pipeline_spec_pb2.ParameterType.NUMBER_INTEGER
    assert params["iterations"].default_value.number_value == 2
    body = spec.components["comp-exit-handler-1"].dag  # everything but the exit task
    iterations = [t for t in body.tasks.values() if "iteration +" in t.task_info.name]
    assert sorted(t.task_info.name for t in iterations) == [f"iteration +{i}" for i in (1, 2)]
    generates = [n for n, _, _ in tasks(spec) if n == "generate"]
    assert len(generates) == 2
    images = {e.container.image for e in deployment.executors.values()}
    assert images == {"registry.example/replayrl:test"}


@pytest.mark.parametrize("layout", ["task", "step"])
@pytest.mark.parametrize("name", [LOOP_FILE, ITERATION_FILE, COMPARE_FILE])
def test_every_pipeline_releases_its_leases_in_an_exit_task_and_opens_on_cpu(
    tmp_path, layout, name
):
    spec, deployment, _ = parse(compiled(tmp_path, layout) / name)
    root = spec.root.dag.tasks
    # Two tasks at the root: the exit handler with the whole pipeline in it, and the exit
    # task, which runs once the handler is done whatever its tasks did.
    assert set(root) == {"exit-handler-1", "release-lineage"}
    exit_task = root["release-lineage"]
    assert list(exit_task.dependent_tasks) == ["exit-handler-1"]
    assert (
        exit_task.trigger_policy.strategy == exit_task.trigger_policy.ALL_UPSTREAM_TASKS_COMPLETED
    )
    assert exit_task.inputs.parameters["owner"].runtime_value.constant.string_value == (
        "{{$.pipeline_job_uuid}}"
    )
    # Scalar inputs: each lineage name wired from its pipeline parameter (a parameter inside
    # a list input would reach the task as its placeholder text).
    inputs = exit_task.inputs.parameters

    def wired(key: str) -> str:
        return inputs[key].component_input_parameter

    def constant(key: str):
        return json_format.MessageToDict(inputs[key].runtime_value.constant)

    if name == COMPARE_FILE:  # both lineages, each under its arm
        assert (constant("arm"), constant("second_arm")) == ("replay", "on-policy")
        assert (wired("lineage"), wired("second_lineage")) == (
            "replay_lineage",
            "on_policy_lineage",
        )
        assert constant("pair") is True
    else:
        assert (wired("arm"), wired("lineage")) == ("arm", "lineage")
        assert "pair" not in inputs or constant("pair") is False
    for key in inputs:
        assert "{{$.inputs" not in str(
            constant(key) if inputs[key].HasField("runtime_value") else ""
        ), key
    for component, label, _ in tasks(spec):
        gpus = deployment.executors[label].container.resources.accelerator.resource_count
        assert (gpus == "1") == (component in ACCELERATED), component
    # v0 is evaluated by its own GPU task, only when the open says it is due.
    gates = [
        t
        for n, c in spec.components.items()
        if n.startswith("comp-replayrl-initial-evaluation")
        for t in c.dag.tasks.values()
    ]
    assert len(gates) == (2 if name == COMPARE_FILE else 1)
    for gate in gates:
        assert (
            gate.trigger_policy.condition
            == "inputs.parameter_values['pipelinechannel--due'] == true"
        )
        (evaluation,) = spec.components[gate.component_ref.name].dag.tasks.values()
        assert evaluation.task_info.name == "evaluate v0"


def test_task_layout_runs_iterations_per_task_in_one_pod_with_every_gpu(tmp_path):
    config = layout_config(tmp_path, "task", iterations_per_task=4, train_gpus=2)
    compile_pipelines(tmp_path, iterations=10, config_path=config)
    spec, deployment, _ = parse(tmp_path / LOOP_FILE)
    chunks = [t for t in tasks(spec) if t[0] == "run-iterations"]
    names = sorted(t.task_info.name for _, _, t in chunks)
    assert names == ["iterations +1..+4", "iterations +5..+8", "iterations +9..+10"]
    counts = sorted(
        t.inputs.parameters["count"].runtime_value.constant.number_value for _, _, t in chunks
    )
    assert counts == [2, 4, 4]
    for _, label, task in chunks:
        accelerator = deployment.executors[label].container.resources.accelerator
        assert accelerator.resource_count == "2"  # the most any of its steps asks for
        assert task.retry_policy.max_retry_count == 2
    # the recurring pipeline runs one task's worth
    spec, _, _ = parse(tmp_path / ITERATION_FILE)
    (chunk,) = [t for n, _, t in tasks(spec) if n == "run-iterations"]
    assert chunk.inputs.parameters["count"].runtime_value.constant.number_value == 4


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["task", "step"])
def test_compile_refuses_a_spec_too_large_for_a_kfp_backend(tmp_path, layout):
    config = layout_config(tmp_path, layout, iterations_per_task=1)
    # Just past what replay_loop (compiled first) holds: ~6 KB per one-iteration task, ~42 KB
    # per iteration in the step layout, against the 256 KiB cap (docs/kubeflow.md).
    iterations = {"task": 50, "step": 8}[layout]
    with pytest.raises(ReplayRLError) as e:
        compile_pipelines(tmp_path / "out", iterations=iterations, config_path=config)
    assert "KiB" in str(e.value)
    if layout == "task":
        assert "kubernetes.iterations_per_task" in str(e.value)
    else:
        assert "kubernetes.layout: task" in str(e.value)
    assert "replay_loop" in str(e.value)
    assert not (tmp_path / "out" / COMPARE_FILE).exists()
    # the same iterations fit in tasks of 10
    compile_pipelines(
        tmp_path / "ok", iterations=iterations, config_path=layout_config(tmp_path, "task")
    )


def test_config_kubernetes_section_sets_the_pods(tmp_path):
    config = tmp_path / "gpu.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "iterations": 50,
                "kubernetes": {
                    "layout": "step",
                    "accelerator_type": "amd.com/gpu",
                    "train_gpus": 4,
                    "evaluate_gpus": 0,
                    "gpu_tolerations": [{"key": "dedicated", "operator": "Equal", "value": "rl"}],
                    "gpu_node_selector": {"gpu.product": "H100"},
                    "shm_size": "",
                    "scratch_size": "",
                    "mlflow_secret": None,
                    "retries": 0,
                },
            }
        )
    )
    compile_pipelines(tmp_path, iterations=1, config_path=config)
    spec, deployment, k8s = parse(tmp_path / ITERATION_FILE)
    default = spec.root.input_definitions.parameters["config"].default_value.string_value
    assert "\n" not in default and yaml.safe_load(default)["iterations"] == 50
    by_name = {n: (label, task) for n, label, task in tasks(spec)}
    train_label, train_task = by_name["train"]
    accelerator = deployment.executors[train_label].container.resources.accelerator
    assert (accelerator.resource_type, accelerator.resource_count) == ("amd.com/gpu", "4")
    config_train = k8s[train_label]
    assert [(t.key, t.operator, t.value) for t in config_train.tolerations] == [
        ("dedicated", "Equal", "rl")
    ]
    assert dict(config_train.node_selector.labels) == {"gpu.product": "H100"}
    assert not config_train.empty_dir_mounts  # shm_size and scratch_size ""
    train_env = {e.name: e.value for e in deployment.executors[train_label].container.env}
    assert train_env == {"REPLAYRL_REQUIRE_GPU": "4"}  # the cache stays in the container
    assert [s.secret_name for s in config_train.secret_as_env] == ["replayrl-s3"]
    assert train_task.retry_policy.max_retry_count == 0
    eval_label, _ = by_name["evaluate"]
    assert not deployment.executors[eval_label].container.resources.accelerator.resource_type
    assert not k8s[eval_label].tolerations


def test_pipeline_root_is_compiled_into_every_pipeline(tmp_path):
    # Unset (the committed YAML), runs use the KFP install's default pipeline root.
    for path in COMMITTED.glob("*.yaml"):
        assert not parse(path)[0].default_pipeline_root, path.name
    root = "s3://rl-artifacts/kfp?region=eu-west-1"
    compile_pipelines(
        tmp_path, iterations=1, config_path=layout_config(tmp_path, "task", pipeline_root=root)
    )
    for name in (LOOP_FILE, ITERATION_FILE, COMPARE_FILE, ASYNC_FILE, SMOKE_FILE):
        assert parse(tmp_path / name)[0].default_pipeline_root == root, name


@pytest.mark.parametrize(
    "section,message",
    [
        ({"train_gpus": -1}, "kubernetes.train_gpus must be >= 0"),
        ({"pipeline_root": "/mnt/artifacts"}, "kubernetes.pipeline_root must be a bucket URI"),
        ({"pipeline_root": "s3://"}, "kubernetes.pipeline_root must be a bucket URI"),
        ({"gpu_tolerations": [{"key": "a", "operator": "Maybe"}]}, "operator must be Equal"),
        ({"gpu_tolerations": [{"kee": "a"}]}, "unknown field(s) ['kee']"),
        ({"gpu_tolerations": "nvidia.com/gpu"}, "must be a list of mappings"),
        ({"scratch_size": "100 GB"}, "kubernetes.scratch_size must be a Kubernetes quantity"),
    ],
)
def test_bad_kubernetes_section_fails_before_writing(tmp_path, section, message):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"kubernetes": section}))
    with pytest.raises(ReplayRLError) as e:
        compile_pipelines(tmp_path / "out", config_path=config)
    assert message in str(e.value)
    assert not (tmp_path / "out" / LOOP_FILE).exists()


def test_compile_cli(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "replayrl.cli.main",
            "compile",
            "--out",
            str(tmp_path),
            "--iterations",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ASYNC_FILE,
        COMPARE_FILE,
        ITERATION_FILE,
        LOOP_FILE,
        SMOKE_FILE,
    ]
    spec, _, _ = parse(tmp_path / LOOP_FILE)
    # the default layout: both iterations in one task
    assert len([n for n, _, _ in tasks(spec) if n == "run-iterations"]) == 1


PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_compiles(tmp_path, preset):
    """What `replayrl compile --config PRESET` (and so `submit` and `preflight`) does with
    each preset a user may pick: the 7B presets used to stop on a pod limit below its
    request."""
    written = compile_pipelines(tmp_path, iterations=2, image=DEFAULT_IMAGE, config_path=preset)
    assert sorted(Path(w).name for w in written) == sorted(
        [ASYNC_FILE, COMPARE_FILE, ITERATION_FILE, LOOP_FILE, SMOKE_FILE]
    )
    for path in written:
        parse(Path(path))  # each spec parses as the backend parses it


DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    "image",
    [
        f"registry.example.com:5000/team/replayrl@{DIGEST}",
        f"ghcr.io/replayrl/replayrl:0.1.0@{DIGEST}",
    ],
)
def test_an_image_digest_reaches_every_executor_unchanged(tmp_path, image):
    written = compile_pipelines(tmp_path, iterations=2, image=image)
    assert len(written) == 5
    for path in written:
        _, deployment, _ = parse(path)
        assert {e.container.image for e in deployment.executors.values()} == {image}, path.name


@pytest.mark.parametrize(
    "image,message",
    [
        ("registry.example.com/replayrl@sha256:abc", "64 lowercase hex digits"),
        (f"registry.example.com/replayrl@{DIGEST.upper()}", "64 lowercase hex digits"),
        ("registry.example.com/RePlayRL:0.1.0", "not an image reference"),
    ],
)
def test_a_malformed_image_is_refused_before_writing(tmp_path, image, message):
    with pytest.raises(ReplayRLError, match=message):
        compile_pipelines(tmp_path / "out", image=image)
    assert not (tmp_path / "out" / LOOP_FILE).exists()


def test_compile_cli_needs_an_image_for_a_real_model(tmp_path):
    def compile_(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "replayrl.cli.main", "compile", "--out", str(tmp_path), *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )

    gpu = str(ROOT / "configs" / "qwen2.5-0.5b-gsm8k.yaml")
    refused = compile_("--config", gpu)
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    assert "give the image your cluster pulls, by digest (--image" in line
    assert not list(tmp_path.iterdir())
    image = "registry.example.com/replayrl@sha256:" + "ab" * 32
    assert compile_("--config", gpu, "--image", image).returncode == 0
    # The tiny demo still compiles with the default image.
    demo = compile_("--config", str(ROOT / "configs" / "tiny-cpu.yaml"))
    assert demo.returncode == 0, demo.stderr


def test_compile_cli_refuses_a_malformed_digest_in_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "replayrl.cli.main",
            "compile",
            "--out",
            str(tmp_path),
            "--image",
            "registry.example.com/replayrl@sha256:123",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "replayrl: error: Image 'registry.example.com/replayrl@sha256:123': the digest after '@' "
        "must be 'sha256:' and 64 lowercase hex digits, as `docker inspect --format "
        "'{{index .RepoDigests 0}}' IMAGE` prints it."
    ]
    assert not list(tmp_path.iterdir())


def test_kfp_local_runs_the_pipeline_without_the_pods_gpu_check_or_scratch_path(tmp_path):
    """kfp.local hands a task's container environment to its subprocess: a GPU request's
    REPLAYRL_REQUIRE_GPU would stop every accelerator step on a machine without CUDA."""
    from kfp import compiler

    from replayrl.config import KubernetesConfig
    from replayrl.kfp.local import local_pods
    from replayrl.kfp.pipelines import replay_loop_pipeline

    for layout in ("task", "step"):
        k8s = local_pods(KubernetesConfig(layout=layout, train_gpus=2))
        compiler.Compiler().compile(
            replay_loop_pipeline(iterations=1, k8s=k8s), str(tmp_path / f"{layout}.yaml")
        )
        _, deployment, k8s_configs = parse(tmp_path / f"{layout}.yaml")
        for label, executor in deployment.executors.items():
            assert not executor.container.env, label
            assert not executor.container.resources.accelerator.resource_type, label
            assert not k8s_configs.get(label, KubernetesExecutorConfig()).empty_dir_mounts


def test_kfp_still_names_the_setter_called_on_a_pipeline_used_as_a_component():
    """replayrl.kfp.pods gives kfp's pipeline_task an `inspect.stack()` that reads no source
    (the real one made every pod setting cost ~0.1 s in a process that imported torch); kfp's
    one use of it, naming the setter in this error, must still work."""
    from kfp import dsl
    from kfp.dsl import pipeline_task

    from replayrl.kfp import pods

    assert isinstance(pipeline_task.inspect, pods._FramesOnly)

    # no annotations: this module's `from __future__ import annotations` makes them strings
    @dsl.component(base_image="python:3.11")
    def step():
        pass

    @dsl.pipeline
    def inner():
        step()

    def outer():
        inner().set_cpu_limit("1")

    # kfp builds the pipeline's graph (and calls the setter) as it decorates it
    with pytest.raises(ValueError, match=r"^set_cpu_limit can only be used on single-step"):
        dsl.pipeline(outer)


def test_a_run_may_ask_for_fewer_iterations_than_were_unrolled(tmp_path):
    """`iterations` is a run parameter: each task past the first sits in a condition on it,
    nested in the one before, and every task is bounded by the run's last iteration."""
    config = layout_config(tmp_path, "task", iterations_per_task=4)
    compile_pipelines(tmp_path, iterations=10, config_path=config)
    spec, _, _ = parse(tmp_path / LOOP_FILE)
    guards = {}
    for component in spec.components.values():
        for task in component.dag.tasks.values():
            if task.trigger_policy.condition and "iterations" in task.trigger_policy.condition:
                guards[task.task_info.name] = task.trigger_policy.condition
    assert sorted(guards.values()) == [
        "int(inputs.parameter_values['pipelinechannel--iterations']) > 4",
        "int(inputs.parameter_values['pipelinechannel--iterations']) > 8",
    ]
    for _, _, task in (t for t in tasks(spec) if t[0] == "run-iterations"):
        until = task.inputs.parameters["until"]  # the open task's output, in or out of a guard
        assert "last_iteration" in (
            until.task_output_parameter.output_parameter_key or until.component_input_parameter
        )


def test_opening_and_the_exit_task_fail_fast_with_the_quick_deadline(tmp_path):
    """A pod that cannot pull its image or lacks a Secret fails the run within
    `kubernetes.quick_step_timeout_s`: the first task (opening) and the exit task are CPU
    pods with the same image and Secrets as the GPU pods, and that deadline."""
    config = layout_config(tmp_path, "task", quick_step_timeout_s=600)
    compile_pipelines(tmp_path, iterations=2, config_path=config)
    for name in (LOOP_FILE, ITERATION_FILE, COMPARE_FILE, ASYNC_FILE):
        spec, _, k8s = parse(tmp_path / name)
        quick = {"open-lineage", "begin-async-segment", "release-lineage"}
        seen = set()
        for component, label, _ in tasks(spec):
            deadline = k8s[label].active_deadline_seconds
            if component in quick:
                seen.add(component)
                assert deadline == 600, (name, component)
            else:
                assert deadline > 600, (name, component)
        assert "release-lineage" in seen and seen & {"open-lineage", "begin-async-segment"}
