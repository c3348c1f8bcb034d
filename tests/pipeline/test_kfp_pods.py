"""Pods a real cluster runs to the end: read from the compiled YAML (the committed pipelines
and freshly compiled ones, every layout), as the KFP backend reads it.

- Retry windows: Argo counts a retry strategy's maxDuration (KFP's backoffMaxDuration) from
  the first attempt's start and starts no retry past it, so every retried task's window holds
  all its attempts at their full pod timeout plus every backoff.
- Node loss: accelerator pods and long CPU pods carry the cluster autoscaler's
  safe-to-evict: "false".
- Hardened namespaces: CPU and memory limits (at least the requests) on every task, and with
  kubernetes.run_as_user a pod that meets Pod Security "restricted" once a KFP >= 2.16 backend
  has added its own defaults; the image runs as a numeric non-root user with writable caches.
- Kueue: with kubernetes.kueue_queue the asynchronous segment's roles form one pod group.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from test_kfp_compile import COMMITTED, parse, tasks

from replayrl.errors import ReplayRLError
from replayrl.kfp import pods
from replayrl.kfp.pipelines import ASYNC_FILE, compile_pipelines

pytestmark = pytest.mark.pipeline
ROOT = Path(__file__).parents[2]
DOCKERFILE = ROOT / "k8s" / "image" / "Dockerfile"
# A config far from the defaults: 3 retries, short backoff, long GPU pods, CPU pods without a
# timeout, a Kueue queue, a security context, 3 workers.
ODD = {
    "asynchronous": {"workers": 3},
    "kubernetes": {
        "layout": "step",
        "retries": 3,
        "retry_backoff_s": 30,
        "gpu_step_timeout_s": 12 * 3600,
        "cpu_step_timeout_s": 0,
        "kueue_queue": "rl-gpus",
        "run_as_user": 1000,
    },
}


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> list[Path]:
    """Every compiled pipeline: the committed ones (task layout, defaults), the step layout,
    and the odd config's."""
    tmp = tmp_path_factory.mktemp("pods")
    step = tmp / "step.yaml"
    step.write_text(yaml.safe_dump({"kubernetes": {"layout": "step"}}))
    odd = tmp / "odd.yaml"
    odd.write_text(yaml.safe_dump(ODD))
    out = sorted(COMMITTED.glob("*.yaml"))
    out += compile_pipelines(tmp / "step", iterations=2, config_path=step)
    out += compile_pipelines(tmp / "odd", iterations=2, config_path=odd)
    return out


def container_tasks(path: Path):
    """(component, task spec, executor container, its KubernetesExecutorConfig) of every
    container task of the pipeline at `path`."""
    spec, deployment, k8s = parse(path)
    for component, label, task in tasks(spec):
        yield component, task, deployment.executors[label].container, k8s[label]


def test_every_retried_task_can_retry_after_a_full_timeout(pipelines):
    retried = 0
    for path in pipelines:
        for component, task, _, config in container_tasks(path):
            policy = task.retry_policy
            if not policy.max_retry_count:
                continue
            retried += 1
            n, timeout_s = policy.max_retry_count, config.active_deadline_seconds
            backoff_s = policy.backoff_duration.seconds
            backoffs = sum(backoff_s * policy.backoff_factor**i for i in range(n))
            window_s = policy.backoff_max_duration.seconds
            where = f"{path.parent.name}/{path.name}: {component}"
            if timeout_s:
                assert window_s >= (n + 1) * timeout_s + backoffs, where
            else:  # no pod timeout: a window no task of ours comes near
                assert window_s >= 7 * 24 * 3600, where
    assert retried > 40  # every layout's accelerator steps, compact, compare, the exit task


def test_the_odd_config_reaches_the_retry_policy(pipelines):
    odd = [p for p in pipelines if p.parent.name == "odd"]
    windows = {
        (c, t.retry_policy.backoff_max_duration.seconds)
        for path in odd
        for c, t, _, _ in container_tasks(path)
        if t.retry_policy.max_retry_count
    }
    # 4 x 12 h + 30 x (1 + 2 + 4) s + an hour of Pending
    assert ("train", 4 * 12 * 3600 + 210 + 3600) in windows
    assert ("compact", 7 * 24 * 3600 + 210) in windows  # CPU pods without a timeout


def test_accelerator_and_long_cpu_pods_are_not_evicted_by_a_scale_down(pipelines):
    for path in pipelines:
        for component, _, container, config in container_tasks(path):
            annotations = dict(config.pod_metadata.annotations)
            long = not config.active_deadline_seconds or (
                config.active_deadline_seconds > pods.LONG_POD_S
            )
            if container.resources.accelerator.resource_count or long:
                assert annotations.get(pods.SAFE_TO_EVICT) == "false", (path.name, component)
                # Karpenter ignores safe-to-evict: its own annotation.
                assert annotations.get(pods.DO_NOT_DISRUPT) == "true", (path.name, component)


def test_short_cpu_pods_may_be_evicted(tmp_path):
    from kfp import compiler

    from replayrl.config import KubernetesConfig
    from replayrl.kfp.pipelines import replay_iteration_pipeline

    path = tmp_path / "short.yaml"
    k8s = KubernetesConfig(cpu_step_timeout_s=300)
    compiler.Compiler().compile(replay_iteration_pipeline(k8s=k8s), str(path))
    seen = set()
    for component, _, container, k8s in container_tasks(path):
        seen.add(component)
        evictable = pods.SAFE_TO_EVICT not in k8s.pod_metadata.annotations
        assert evictable == (pods.DO_NOT_DISRUPT not in k8s.pod_metadata.annotations)
        assert evictable == (not container.resources.accelerator.resource_count), component
    assert {"open-lineage", "run-iterations", "release-lineage"} <= seen


def test_every_task_has_cpu_and_memory_limits_at_least_its_requests(pipelines):
    for path in pipelines:
        for component, _, container, _ in container_tasks(path):
            r = container.resources
            assert r.resource_cpu_limit and r.resource_memory_limit, (path.name, component)
            assert pods.quantity(r.resource_cpu_limit) >= pods.quantity(r.resource_cpu_request)
            assert pods.quantity(r.resource_memory_limit) >= pods.quantity(
                r.resource_memory_request
            )


@pytest.mark.parametrize(
    "section,message",
    [
        ({"gpu_step_memory_limit": "16Gi"}, "kubernetes.gpu_step_memory_limit (16Gi) is below"),
        ({"cpu_step_cpu_limit": "500m"}, "kubernetes.cpu_step_cpu_limit (500m) is below"),
        ({"cpu_step_memory_limit": "lots"}, "must be a Kubernetes quantity"),
        ({"kueue_queue": "GPU queue"}, "kubernetes.kueue_queue must be a LocalQueue name"),
        ({"run_as_user": 0}, "kubernetes.run_as_user must be"),
    ],
)
def test_bad_pod_settings_fail_before_writing(tmp_path, section, message):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"kubernetes": section}))
    with pytest.raises(ReplayRLError, match=re.escape(message)):
        compile_pipelines(tmp_path / "out", config_path=config)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_the_asynchronous_roles_form_one_kueue_pod_group(pipelines):
    (odd,) = [p for p in pipelines if p.parent.name == "odd" and p.name == ASYNC_FILE]
    grouped = {}
    for component, task, _, config in container_tasks(odd):
        labels = dict(config.pod_metadata.labels)
        if component.startswith("async-"):  # worker x3, trainer, evaluator
            assert labels == {
                pods.KUEUE_QUEUE_LABEL: "rl-gpus",
                pods.KUEUE_GROUP_LABEL: "{{workflow.name}}",
            }, component
            annotations = config.pod_metadata.annotations
            grouped[task.task_info.name] = annotations[pods.KUEUE_COUNT_ANNOTATION]
        else:  # the begin task and the exit task are not part of the group
            assert not labels, component
    assert grouped == {
        name: "5" for name in ("worker 0", "worker 1", "worker 2", "trainer", "evaluator")
    }
    # off by default: no Kueue label anywhere
    for path in COMMITTED.glob("*.yaml"):
        for _, _, _, config in container_tasks(path):
            assert not config.pod_metadata.labels


# What a KFP >= 2.16 backend adds to every executor pod by itself (argocompiler
# security_context.go, applySecurityContextToExecutorTemplate): the pod's seccomp profile,
# and on the user container allowPrivilegeEscalation false and all capabilities dropped; the
# driver then applies the task's securityContext (runAsUser, runAsGroup, runAsNonRoot).
BACKEND_POD_DEFAULTS = {"seccompProfile": {"type": "RuntimeDefault"}}
BACKEND_CONTAINER_DEFAULTS = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
# Pod Security Standards, "restricted": the volume types it allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral"}
RESTRICTED_VOLUMES |= {"persistentVolumeClaim", "projected", "secret"}


def restricted_violations(pod: dict, container: dict, volumes: set[str]) -> list[str]:
    """What Pod Security "restricted" refuses in a pod of one container (its rules as the
    Kubernetes docs list them)."""
    bad = []
    non_root = container.get("runAsNonRoot", pod.get("runAsNonRoot"))
    if non_root is not True:
        bad.append("runAsNonRoot must be true")
    if container.get("runAsUser", pod.get("runAsUser")) == 0:
        bad.append("runAsUser must not be 0")
    if container.get("allowPrivilegeEscalation") is not False:
        bad.append("allowPrivilegeEscalation must be false")
    caps = container.get("capabilities", {})
    if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
        bad.append("capabilities must drop ALL")
    seccomp = container.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        bad.append("seccompProfile must be RuntimeDefault")
    if volumes - RESTRICTED_VOLUMES:
        bad.append(f"volume types {sorted(volumes - RESTRICTED_VOLUMES)}")
    return bad


def test_with_run_as_user_every_pod_meets_pod_security_restricted(pipelines):
    odd = [p for p in pipelines if p.parent.name == "odd"]
    checked = 0
    for path in odd:
        for component, _, _, config in container_tasks(path):
            security = config.security_context
            assert security.run_as_non_root and security.run_as_user == 1000, component
            container = {
                **BACKEND_CONTAINER_DEFAULTS,
                "runAsUser": security.run_as_user,
                "runAsGroup": security.run_as_group,
                "runAsNonRoot": security.run_as_non_root,
            }
            volumes = {"emptyDir"} if config.empty_dir_mounts else set()
            volumes |= {"secret"} if config.secret_as_volume else set()
            volumes |= {"persistentVolumeClaim"} if config.pvc_mount else set()
            assert not restricted_violations(BACKEND_POD_DEFAULTS, container, volumes), component
            checked += 1
    assert checked > 20
    # The same pods without the backend's defaults (a KFP 2.15 backend) are refused: the
    # check is not vacuous.
    assert restricted_violations({}, {"runAsNonRoot": True, "runAsUser": 1000}, set()) == [
        "allowPrivilegeEscalation must be false",
        "capabilities must drop ALL",
        "seccompProfile must be RuntimeDefault",
    ]


def test_without_run_as_user_no_security_context_is_compiled(pipelines):
    """A KFP 2.15 backend refuses a task whose Kubernetes config has a securityContext (it
    unmarshals it strictly, and the field came with 2.16), so the default leaves it out."""
    for path in COMMITTED.glob("*.yaml"):
        for component, _, _, config in container_tasks(path):
            assert not config.HasField("security_context"), component


def _dockerfile_final_stage() -> tuple[dict[str, str], dict[str, str], list[str], str]:
    """(ARGs, ENVs, RUN commands, USER) of the Dockerfile's last stage, ARGs expanded."""
    import importlib.util

    # the Dockerfile parser of tests/unit/test_dockerfile.py (heredocs and continuations)
    spec = importlib.util.spec_from_file_location(
        "test_dockerfile", ROOT / "tests" / "unit" / "test_dockerfile.py"
    )
    assert spec and spec.loader
    parser = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parser)
    expand, instructions = parser.expand, parser.instructions
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    runs: list[str] = []
    user = ""
    for word, rest in instructions(DOCKERFILE.read_text()):
        if word == "FROM":
            env, runs, user = {}, [], ""
        elif word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip()
        elif word == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", rest):
                env[key] = expand(value, {**args, **env})
        elif word == "RUN":
            runs.append(expand(rest, args))
        elif word == "USER":
            user = expand(rest, args)
    return args, env, runs, user


def test_the_image_runs_as_a_numeric_non_root_user_with_writable_caches():
    _, env, runs, user = _dockerfile_final_stage()
    uid, _, gid = user.partition(":")
    # a number: the kubelet can check runAsNonRoot only against a numeric UID
    assert uid.isdigit() and int(uid) > 0, user
    assert gid in ("", "0") or gid.isdigit()
    home = env["HOME"]
    for key in ("HF_HOME", "REPLAYRL_CACHE", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"):
        assert env[key].startswith(home + "/"), key
    setup = " ".join(runs)
    # the user exists with that UID, and owns HOME, the scratch mount point and the launcher's
    # artifact paths
    assert re.search(rf"useradd --uid {uid}\b", setup)
    chown = re.search(rf"chown -R {uid}:0 ([^&]+)", setup)
    assert chown, "the writable paths are not given to the user"
    owned = chown.group(1).split()
    for path in (home, "/scratch", "/s3", "/minio", "/gcs"):
        assert path in owned, path
    for key in ("HF_HOME", "REPLAYRL_CACHE"):
        assert env[key] in setup.split(), f"{key} ({env[key]}) is not created in the image"
    # the scratch volume's cache (an emptyDir, writable by any UID) is under the mount point
    assert pods.SCRATCH_CACHE.startswith(pods.SCRATCH_MOUNT + "/")


@pytest.mark.parametrize(
    "text,value",
    [("4Gi", 4 * 2**30), ("500m", 0.5), ("1e3", 1000), ("1E", 1e18), ("2Ei", 2 * 2**60)],
)
def test_quantities_compare_as_kubernetes_reads_them(text, value):
    assert pods.quantity(text) == pytest.approx(value)


def test_image_pull_secrets_reach_every_pod(tmp_path):
    from kfp import compiler

    from replayrl.config import KubernetesConfig
    from replayrl.kfp.pipelines import replay_loop_pipeline

    path = tmp_path / "private.yaml"
    k8s = KubernetesConfig(image_pull_secrets=["regcred", "mirror.pull"])
    compiler.Compiler().compile(replay_loop_pipeline(iterations=2, k8s=k8s), str(path))
    found = list(container_tasks(path))
    assert found
    for component, _, _, config in found:
        names = [s.secret_name for s in config.image_pull_secret]
        assert names == ["regcred", "mirror.pull"], component


def test_a_bad_image_pull_secret_name_is_refused():
    import pytest

    from replayrl.config import KubernetesConfig
    from replayrl.errors import ReplayRLError

    with pytest.raises(ReplayRLError, match="image_pull_secrets must list Secret names"):
        KubernetesConfig(image_pull_secrets=["Not_A_Name"]).check()


def _compiled_with(tmp_path: Path, k8s, *, quick_open: bool = True) -> dict[str, tuple]:
    """{component: (executor container, KubernetesExecutorConfig)} of a pipeline of the real
    open, generate, compact and exit components, set up by `pods.configure` as the
    pipelines set them up: open and exit as quick CPU steps, generate on an accelerator."""
    from kfp import compiler, dsl

    from replayrl.kfp.components import compact, generate, open_lineage, release_lineage

    image = "registry.example.com/replayrl:1"

    config, run_root = "{}", "s3://b/r"

    @dsl.pipeline(name="pod-settings")  # no parameters: this module's annotations are text
    def pipeline():
        release = pods.configure(
            release_lineage(config=config, run_root=run_root, owner="o", arm="a", lineage="l"),
            k8s, image=image, gpus=0, retry=True, quick=True,
        )  # fmt: skip
        with dsl.ExitHandler(release):
            opened = pods.configure(
                open_lineage(
                    config=config, arm="a", lineage="l", run_root=run_root, owner="o",
                    required_iterations=1,
                ),
                k8s, image=image, gpus=0, retry=False, downloads=True, quick=quick_open,
            )  # fmt: skip
            gen = pods.configure(
                generate(config=config, owner="o", iteration=1, policy_version=0),
                k8s, image=image, gpus=1, retry=True,
            ).after(opened)  # fmt: skip
            pods.configure(
                compact(config=config, owner="o", iteration=1, policy_version=0),
                k8s, image=image, gpus=0, retry=True,
            ).after(gen)  # fmt: skip

    path = tmp_path / "pods.yaml"
    compiler.Compiler().compile(pipeline, str(path))
    return {component: (c, config) for component, _, c, config in container_tasks(path)}


def test_quick_steps_fail_within_minutes_and_the_others_keep_their_deadlines(tmp_path):
    """A pod that cannot pull its image or lacks a Secret key never starts its container;
    activeDeadlineSeconds counts from when the node took it (pull included), so the open
    task, the pipeline's first, fails the run after quick_step_timeout_s, not after the CPU
    timeout, before any accelerator pod is requested; the exit task likewise, each retry."""
    from replayrl.config import KubernetesConfig

    k8s = KubernetesConfig()
    found = _compiled_with(tmp_path, k8s)
    deadline = {name: config.active_deadline_seconds for name, (_, config) in found.items()}
    assert deadline == {
        "open-lineage": 900,
        "release-lineage": 900,
        "generate": k8s.gpu_step_timeout_s,
        "compact": k8s.cpu_step_timeout_s,
    }
    assert k8s.quick_step_timeout_s == 900 < k8s.cpu_step_timeout_s
    # The exit task's retry window is sized from its own, shorter, deadline.
    spec, _, _ = parse(tmp_path / "pods.yaml")
    (exit_policy,) = [t.retry_policy for c, _, t in tasks(spec) if c == "release-lineage"]
    assert exit_policy.backoff_max_duration.seconds == pods.retry_window_s(
        timeout_s=900, retries=k8s.retries, backoff_s=k8s.retry_backoff_s
    )
    # Never longer than the other CPU steps'; 0 = theirs.
    for quick, cpu, expected in [(900, 300, 300), (0, 3600, 3600), (600, 0, 600), (0, 0, 0)]:
        k = KubernetesConfig(quick_step_timeout_s=quick, cpu_step_timeout_s=cpu)
        assert pods.quick_timeout_s(k) == expected
    found = _compiled_with(tmp_path, KubernetesConfig(quick_step_timeout_s=0, cpu_step_timeout_s=0))
    assert not found["open-lineage"][1].active_deadline_seconds


def test_a_bad_quick_step_timeout_is_refused_with_one_line(tmp_path):
    from replayrl.config import KubernetesConfig

    with pytest.raises(ReplayRLError, match=r"^kubernetes.quick_step_timeout_s must be >= 0"):
        pods.validate(KubernetesConfig(quick_step_timeout_s=-5))
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"kubernetes": {"quick_step_timeout_s": -5}}))
    with pytest.raises(ReplayRLError, match="quick_step_timeout_s") as refused:
        compile_pipelines(tmp_path / "out", config_path=config)
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="quick=True is for CPU steps"):
        pods.configure(None, KubernetesConfig(), image="x", gpus=1, retry=False, quick=True)


def test_scratch_is_an_empty_dir_or_a_generic_ephemeral_volume_of_its_size(tmp_path):
    """KFP requests no ephemeral-storage for a pod (its container resources are CPU, memory
    and an accelerator): an emptyDir's sizeLimit bounds scratch without reserving it; with
    scratch_storage_class, /scratch is a PVC of scratch_size made with the pod, so the pod
    starts only where that much disk is provisioned."""
    from replayrl.config import KubernetesConfig

    (gen, config) = _compiled_with(tmp_path, KubernetesConfig())["generate"]
    scratch = [m for m in config.empty_dir_mounts if m.volume_name == pods.SCRATCH_VOLUME]
    assert [(m.mount_path, m.size_limit) for m in scratch] == [("/scratch", "100Gi")]
    assert not config.generic_ephemeral_volume

    k8s = KubernetesConfig(scratch_size="250Gi", scratch_storage_class="local-nvme")
    found = _compiled_with(tmp_path, k8s)
    (gen, config) = found["generate"]
    assert [m.volume_name for m in config.empty_dir_mounts] == [pods.SHM_VOLUME]
    (volume,) = config.generic_ephemeral_volume
    assert (volume.volume_name, volume.mount_path, volume.size) == ("scratch", "/scratch", "250Gi")
    assert (volume.storage_class_name, volume.default_storage_class) == ("local-nvme", False)
    assert list(volume.access_modes) == ["ReadWriteOnce"]
    env = {e.name: e.value for e in gen.env}
    assert env["REPLAYRL_CACHE"] == pods.SCRATCH_CACHE
    # CPU steps get no scratch volume either way.
    for name in ("open-lineage", "compact", "release-lineage"):
        assert not found[name][1].generic_ephemeral_volume, name


def test_a_bad_scratch_storage_class_is_refused():
    from replayrl.config import KubernetesConfig

    with pytest.raises(ReplayRLError, match="scratch_storage_class must be a StorageClass name"):
        KubernetesConfig(scratch_storage_class="Fast SSD").check()
