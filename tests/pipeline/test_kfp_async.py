"""`async_segment`: one segment of an asynchronous lineage as a Kubeflow pipeline. The compiled
YAML parses strictly and runs W workers, the trainer and the evaluator as parallel
accelerator tasks after one CPU task that begins the segment, inside the exit handler that
releases the lease; the runtime refuses a synchronous config, a config with another W, and a
lineage another run holds; kfp.local (which runs tasks one after another) refuses the
pipeline and asynchronous configs. No model is trained here."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from kfp import compiler
from test_kfp_compile import COMMITTED, parse, tasks

from replayrl import storage
from replayrl.config import KubernetesConfig, load_config
from replayrl.engine.asynchronous import board
from replayrl.errors import ReplayRLError
from replayrl.kfp import DEFAULT_IMAGE, async_runtime
from replayrl.kfp.async_pipeline import async_segment_pipeline
from replayrl.kfp.local import local_pods, run_kfp_local
from replayrl.kfp.pipelines import ASYNC_FILE, compile_pipelines
from replayrl.storage import lease

pytestmark = pytest.mark.pipeline
ROOT = Path(__file__).parents[2]
BEGIN = "begin-async-segment"
ROLES = {"async-worker", "async-trainer", "async-evaluator"}


def async_compile_config(tmp_path: Path, **asynchronous) -> Path:
    path = tmp_path / "async.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "asynchronous": {"enabled": True, "workers": 2, **asynchronous},
                "kubernetes": {"generate_gpus": 1, "train_gpus": 2, "evaluate_gpus": 1},
            }
        )
    )
    return path


def tiny_async(tmp_path: Path, *extra: str, enabled: bool = True) -> str:
    """A tiny config's YAML text (no warm start: nothing is trained), run root under tmp."""
    cfg = load_config(
        ROOT / "configs" / "tiny-cpu.yaml",
        overrides=[
            f"storage.run_root={tmp_path / 'runs'}",
            f"model.cache_dir={tmp_path / 'cache'}",
            "model.warm_start_max_steps=0",
            "task.num_train=64",
            "task.num_eval=8",
            "eval.num_prompts=8",
            "iterations=2",
            f"asynchronous.enabled={'true' if enabled else 'false'}",
            *extra,
        ],
    )
    return cfg.to_yaml()


# ---------------------------------------------------------------- the compiled pipeline


@pytest.fixture(scope="module")
def compiled_w2(tmp_path_factory) -> Path:
    """async_segment.yaml as `replayrl compile --config` writes it for W=2."""
    tmp_path = tmp_path_factory.mktemp("w2")
    compile_pipelines(tmp_path / "out", iterations=1, config_path=async_compile_config(tmp_path))
    return tmp_path / "out" / ASYNC_FILE


def test_async_segment_runs_w_workers_a_trainer_and_an_evaluator_in_parallel(compiled_w2):
    spec, deployment, k8s = parse(compiled_w2)
    assert set(spec.root.input_definitions.parameters) == {
        "config",
        "arm",
        "lineage",
        "run_root_s3_uri",
        "model_id",
        "dataset_id",
    }
    default = spec.root.input_definitions.parameters["config"].default_value.string_value
    assert "\n" not in default
    assert yaml.safe_load(default)["asynchronous"] == {"enabled": True, "workers": 2}

    found = tasks(spec)
    names = sorted(n for n, _, _ in found)
    assert names == sorted(
        [
            "async-worker",
            "async-worker",
            "async-trainer",
            "async-evaluator",
            BEGIN,
            "release-lineage",
        ]
    )
    gpus = {
        t.task_info.name: deployment.executors[label].container.resources.accelerator
        for _, label, t in found
    }
    # each role with the accelerators the config gives its kind of step (trainer: T=1 x 2)
    assert {name: (a.resource_type, a.resource_count) for name, a in gpus.items()} == {
        "worker 0": ("nvidia.com/gpu", "1"),
        "worker 1": ("nvidia.com/gpu", "1"),
        "trainer": ("nvidia.com/gpu", "2"),
        "evaluator": ("nvidia.com/gpu", "1"),
        "begin segment": ("", ""),
        "release lineage": ("", ""),
    }
    for name, label, task in found:
        container = deployment.executors[label].container
        config = k8s[label]
        assert container.image == DEFAULT_IMAGE
        assert not task.caching_options.enable_cache, name
        assert config.active_deadline_seconds > 0, name
        secrets = {s.secret_name for s in config.secret_as_env}
        # only the task that opens the lineage downloads hub names
        assert ("replayrl-hf" in secrets) == (name == BEGIN), name
        env = {e.name: e.value for e in container.env}
        if name in ROLES:
            count = container.resources.accelerator.resource_count
            assert env["REPLAYRL_REQUIRE_GPU"] == count, name  # the pod's GPU check
            assert [(t.key, t.operator) for t in config.tolerations] == [
                ("nvidia.com/gpu", "Exists")
            ]
            assert task.retry_policy.max_retry_count == 2, name  # a retried role resumes
        else:
            assert not env and not config.tolerations, name
            # beginning is not retried (another run holding the lineage); the exit task is
            assert task.retry_policy.max_retry_count == (2 if name == "release-lineage" else 0)

    # Every role depends on the begin task only: the roles run side by side.
    body = spec.components["comp-exit-handler-1"].dag.tasks
    assert not body[BEGIN].dependent_tasks
    roles = {k: t for k, t in body.items() if k != BEGIN}
    assert len(roles) == 4
    for key, task in roles.items():
        assert list(task.dependent_tasks) == [BEGIN], key
        for param in ("config", "owner", "segment_id"):
            source = task.inputs.parameters[param].task_output_parameter
            assert (source.producer_task, source.output_parameter_key) == (BEGIN, param), key
    workers = sorted(
        t.inputs.parameters["worker"].runtime_value.constant.number_value
        for t in roles.values()
        if t.component_ref.name.startswith("comp-async-worker")
    )
    assert workers == [0, 1]
    begin = body[BEGIN].inputs.parameters
    assert begin["workers"].runtime_value.constant.number_value == 2
    assert begin["owner"].runtime_value.constant.string_value == "{{$.pipeline_job_uuid}}"


def test_async_segment_is_inside_the_exit_handler_that_releases_the_lease(compiled_w2):
    for path in (compiled_w2, COMMITTED / ASYNC_FILE):
        spec, _, _ = parse(path)
        root = spec.root.dag.tasks
        assert set(root) == {"exit-handler-1", "release-lineage"}, path
        exit_task = root["release-lineage"]
        assert list(exit_task.dependent_tasks) == ["exit-handler-1"]
        assert (
            exit_task.trigger_policy.strategy
            == exit_task.trigger_policy.ALL_UPSTREAM_TASKS_COMPLETED
        )
        assert exit_task.inputs.parameters["owner"].runtime_value.constant.string_value == (
            "{{$.pipeline_job_uuid}}"
        )
        assert set(spec.components["comp-exit-handler-1"].dag.tasks) >= {BEGIN}


def test_the_committed_async_segment_has_one_worker_and_an_asynchronous_default():
    spec, deployment, _ = parse(COMMITTED / ASYNC_FILE)
    found = tasks(spec)
    assert sorted(n for n, _, _ in found if n in ROLES) == [
        "async-evaluator",
        "async-trainer",
        "async-worker",
    ]
    default = spec.root.input_definitions.parameters["config"].default_value.string_value
    # the library defaults (the tiny CPU demo), asynchronous: what the begin task accepts
    cfg = load_config(text=default)
    assert cfg.asynchronous.enabled and cfg.asynchronous.workers == 1
    for _, label, _ in found:
        assert deployment.executors[label].container.image == DEFAULT_IMAGE


def test_the_trainer_task_gets_train_gpus_per_trainer(tmp_path):
    built = async_segment_pipeline(
        workers=3, trainers=2, k8s=KubernetesConfig(generate_gpus=2, train_gpus=4)
    )
    compiler.Compiler().compile(built, str(tmp_path / ASYNC_FILE))
    spec, deployment, _ = parse(tmp_path / ASYNC_FILE)
    counts = sorted(
        (n, deployment.executors[label].container.resources.accelerator.resource_count)
        for n, label, _ in tasks(spec)
        if n in ROLES
    )
    assert counts == [
        ("async-evaluator", "1"),
        ("async-trainer", "8"),
        ("async-worker", "2"),
        ("async-worker", "2"),
        ("async-worker", "2"),
    ]


def test_a_synchronous_compile_config_still_compiles_async_segment_enabled(tmp_path):
    """One compile writes every pipeline from one config: a synchronous config's
    async_segment gets that config, asynchronous, as its default (as --engine async does)."""
    config = tmp_path / "sync.yaml"
    config.write_text(yaml.safe_dump({"iterations": 7, "asynchronous": {"workers": 3}}))
    compile_pipelines(tmp_path / "out", iterations=1, config_path=config)
    spec, _, _ = parse(tmp_path / "out" / ASYNC_FILE)
    default = spec.root.input_definitions.parameters["config"].default_value.string_value
    assert yaml.safe_load(default) == {
        "iterations": 7,
        "asynchronous": {"workers": 3, "enabled": True},
    }
    assert len([n for n, _, _ in tasks(spec) if n == "async-worker"]) == 3


def test_async_segment_needs_a_worker():
    with pytest.raises(ReplayRLError, match="asynchronous.workers >= 1"):
        async_segment_pipeline(workers=0)


# ---------------------------------------------------------------- the runtime


def test_begin_refuses_a_synchronous_config_before_writing(tmp_path):
    with pytest.raises(ReplayRLError) as e:
        async_runtime.begin_async_segment(
            config=tiny_async(tmp_path, enabled=False), owner="run-1", workers=1
        )
    assert "asynchronous.enabled: true" in str(e.value)
    assert "replay_loop or replay_iteration" in str(e.value)
    assert not (tmp_path / "runs").exists(), "nothing written, not even the lease"


def test_a_role_refuses_a_synchronous_config(tmp_path):
    with pytest.raises(ReplayRLError, match="asynchronous.enabled: true"):
        async_runtime.async_role(
            config=tiny_async(tmp_path, enabled=False), owner="run-1", role="worker", segment_id="x"
        )
    with pytest.raises(ReplayRLError, match="Unknown asynchronous role 'critic'"):
        async_runtime.async_role(
            config=tiny_async(tmp_path), owner="run-1", role="critic", segment_id="x"
        )
    assert not (tmp_path / "runs").exists()


def test_begin_refuses_a_config_with_another_number_of_workers(tmp_path):
    with pytest.raises(ReplayRLError) as e:
        async_runtime.begin_async_segment(
            config=tiny_async(tmp_path, "asynchronous.workers=3"), owner="run-1", workers=2
        )
    assert "compiled with 2 worker task(s)" in str(e.value)
    assert "asynchronous.workers: 3" in str(e.value)
    assert not (tmp_path / "runs").exists()


def test_begin_opens_the_lineage_and_writes_the_runs_segment_under_its_lease(tmp_path):
    config = tiny_async(tmp_path, "asynchronous.segment_steps=4")
    cfg, segment_id = async_runtime.begin_async_segment(config=config, owner="kfp-run-a", workers=1)
    assert segment_id == async_runtime.segment_id_for("kfp-run-a")
    assert len(segment_id) == 12 and segment_id != async_runtime.segment_id_for("kfp-run-b")
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    segment = board.read_segment(paths)
    assert (segment.id, segment.first_step, segment.end_step, segment.done) == (
        segment_id,
        0,
        4,
        False,
    )
    assert board.latest(paths).version == 0  # v0 published for the workers
    # The lease stays with the run for its role tasks; another run stops before writing.
    assert lease.read(paths).owner == "kfp-run-a"
    with pytest.raises(ReplayRLError, match="being advanced by run 'kfp-run-a'"):
        async_runtime.begin_async_segment(config=cfg.to_yaml(), owner="kfp-run-b", workers=1)
    assert board.read_segment(paths).id == segment_id
    # A retried begin task of the same run writes the same segment again.
    again, same = async_runtime.begin_async_segment(
        config=cfg.to_yaml(), owner="kfp-run-a", workers=1
    )
    assert same == segment_id and again.lineage == cfg.lineage
    assert lease.release(paths, owner="kfp-run-a")


def test_a_role_holds_the_lease_as_the_run_and_calls_its_loop(tmp_path, monkeypatch):
    from replayrl.engine.asynchronous import roles as async_roles
    from replayrl.engine.asynchronous import trainer as async_trainer

    config = tiny_async(tmp_path)
    cfg = load_config(text=config)
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    calls = []

    def worker_loop(cfg_, paths_, *, worker, segment_id, threads):
        calls.append(("worker", worker, segment_id, threads, lease.read(paths_).owner))
        return board.WorkerStatus(worker=worker, batches=3, rows_appended=96, pid=1)

    def trainer_loop(cfg_, paths_, *, segment_id, threads):
        calls.append(("trainer", 0, segment_id, threads, lease.read(paths_).owner))
        return 8

    monkeypatch.setattr(async_roles, "worker_loop", worker_loop)
    monkeypatch.setattr(async_trainer, "trainer_loop", trainer_loop)
    numbers = async_runtime.async_role(
        config=config, owner="kfp-run-a", role="worker", index=1, segment_id="s1"
    )
    assert numbers["batches"] == 3 and numbers["rows_appended"] == 96 and "pid" not in numbers
    final = async_runtime.async_role(
        config=config, owner="kfp-run-a", role="trainer", segment_id="s1"
    )
    assert final["final_step"] == 8
    assert calls == [
        ("worker", 1, "s1", None, "kfp-run-a"),
        ("trainer", 0, "s1", None, "kfp-run-a"),
    ]
    # not released: the other roles still work; the exit task releases it
    assert lease.read(paths).owner == "kfp-run-a"


def test_a_role_that_loses_the_lease_stops_with_an_error(tmp_path, monkeypatch):
    from replayrl.engine.asynchronous import roles as async_roles

    beat = type("Beat", (), {"lost": None})()

    @contextlib.contextmanager
    def heartbeat(paths, *, owner, ttl_s, join=False):
        assert join, "the role tasks of one run join its epoch"
        yield beat

    def evaluator_loop(cfg, paths, *, segment_id, threads):
        beat.lost = "run 'kfp-run-b' holds it"  # what a heartbeat sets when it finds that
        deadline = time.time() + 30
        while time.time() < deadline:
            time.sleep(0.05)
        raise AssertionError("the role was not stopped")

    monkeypatch.setattr(lease, "heartbeat", heartbeat)
    monkeypatch.setattr(async_roles, "evaluator_loop", evaluator_loop)
    start = time.perf_counter()
    with pytest.raises(ReplayRLError) as e:
        async_runtime.async_role(
            config=tiny_async(tmp_path), owner="kfp-run-a", role="evaluator", segment_id="s1"
        )
    assert "Another run took the lease" in str(e.value) and "evaluator stopped" in str(e.value)
    assert time.perf_counter() - start < 10


# ---------------------------------------------------------------- kfp.local refuses


def test_kfp_local_refuses_an_asynchronous_config(tmp_path):
    cfg = load_config(text=tiny_async(tmp_path))
    with pytest.raises(ReplayRLError) as e:
        run_kfp_local(cfg)
    assert "kfp.local cannot run an asynchronous lineage" in str(e.value)
    assert "--engine async" in str(e.value)
    assert not (tmp_path / "runs").exists()


def test_replayrl_run_engine_kfp_local_refuses_an_asynchronous_config(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "replayrl.cli.main",
            "run",
            "--config",
            str(ROOT / "configs" / "tiny-cpu.yaml"),
            "--run-root",
            str(tmp_path / "runs"),
            "--engine",
            "kfp-local",
            "--set",
            "asynchronous.enabled=true",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "replayrl: error: The config sets asynchronous.enabled: true; run it with --engine async."
    )
    assert not (tmp_path / "runs").exists()


def test_the_pipeline_under_kfp_local_stops_at_its_begin_task(tmp_path, capfd):
    """kfp.local runs tasks one after another: the begin task refuses (it is not in a KFP
    pod) before it writes anything, and the exit task still runs."""
    from kfp import local

    config = tiny_async(tmp_path)
    cfg = load_config(text=config)
    built = async_segment_pipeline(k8s=local_pods(cfg.kubernetes))
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "kfp-local"),
        raise_on_error=True,
    )
    with pytest.raises(RuntimeError):
        built(config=config, run_root_s3_uri=cfg.storage.run_root)
    logs = capfd.readouterr()
    text = logs.out + logs.err
    assert "replayrl: error: The async_segment pipeline runs its workers" in text
    assert "kfp.local runs tasks one after another" in text
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    assert storage.read_state(paths) is None and lease.read(paths) is None
    assert list((tmp_path / "kfp-local").rglob("release-lineage*")), "the exit task ran"


def test_a_trainer_on_several_nodes_is_a_cpu_launcher_of_its_trainjob(tmp_path):
    """`asynchronous.trainer_nodes: 2`: the trainer task asks for no accelerator (its
    TrainJob's pods do) and may run as long as an accelerator step; the begin task is told
    the node count, so a run whose config says another is refused before it writes."""
    config = async_compile_config(tmp_path, trainers=2, trainer_nodes=2)
    compile_pipelines(tmp_path / "out", iterations=1, config_path=config)
    spec, deployment, k8s = parse(tmp_path / "out" / ASYNC_FILE)
    found = {name: (label, task) for name, label, task in tasks(spec)}
    label, trainer = found["async-trainer"]
    assert trainer.task_info.name == "trainer (2 nodes)"
    container = deployment.executors[label].container
    assert not container.resources.accelerator.resource_count
    assert k8s[label].active_deadline_seconds == KubernetesConfig().gpu_step_timeout_s
    assert any("trainjob.launch_trainer" in part for part in container.command)
    _, begin = found["begin-async-segment"]
    assert begin.inputs.parameters["trainer_nodes"].runtime_value.constant.number_value == 2
    for name in ("async-worker", "async-evaluator"):
        assert deployment.executors[found[name][0]].container.resources.accelerator.resource_count
