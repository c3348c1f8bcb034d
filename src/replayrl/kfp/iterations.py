"""The building blocks of the synchronous pipelines (`replayrl.kfp.pipelines`): one iteration
as a sub-pipeline (the "step" layout), a `run_iterations` pod (the "task" layout), the chain
of a run's iterations in either layout with the run's `iterations` parameter guarding what
lies past it, and v0's evaluation when it is due.
"""

# No `from __future__ import annotations`: KFP reads the pipelines' real annotations.
import contextlib

from kfp import dsl

from replayrl.config import KubernetesConfig
from replayrl.kfp.components import (
    compact,
    evaluate,
    evaluate_initial,
    generate,
    record_iteration,
    run_iterations,
    train,
)
from replayrl.kfp.tasks import on_accelerators, on_cpu


def iteration_pipeline(*, image: str, k8s: KubernetesConfig):
    """One iteration as a sub-pipeline, from `iteration` and `policy_version`, or with
    `iteration` 0 from the lineage's state; only when `wanted > index` (a run asking for
    fewer iterations than were unrolled starts no pod for the rest). The condition is inside:
    kfp 2.17.3 cannot compile a sub-pipeline with conditions of its own (evaluation-due) in a
    condition of the caller when its inputs come from the caller's tasks."""

    @dsl.pipeline(
        name="replayrl-iteration",
        description="generate -> compact -> train -> evaluate (when due) -> record",
    )
    def iteration(
        config: str,
        owner: str,
        iteration: int,
        policy_version: int,
        release: bool,
        wanted: int,
        index: int,
    ):
        def gpu(task, gpus):
            return on_accelerators(task, k8s, image, gpus)

        with dsl.If(wanted > index, name="iteration-wanted"):
            gen = gpu(
                generate(
                    config=config, owner=owner, iteration=iteration, policy_version=policy_version
                ),
                k8s.generate_gpus,
            )
            # The iteration and version generate started from (its own inputs, or with
            # iteration 0 the lineage's state).
            at = dict(
                iteration=gen.outputs["iteration"], policy_version=gen.outputs["policy_version"]
            )
            comp = on_cpu(compact(config=config, owner=owner, **at), k8s, image, retry=True)
            tr = gpu(
                train(
                    config=config,
                    owner=owner,
                    buffer_version=comp.outputs["buffer_version"],
                    **at,
                ),
                k8s.train_gpus,
            )
            common = dict(
                config=config,
                owner=owner,
                generated=gen.outputs["result"],
                compacted=comp.outputs["result"],
                trained=tr.outputs["result"],
                release=release,
            )
            with dsl.If(tr.outputs["eval_due"] == True, name="evaluation-due"):  # noqa: E712
                ev = gpu(
                    evaluate(
                        config=config, owner=owner, policy_version=tr.outputs["policy_version"]
                    ),
                    k8s.evaluate_gpus,
                )
                # The commit point is not retried: a retry after a committed swap would fail.
                on_cpu(
                    record_iteration(evaluated=ev.outputs["result"], **common),
                    k8s,
                    image,
                    retry=False,
                )
            with dsl.Else(name="no-evaluation"):
                on_cpu(record_iteration(evaluated="", **common), k8s, image, retry=False)

    return iteration


def task_gpus(k8s: KubernetesConfig) -> int:
    """Accelerators of a task pod: it generates, trains and evaluates."""
    return max(k8s.generate_gpus, k8s.train_gpus, k8s.evaluate_gpus)


def iterations_task(k8s: KubernetesConfig, image: str, **params):
    """One `run_iterations` pod. Retried: a retry rewinds to the task's last full checkpoint
    and redoes what follows it."""
    return on_accelerators(run_iterations(**params), k8s, image, task_gpus(k8s))


def chain(
    opened,
    *,
    after,
    iterations: int,
    wanted,
    k8s: KubernetesConfig,
    image: str,
    one,
    label: str = "",
):
    """The iterations of a run after `opened` (and the task `after`): `wanted` of them (the
    run's `iterations` parameter, 1 to `iterations`, checked by the open task), in the layout
    of `k8s`: tasks of `iterations_per_task`, or one sub-pipeline per iteration. The compiled
    maximum is unrolled, and what lies past `wanted` is skipped by conditions on it, so a
    shorter run starts no pod for the rest. Returns the last task."""
    cursor, version = opened.outputs["iteration"], opened.outputs["policy_version"]
    common = dict(config=opened.outputs["config"], owner=opened.outputs["owner"])
    if k8s.layout == "task":
        # Each task past the first sits in a condition on `wanted`, nested in the one
        # before: a task may read the outputs of one in an enclosing condition (not in a
        # sibling one). The run's last iteration bounds a task (a shorter run ends inside
        # one) and drops the lease once reached.
        prefix = label.strip().replace(" ", "-") + "-" if label.strip() else ""
        per_task = k8s.iterations_per_task
        with contextlib.ExitStack() as guards:
            for i in range(-(-iterations // per_task)):
                first = i * per_task
                if first:
                    guards.enter_context(dsl.If(wanted > first, name=f"{prefix}more-than-{first}"))
                count = min(per_task, iterations - first)
                task = iterations_task(
                    k8s,
                    image,
                    iteration=cursor,
                    count=count,
                    release=False,
                    until=opened.outputs["last_iteration"],
                    **common,
                ).set_display_name(f"{label}iterations +{first + 1}..+{first + count}")
                if i == 0:
                    task.after(after)
                cursor = task.outputs["next_iteration"]
        return task
    # One sub-pipeline per iteration, each after the one before, with its condition inside
    # (`iteration_pipeline`); past the first, an iteration starts where the lineage's state
    # says (iteration 0).
    before = after
    for i in range(iterations):
        iteration, policy_version = (cursor, version) if i == 0 else (0, 0)
        task = one(
            iteration=iteration,
            policy_version=policy_version,
            release=i == iterations - 1,  # after a shorter run, the exit task releases
            wanted=wanted,
            index=i,
            **common,
        ).set_display_name(f"{label}iteration +{i + 1}")
        task.after(before)
        before = task
    return task


def initial_evaluation_pipeline(*, image: str, k8s: KubernetesConfig):
    """v0's evaluation on an accelerator when `due`, as a sub-pipeline: the condition is on
    one of its inputs because kfp.local (2.17.3) cannot resolve a condition on a named
    output of a sibling task (it skips the branch), while one on an input works there as on
    a cluster. No pod starts when the lineage already has it."""

    @dsl.pipeline(name="replayrl-initial-evaluation")
    def initial_evaluation(config: str, owner: str, due: bool):
        with dsl.If(due == True, name="initial-evaluation-due"):  # noqa: E712
            on_accelerators(
                evaluate_initial(config=config, owner=owner), k8s, image, k8s.evaluate_gpus
            ).set_display_name("evaluate v0")

    return initial_evaluation


def evaluate_v0(initial_evaluation, opened, label: str = ""):
    return initial_evaluation(
        config=opened.outputs["config"],
        owner=opened.outputs["owner"],
        due=opened.outputs["evaluate_initial"],
    ).set_display_name(f"{label}initial evaluation")
