"""What every pipeline shares: its checked pod settings, the two kinds of pod a task runs on
(a CPU pod, or an accelerator pod, always retried), opening the lineage on a CPU pod, the
exit task that releases the run's lineage leases (`released_at_exit` wraps a pipeline's
tasks in it), and the run parameters' help text.
`replayrl.kfp.pipelines` and `replayrl.kfp.async_pipeline` build their pipelines from these.

Run parameters (what a KFP UI user fills in the run form): `run_root_s3_uri` (no default,
so the form blocks Start until it is filled), `config`, `arm`, `lineage`, `model_id`,
`dataset_id` and, where a pipeline trains a number of iterations, `iterations`. Each one
that is not empty overrides the config (`replayrl.kfp.runtime.resolve`).
"""

# No `from __future__ import annotations`, like the pipelines: KFP reads real annotations.
import collections
import contextlib

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


def on_cpu(
    task,
    k8s: KubernetesConfig,
    image: str,
    *,
    retry: bool,
    downloads: bool = False,
    quick: bool = False,
    timeout_s: int | None = None,
):
    """`task` on a CPU pod; `quick`: a quick step whose short deadline
    (`kubernetes.quick_step_timeout_s`) also bounds an image pull or a missing Secret;
    `timeout_s`: another deadline than a CPU step's."""
    return pods.configure(
        task,
        k8s,
        image=image,
        gpus=0,
        retry=retry,
        downloads=downloads,
        quick=quick,
        timeout_s=timeout_s,
    )


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
    return on_cpu(task, k8s, image, retry=False, downloads=True, quick=True)


def exit_task(
    k8s: KubernetesConfig,
    image: str,
    *,
    config,
    run_root,
    arms,
    lineages,
    model_id="",
    dataset_id="",
):
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
        model_id=model_id,
        dataset_id=dataset_id,
    )
    return on_cpu(task, k8s, image, retry=True, quick=True).set_display_name("release lineage")


@contextlib.contextmanager
def released_at_exit(k8s: KubernetesConfig, image: str, **params):
    """The tasks built inside run in a `dsl.ExitHandler` whose exit task (`exit_task`, of
    `params`) releases the run's lineage leases, which a failure, a Stop or a deadline still
    runs."""
    release = exit_task(k8s, image, **params)
    name = "release-lineages-at-exit" if len(params["arms"]) == 2 else "release-lineage-at-exit"
    with dsl.ExitHandler(release, name=name):
        yield


# The run parameters' help, defined once: the pipelines' docstrings are built from it (KFP
# copies a docstring's `Args:` into the compiled parameters' descriptions, which `replayrl
# submit`/`upload` put in the pipeline version's description, the one place the UI shows).
PARAMETER_HELP = {
    "run_root_s3_uri": "Where lineages live, s3://bucket/prefix. Required: every task reads "
    "and writes the lineage there.",
    "config": "Run config, one line: the JSON `replayrl config json FILE` prints, or the URI "
    "of a YAML file (s3://...). A multi-line YAML pasted into this one-line field is refused. "
    "{config_default}",
    "iterations": "Iterations this run trains, 1 to {max_iterations} (the most it was compiled "
    "for), from where the lineage stands.",
    "arm": "replay, replay-plain or on-policy; anything else is refused. Empty: the config's arm.",
    "lineage": "Name of the training run to create or continue. Empty: the config's "
    "storage.lineage, else <task>-{mode}<arm>-s<seed>.",
    "replay_lineage": "Name of the replay lineage. Empty: <task>-replay-s<seed>.",
    "on_policy_lineage": "Name of the on-policy lineage. Empty: <task>-on-policy-s<seed>.",
    "model_id": "The model to train: a Hugging Face id (Qwen/Qwen2.5-7B-Instruct) or a "
    "checkpoint URI; replaces model.source and model.revision. Empty: the config's.",
    "dataset_id": "The prompts: a Hugging Face dataset id or an s3:// Parquet/JSONL file; "
    "replaces task.path and task.revision. Empty: the config's.",
}


def documented(summary: str, names: list[str], **values) -> str:
    """A pipeline function's docstring: `summary`, then an `Args:` entry per run parameter in
    `names` from PARAMETER_HELP, its `{placeholders}` filled from `values` ("" if absent)."""
    filled = collections.defaultdict(str, values)
    args = "\n".join(
        f"    {name}: {PARAMETER_HELP[name].format_map(filled).strip()}" for name in names
    )
    return f"{summary}\n\nArgs:\n{args}\n"
