"""The cluster self-test pipeline, `replayrl_smoke`: before the first training run, check
from inside the namespace, with the pods' own Secrets, ConfigMaps, service account and image,
what a run needs. Two tasks, side by side:

- a CPU task (the pod settings of the task that opens a lineage, so it also gets `HF_TOKEN`):
  the config, the pods' environment, the bucket (the conditional-write probe every lineage
  runs), MLflow, and the hub token where one is set;
- a GPU task (the pod settings of the config's largest accelerator pod): CUDA, the GPUs it
  sees and the NVIDIA driver.

Each prints one line per check (✓/✗/?, as `replayrl preflight`) and writes them to a
Markdown output and 1/0 per check to a Metrics output; a ✗ fails its task, so a run that
succeeds is a namespace ready to train (`replayrl.kfp.smoke_checks` says what is checked).
Neither task is retried (a failed check is the answer), and each pod's timeout is at most
`SMOKE_TIMEOUT_S`. Knows nothing about lineages: nothing but two probe objects (deleted at
once) and, when missing, the config's MLflow experiment is written.
"""

# No `from __future__ import annotations`: KFP reads the real annotation objects.
import dataclasses
import json

from kfp import dsl
from kfp.dsl import Markdown, Metrics, Output

from replayrl.config import KubernetesConfig
from replayrl.kfp import DEFAULT_IMAGE, pods
from replayrl.kfp.components import _COMPONENT
from replayrl.kfp.tasks import on_accelerators, on_cpu, pod_settings

SMOKE_FILE = "replayrl_smoke.yaml"
# A smoke pod's most time: its checks take seconds; the rest is pulling the image and, on a
# GPU node just added by an autoscaler, its driver start.
SMOKE_TIMEOUT_S = 1800


@dsl.component(**_COMPONENT)
def check_namespace(
    config: str, run_root: str, sources: str, report: Output[Markdown], metrics: Output[Metrics]
):
    """The CPU pod's checks: config, environment (`sources`: JSON, `env_sources`), bucket,
    MLflow, hub token."""
    import os

    from replayrl.kfp import runtime, smoke_checks

    with runtime.user_errors_as_exit():
        findings = smoke_checks.namespace_checks(config, run_root, sources, os.environ)
        smoke_checks.finish(findings, report, metrics, title="replayrl self-test: namespace")


@dsl.component(**_COMPONENT)
def check_gpus(gpus: int, report: Output[Markdown], metrics: Output[Metrics]):
    """The GPU pod's checks: CUDA serves `gpus` GPUs; the NVIDIA driver."""
    import os

    from replayrl.kfp import runtime, smoke_checks

    smoke_checks.drop_gpu_guard(os.environ)  # before the guard runs: list every finding
    with runtime.user_errors_as_exit():
        findings = smoke_checks.gpu_checks(gpus, os.environ)
        smoke_checks.finish(findings, report, metrics, title="replayrl self-test: GPUs")


def env_sources(k8s: KubernetesConfig) -> dict[str, list[str]]:
    """The Secrets and ConfigMaps a CPU task that downloads takes variables from
    (`pods.configure`), and which: "Secret replayrl-s3" -> [AWS_ACCESS_KEY_ID, ...]. Read at
    compile time (a component body cannot import `kfp.kubernetes`)."""
    sources = (
        ("Secret", k8s.s3_secret, pods.S3_SECRET_KEYS),
        ("Secret", k8s.mlflow_secret, pods.MLFLOW_SECRET_KEYS),
        ("Secret", k8s.hf_secret, pods.HF_SECRET_KEYS),
        ("ConfigMap", k8s.endpoints_config_map, pods.ENDPOINT_KEYS),
    )
    return {f"{kind} {name}": list(keys.values()) for kind, name, keys in sources if name}


def smoke_settings(k8s: KubernetesConfig) -> KubernetesConfig:
    """The config's pod settings for the self-test: no retries, at most `SMOKE_TIMEOUT_S`."""

    def capped(timeout_s: int) -> int:
        return min(timeout_s, SMOKE_TIMEOUT_S) if timeout_s > 0 else SMOKE_TIMEOUT_S

    return dataclasses.replace(
        k8s,
        retries=0,
        cpu_step_timeout_s=capped(k8s.cpu_step_timeout_s),
        gpu_step_timeout_s=capped(k8s.gpu_step_timeout_s),
    )


def smoke_pipeline(
    *, image: str = DEFAULT_IMAGE, k8s: KubernetesConfig | None = None, default_config: str = ""
):
    """`replayrl_smoke`: the namespace's self-test, with the pods of `k8s` (the config's
    `kubernetes:` section) and `image`; the GPU task asks for the most GPUs any step does."""
    k8s = smoke_settings(pod_settings(k8s, image))
    gpus = max(k8s.generate_gpus, k8s.train_gpus, k8s.evaluate_gpus)

    @dsl.pipeline(
        name="replayrl-smoke",
        pipeline_root=k8s.pipeline_root,
        description=(
            "replayrl: self-test of this namespace before a first run: the bucket (conditional "
            "writes), MLflow and the hub token from a CPU pod, CUDA and the NVIDIA driver from "
            f"a GPU pod ({gpus} GPU(s)), with the pods' own Secrets and ConfigMaps."
        ),
    )
    def replayrl_smoke(run_root_s3_uri: str, config: str = default_config):
        """Check that runs of this config can start and commit in this namespace.

        Args:
            run_root_s3_uri: The run root your runs will use, s3://bucket/prefix. Required: two probe objects are written there and deleted.
            config: Run config, one line: the JSON `replayrl config json FILE` prints, or the URI of a YAML file (s3://...). Its tracking settings name the MLflow server checked. Empty: the library defaults.
        """
        on_cpu(
            check_namespace(
                config=config, run_root=run_root_s3_uri, sources=json.dumps(env_sources(k8s))
            ),
            k8s,
            image,
            retry=False,
            downloads=True,
        ).set_display_name("check bucket, MLflow, hub token")
        on_accelerators(check_gpus(gpus=gpus), k8s, image, gpus).set_display_name(
            f"check {gpus} GPU(s), CUDA, driver"
        )

    return replayrl_smoke
