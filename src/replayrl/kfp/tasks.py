"""What every pipeline shares: its checked pod settings, the two kinds of pod a task runs on
(a CPU pod, or an accelerator pod, always retried), opening the lineage on a CPU pod and the
exit task that releases the run's lineage leases. `replayrl.kfp.pipelines` and
`replayrl.kfp.async_pipeline` build their pipelines from these.
"""

# No `from __future__ import annotations`, like the pipelines: KFP reads real annotations.
from kfp import dsl

from replayrl.config import KubernetesConfig
from replayrl.kfp import pods
from replayrl.kfp.components import open_lineage, release_lineage


def pod_settings(k8s: KubernetesConfig | None, image: str) -> KubernetesConfig:
    """A pipeline's pod settings (the defaults when None), checked together with its image."""
    k8s = k8s or KubernetesConfig()
    pods.validate(k8s)
    pods.check_image(image)
    return k8s


def on_cpu(task, k8s: KubernetesConfig, image: str, *, retry: bool, downloads: bool = False):
    """`task` on a CPU pod."""
    return pods.configure(task, k8s, image=image, gpus=0, retry=retry, downloads=downloads)


def on_accelerators(task, k8s: KubernetesConfig, image: str, gpus: int):
    """`task` on a pod with `gpus` accelerators, retried: every accelerator step resumes from
    what is committed under the run root."""
    return pods.configure(task, k8s, image=image, gpus=gpus, retry=True)


def open_task(k8s: KubernetesConfig, image: str, required_iterations: int, **params):
    """Open the lineage on a CPU pod. Not retried: its most likely failure is another run
    holding the lineage, and a retry a minute later would start the next iteration instead
    of stopping."""
    task = open_lineage(
        owner=dsl.PIPELINE_JOB_ID_PLACEHOLDER, required_iterations=required_iterations, **params
    )
    return on_cpu(task, k8s, image, retry=False, downloads=True)


def exit_task(k8s: KubernetesConfig, image: str, *, config, run_root, arms, lineages):
    """The exit task that releases the run's lineage leases (CPU; idempotent, so retried):
    one lineage, or two (compare_arms), each passed as a scalar input."""
    if len(arms) not in (1, 2) or len(arms) != len(lineages):
        raise ValueError(f"one or two (arm, lineage) pairs, got {arms!r}, {lineages!r}")
    pair = len(arms) == 2
    task = release_lineage(
        config=config,
        run_root=run_root,
        owner=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        arm=arms[0],
        lineage=lineages[0],
        second_arm=arms[1] if pair else "",
        second_lineage=lineages[1] if pair else "",
        pair=pair,
    )
    return on_cpu(task, k8s, image, retry=True).set_display_name("release lineage")
