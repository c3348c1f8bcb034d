"""The `async_segment` pipeline: one segment of an asynchronous lineage, with W generation
workers, the trainer and the evaluator as parallel accelerator tasks after one CPU task
that begins the segment. `replayrl.kfp.pipelines` compiles it with the other pipelines.
"""

# No `from __future__ import annotations`: KFP reads the pipelines' real annotations.
import json

from kfp import dsl

from replayrl.config import KubernetesConfig
from replayrl.kfp import DEFAULT_IMAGE, pods
from replayrl.kfp.components import (
    async_evaluator,
    async_trainer,
    async_worker,
    begin_async_segment,
)
from replayrl.kfp.tasks import (
    documented,
    on_accelerators,
    on_cpu,
    pod_settings,
    released_at_exit,
)


def async_segment_pipeline(
    *,
    workers: int = 1,
    trainers: int = 1,
    trainer_nodes: int = 1,
    image: str = DEFAULT_IMAGE,
    k8s: KubernetesConfig | None = None,
    default_config: str = "",
):
    """`async_segment`: one segment of an asynchronous lineage (`asynchronous.enabled`), with
    generation, training and evaluation as parallel accelerator tasks:

        begin segment (CPU: open or resume the lineage, publish v0, write the segment)
          -> worker 0 .. worker W-1   (each kubernetes.generate_gpus)
          -> trainer                  (kubernetes.train_gpus x asynchronous.trainers)
          -> evaluator                (kubernetes.evaluate_gpus)

    All roles depend only on the begin task, so they run side by side, coordinated only
    through the buffer and the published weights under the run root (S3 on a cluster); the
    trainer marks the segment done at its end step (`asynchronous.segment_steps`) or
    deadline (`asynchronous.segment_seconds`), and the workers and the evaluator then stop.
    Every segment has a deadline even when the config gives none: the pods' timeout
    (`kubernetes.gpu_step_timeout_s`) less a 10 % margin, and a longer `segment_seconds` is
    cut to it; a role whose peers have not started within
    `asynchronous.peer_start_timeout_s` gives the segment up with one error line. Schedule the pipeline as a recurring run (max concurrency 1): each run drives
    one segment from the newest published weights, until the lineage's last gradient step
    (iterations x S). The whole pipeline sits in the exit handler that releases the lease.

    W (`workers`, the worker tasks) is a pod setting, fixed at compile time from the
    `asynchronous.workers` of `replayrl compile --config`; the begin task refuses a config
    whose `asynchronous.workers` differs. With `trainer_nodes` > 1
    (`asynchronous.trainer_nodes`, also fixed at compile time and checked by the begin task)
    the trainer task is a CPU launcher of a Kubeflow Trainer TrainJob on that many nodes
    (`replayrl.kfp.trainjob`), whose deadline is an accelerator step's. Role tasks are retried: a retried role resumes from
    the published weights and the buffer. With `kubernetes.kueue_queue`, the W + 2 role pods
    form one Kueue pod group per run (`replayrl.kfp.pods.kueue_pod_group`), admitted
    together when the queue has accelerators for all of them.

    kfp.local cannot run this pipeline: it runs tasks one after another, so the trainer
    would wait forever for rows from workers that have not started. Its begin task refuses
    to run outside a KFP pod, and `replayrl run --engine kfp-local` refuses an asynchronous
    config; on one machine, `replayrl run --engine async` runs the same roles as processes.
    """
    from replayrl.errors import ReplayRLError

    if workers < 1:
        raise ReplayRLError(f"async_segment needs asynchronous.workers >= 1, got {workers}.")
    if trainers < 1:
        raise ReplayRLError(f"async_segment needs asynchronous.trainers >= 1, got {trainers}.")
    k8s = pod_settings(k8s, image)

    def async_segment(
        run_root_s3_uri: str,
        config: str = default_config,
        arm: str = "",
        lineage: str = "",
        model_id: str = "",
        dataset_id: str = "",
    ):
        overrides = dict(model_id=model_id, dataset_id=dataset_id)
        with released_at_exit(
            k8s,
            image,
            config=config,
            run_root=run_root_s3_uri,
            arms=[arm],
            lineages=[lineage],
            **overrides,
        ):
            begun = _begin(
                k8s,
                image,
                workers,
                trainer_nodes=trainer_nodes,
                config=config,
                arm=arm,
                lineage=lineage,
                run_root=run_root_s3_uri,
                **overrides,
            )
            _roles(
                begun, k8s, image, workers=workers, trainers=trainers, trainer_nodes=trainer_nodes
            )

    async_segment.__doc__ = documented(
        "Run one segment of an asynchronous lineage, from its newest published weights.",
        ["run_root_s3_uri", "config", "arm", "lineage", "model_id", "dataset_id"],
        config_default=(
            f"Must set asynchronous.enabled: true and asynchronous.workers: {workers} (this "
            "pipeline's worker tasks). Its default: the config the pipeline was compiled with, "
            "made asynchronous."
        ),
        mode="async-",
    )
    async_segment = dsl.pipeline(
        name="async-segment",
        pipeline_root=k8s.pipeline_root,
        description=(
            f"replayrl: one segment of an asynchronous lineage: {workers} generation "
            f"worker(s), the trainer and the evaluator as parallel tasks over the buffer and "
            f"published weights; schedule it as a recurring run (max concurrency 1)."
        ),
    )(async_segment)
    return async_segment


def _begin(k8s: KubernetesConfig, image: str, workers: int, *, trainer_nodes: int, **params):
    """The CPU task that opens or resumes the lineage and begins the segment. Not retried,
    like opening a lineage: its most likely failure is another run holding the lineage."""
    task = begin_async_segment(
        **params,
        owner=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        workers=workers,
        trainer_nodes=trainer_nodes,
    )
    return on_cpu(task, k8s, image, retry=False, downloads=True, quick=True).set_display_name(
        "begin segment"
    )


def _roles(
    begun, k8s: KubernetesConfig, image: str, *, workers: int, trainers: int, trainer_nodes: int
) -> None:
    """The role tasks after `begun`, side by side: W workers, the trainer (on this pod, or
    with `trainer_nodes` > 1 a CPU launcher of its TrainJob), the evaluator."""
    common = dict(
        config=begun.outputs["config"],
        owner=begun.outputs["owner"],
        segment_id=begun.outputs["segment_id"],
    )
    roles = [
        *(
            on_accelerators(
                async_worker(worker=w, **common), k8s, image, k8s.generate_gpus
            ).set_display_name(f"worker {w}")
            for w in range(workers)
        ),
        _trainer(common, k8s, image, trainers=trainers, trainer_nodes=trainer_nodes),
        on_accelerators(async_evaluator(**common), k8s, image, k8s.evaluate_gpus).set_display_name(
            "evaluator"
        ),
    ]
    # With kubernetes.kueue_queue, Kueue admits the roles as one group or not at all.
    for task in roles:
        pods.kueue_pod_group(task, k8s, pods=len(roles))


def _trainer(common: dict, k8s: KubernetesConfig, image: str, *, trainers: int, trainer_nodes: int):
    """The trainer task: T trainers on this pod's accelerators, or (`trainer_nodes` > 1) a
    CPU pod that creates the segment's TrainJob and waits for it as long as an accelerator
    step may run. Kueue counts the launcher in the roles' pod group; the TrainJob is
    admitted as a workload of its own (`replayrl.kfp.trainjob`)."""
    if trainer_nodes > 1:
        from replayrl.kfp import trainjob_component

        return on_cpu(
            trainjob_component.async_trainer(**common),
            k8s,
            image,
            retry=True,
            timeout_s=k8s.gpu_step_timeout_s,
        ).set_display_name(f"trainer ({trainer_nodes} nodes)")
    return on_accelerators(
        async_trainer(**common), k8s, image, k8s.train_gpus * trainers
    ).set_display_name("trainer")


def async_default_config(tree: dict) -> str:
    """The default `config` of `async_segment`: the compile config with
    `asynchronous.enabled: true` (as `replayrl run --engine async` sets it), as one line of
    JSON (see `replayrl.kfp.pipelines.compile_pipelines`)."""
    tree = dict(tree)
    section = tree.get("asynchronous")
    tree["asynchronous"] = {**(section if isinstance(section, dict) else {}), "enabled": True}
    return json.dumps(tree, default=str)
