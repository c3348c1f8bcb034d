"""The Kubeflow components: one thin `@dsl.component` per step of an iteration, plus
opening a lineage and recording an iteration, and for the `async_segment` pipeline beginning
a segment and its three roles (worker, trainer, evaluator; `replayrl.kfp.async_runtime`).

Each body only translates between KFP types and `replayrl.engine.steps` (through
`replayrl.kfp.runtime`): strings and numbers in, a step's result out as JSON for the next
component and as `Metrics`/`Markdown` artifacts for the KFP UI. The buffer, checkpoints and
`state.json` are never KFP artifacts: every step finds them under the run root named in
`config`. KFP copies each function's source into the pipeline YAML and runs it in the
project image, so `replayrl` is imported inside the body; the image already carries `kfp`
(`install_kfp_package=False`). Pipelines replace `base_image` with the one `--image`.

Every component takes `owner` (the KFP run id) and holds the lineage's lease before writing,
renewing it while it works; `release_lineage` is every pipeline's exit task.
Each body enters `runtime.step` or `runtime.user_errors_as_exit` before it imports the step
modules (torch, transformers): there a pod that asked for GPUs stops with one line when CUDA
cannot serve them (`replayrl.policy.gpu`), seconds after it starts.
No `from __future__ import annotations` here: KFP reads the real annotation objects.
"""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Markdown, Metrics, Output

from replayrl.kfp import DEFAULT_IMAGE

_COMPONENT = dict(base_image=DEFAULT_IMAGE, install_kfp_package=False)


@dsl.component(**_COMPONENT)
def open_lineage(
    config: str,
    arm: str,
    lineage: str,
    run_root: str,
    owner: str,
    required_iterations: int,
    max_iterations: int = 0,
    model_id: str = "",
    dataset_id: str = "",
) -> NamedTuple(
    "OpenOutputs",
    [
        ("config", str),
        ("owner", str),
        ("iteration", int),
        ("policy_version", int),
        ("remaining", int),
        ("evaluate_initial", bool),
        ("last_iteration", int),
    ],
):
    """Open or resume a lineage on a CPU pod: resolve the config with the run's parameters,
    take the lease, publish v0. Outputs the resolved config, where to continue, whether v0's
    evaluation is still to be logged (the `evaluate_initial` task, on an accelerator) and the
    run's last iteration (`required_iterations` from the next; 0 when none is required)."""
    from replayrl.engine.lineage import public_config
    from replayrl.kfp import runtime

    with runtime.user_errors_as_exit():
        cfg, iteration, version, remaining, due = runtime.open_run(
            config=config,
            arm=arm,
            lineage=lineage,
            run_root=run_root,
            owner=owner,
            required_iterations=required_iterations,
            max_iterations=max_iterations,
            model_id=model_id,
            dataset_id=dataset_id,
        )
    print(f"lineage {cfg.lineage}: next iteration {iteration}, {remaining} left")
    last = iteration + required_iterations - 1 if required_iterations > 0 else 0
    return (public_config(cfg).to_yaml(), owner, iteration, version, remaining, due, last)


@dsl.component(**_COMPONENT)
def evaluate_initial(config: str, owner: str, metrics: Output[Metrics]):
    """Evaluate v0 (the warm start, or the user's model) and log it at step 0 of the
    lineage's MLflow run, once: a retry, or a lineage already evaluated, does nothing."""
    from replayrl.kfp import runtime

    with runtime.step(config, owner) as (cfg, paths):
        result = runtime.evaluate_initial(cfg, paths)
    if result is not None:
        runtime.log_metrics(metrics, result.as_dict())


@dsl.component(**_COMPONENT)
def release_lineage(
    config: str,
    run_root: str,
    owner: str,
    arm: str,
    lineage: str,
    second_arm: str = "",
    second_lineage: str = "",
    pair: bool = False,
    model_id: str = "",
    dataset_id: str = "",
):
    """The exit task: drop the leases this run holds on its lineage (`arm`, `lineage`; with
    `pair`, also `second_arm`, `second_lineage`: compare_arms' two), whether the run
    succeeded, failed or was stopped, so the next run need not wait for them to expire. Runs
    on CPU; releases nothing another run holds. Scalar inputs only: a pipeline parameter
    inside a list input reaches the task as its unresolved placeholder text."""
    from replayrl.kfp import runtime

    arms, lineages = [arm], [lineage]
    if pair:
        arms.append(second_arm)
        lineages.append(second_lineage)
    with runtime.user_errors_as_exit():
        said = runtime.release_run(
            config=config,
            run_root=run_root,
            owner=owner,
            arms=arms,
            lineages=lineages,
            model_id=model_id,
            dataset_id=dataset_id,
        )
    print("\n".join(said))


@dsl.component(**_COMPONENT)
def generate(
    config: str, owner: str, iteration: int, policy_version: int, metrics: Output[Metrics]
) -> NamedTuple("GenerateOutputs", [("result", str), ("iteration", int), ("policy_version", int)]):
    """Policy v{policy_version} samples this iteration's rollouts; rewards and advantages
    are fixed now and the rows replace any earlier attempt's rows of this iteration.
    `iteration` 0: the lineage's next iteration and its policy version, read from its state
    (an unrolled iteration past a run's first, which cannot take them from the one before:
    see `replayrl.kfp.pipelines`). Outputs the iteration and version it generated for."""
    from dataclasses import asdict

    from replayrl.kfp import runtime

    with runtime.step(config, owner, node="generate") as (cfg, paths):
        from replayrl.engine import steps  # after the GPU check: a pod without CUDA stops sooner

        iteration, policy_version = runtime.continue_at(paths, iteration, policy_version)
        result = steps.generate(cfg, paths, iteration=iteration, policy_version=policy_version)
    runtime.log_metrics(metrics, asdict(result))
    return (runtime.to_json(result), iteration, policy_version)


@dsl.component(**_COMPONENT)
def compact(
    config: str, owner: str, iteration: int, policy_version: int, metrics: Output[Metrics]
) -> NamedTuple("CompactOutputs", [("result", str), ("buffer_version", int)]):
    """Retention (FIFO capacity, positive bias, staleness), bin-packing and vacuum; outputs
    the buffer version train pins."""
    from dataclasses import asdict

    from replayrl.kfp import runtime

    with runtime.step(config, owner, node="compact") as (cfg, paths):
        from replayrl.engine import steps  # after the GPU check: a pod without CUDA stops sooner

        result = steps.compact(
            cfg, paths, iteration=iteration, current_policy_version=policy_version
        )
    runtime.log_metrics(metrics, asdict(result))
    return (runtime.to_json(result), result.buffer_version)


@dsl.component(**_COMPONENT)
def train(
    config: str,
    owner: str,
    iteration: int,
    policy_version: int,
    buffer_version: int,
    metrics: Output[Metrics],
) -> NamedTuple(
    "TrainOutputs",
    [("result", str), ("policy_version", int), ("eval_due", bool)],
):
    """S gradient steps on rows sampled from the pinned buffer version; writes checkpoint
    v{policy_version + 1} and the usage log. `eval_due`: whether this iteration evaluates."""
    from dataclasses import asdict

    from replayrl.kfp import runtime

    with runtime.step(config, owner, node="train") as (cfg, paths):
        from replayrl.engine import steps  # after the GPU check: a pod without CUDA stops sooner

        result = steps.train(
            cfg,
            paths,
            iteration=iteration,
            policy_version=policy_version,
            buffer_version=buffer_version,
        )
        due = steps.eval_due(cfg, iteration)
    runtime.log_metrics(metrics, asdict(result))
    return (runtime.to_json(result), result.policy_version, due)


@dsl.component(**_COMPONENT)
def evaluate(config: str, owner: str, policy_version: int, metrics: Output[Metrics]) -> NamedTuple(
    "EvaluateOutputs", [("result", str)]
):
    """Held-out greedy pass@1, sampled pass@k, entropy and length of v{policy_version}."""
    from replayrl.kfp import runtime

    with runtime.step(config, owner, node="evaluate") as (cfg, paths):
        from replayrl.engine import steps  # after the GPU check: a pod without CUDA stops sooner

        result = steps.evaluate(cfg, paths, policy_version=policy_version)
    runtime.log_metrics(metrics, result.as_dict())
    return (runtime.to_json(result),)


@dsl.component(**_COMPONENT)
def record_iteration(
    config: str,
    owner: str,
    generated: str,
    compacted: str,
    trained: str,
    evaluated: str,
    release: bool,
    report: Output[Markdown],
) -> NamedTuple("RecordOutputs", [("next_iteration", int), ("policy_version", int)]):
    """Log the iteration to MLflow once and advance state.json with a compare-and-swap (the
    commit point). `evaluated` is "" when the iteration did not evaluate; `release` drops
    the lineage's lease after the run's last iteration."""
    from replayrl.kfp import runtime

    with runtime.step(config, owner, release=release) as (cfg, paths):
        state, metrics = runtime.record(
            cfg,
            paths,
            owner=owner,
            generated=generated,
            compacted=compacted,
            trained=trained,
            evaluated=evaluated,
        )
    runtime.write_markdown(
        report, runtime.report(cfg, state.next_iteration - 1, metrics, state.tracking_uri or "")
    )
    return (state.next_iteration, state.policy_version)


@dsl.component(**_COMPONENT)
def run_iterations(
    config: str,
    owner: str,
    iteration: int,
    count: int,
    release: bool,
    report: Output[Markdown],
    summary: Output[Metrics],
    until: int = 0,
) -> NamedTuple("TaskOutputs", [("next_iteration", int), ("policy_version", int)]):
    """`count` iterations from `iteration` in this pod, with one generation engine, the
    trainer and the buffer mirror kept for all of them; a full checkpoint every
    `train.checkpoint_every` iterations and at the end; never past iteration `until` (> 0:
    the run's last). The lineage's lease is dropped after the run's last iteration, and with
    `release` after this task. `summary`: the lineage so far (final and best pass@1,
    generated tokens, seconds, μ), which KFP's compare-runs view shows run beside run."""
    from replayrl.kfp import runtime

    with runtime.user_errors_as_exit():
        cfg = runtime.resolve(config)
        state, metrics = runtime.run_task(
            config=config,
            owner=owner,
            iteration=iteration,
            count=count,
            release=release,
            until=until,
        )
        numbers = runtime.run_summary(state, metrics)
    runtime.write_markdown(
        report, runtime.report(cfg, state.next_iteration - 1, metrics, state.tracking_uri or "")
    )
    runtime.log_metrics(summary, numbers)
    return (state.next_iteration, state.policy_version)


@dsl.component(**_COMPONENT)
def compare(
    replay_config: str,
    on_policy_config: str,
    key: str,
    report: Output[Markdown],
    plot: Output[HTML],
    metrics: Output[Metrics],
):
    """Replay vs on-policy over the two lineages this run opened (their resolved configs,
    from the open tasks), not every lineage of the MLflow experiment: the table and plot for
    the KFP UI, the numbers as metrics, the files logged to a comparison run in MLflow (one
    per `key`, the KFP run id, so a retry reuses it)."""
    import tempfile

    from replayrl.engine.stores import tracking_uri
    from replayrl.errors import ReplayRLError
    from replayrl.experiments.compare import headline_metrics, run_compare, ui_reports
    from replayrl.kfp import runtime

    with runtime.user_errors_as_exit():
        cfg = runtime.resolve(replay_config)
        other = runtime.resolve(on_policy_config)
        if (tracking_uri(other), other.tracking.experiment) != (
            tracking_uri(cfg),
            cfg.tracking.experiment,
        ):
            raise ReplayRLError(
                "The two arms were tracked in different MLflow experiments; one comparison "
                "needs both in one (tracking.uri and tracking.experiment)."
            )
        with tempfile.TemporaryDirectory(prefix="replayrl-compare-") as out:
            done = run_compare(
                tracking_uri=tracking_uri(cfg),
                experiment=cfg.tracking.experiment,
                out_dir=out,
                key=key,
                lineages=[cfg.lineage, other.lineage],
            )
            markdown, page = ui_reports(done, tracking_uri=tracking_uri(cfg))
    runtime.write_markdown(report, markdown)
    runtime.write_markdown(plot, page)
    runtime.log_metrics(metrics, headline_metrics(done.result))


# ---------------------------------------------------------------- the async_segment pipeline


@dsl.component(**_COMPONENT)
def begin_async_segment(
    config: str,
    arm: str,
    lineage: str,
    run_root: str,
    owner: str,
    workers: int,
    model_id: str = "",
    dataset_id: str = "",
    trainer_nodes: int = 1,
) -> NamedTuple("BeginOutputs", [("config", str), ("owner", str), ("segment_id", str)]):
    """Begin one segment of an asynchronous lineage on a CPU pod: resolve the config (it
    must set asynchronous.enabled and `workers` workers), take the lease, open or resume the
    lineage, publish v0 when nothing is published, write the segment. Refuses to run under
    kfp.local, which runs tasks one after another (the roles must run side by side)."""
    from replayrl.engine.lineage import public_config
    from replayrl.kfp import async_runtime, runtime

    with runtime.user_errors_as_exit():
        async_runtime.require_kfp_pod()
        cfg, segment_id = async_runtime.begin_async_segment(
            config=config,
            arm=arm,
            lineage=lineage,
            run_root=run_root,
            owner=owner,
            workers=workers,
            model_id=model_id,
            dataset_id=dataset_id,
            trainer_nodes=trainer_nodes,
        )
    print(f"lineage {cfg.lineage}: segment {segment_id}")
    return (public_config(cfg).to_yaml(), owner, segment_id)


@dsl.component(**_COMPONENT)
def async_worker(config: str, owner: str, segment_id: str, worker: int, metrics: Output[Metrics]):
    """Generation worker `worker`: batches of R rows with the newest published weights,
    appended to the buffer, until the segment is done (paused while too many rows wait
    unused)."""
    from replayrl.kfp import async_runtime, runtime

    with runtime.user_errors_as_exit():
        numbers = async_runtime.async_role(
            config=config, owner=owner, role="worker", index=worker, segment_id=segment_id
        )
    runtime.log_metrics(metrics, numbers)


@dsl.component(**_COMPONENT)
def async_trainer(config: str, owner: str, segment_id: str, metrics: Output[Metrics]):
    """The trainer: gradient steps on buffer rows to the segment's end step (or deadline),
    publishing weights every asynchronous.publish_every steps; the lineage's only MLflow
    writer. Marks the segment done, which stops the workers and the evaluator."""
    from replayrl.kfp import async_runtime, runtime

    with runtime.user_errors_as_exit():
        numbers = async_runtime.async_role(
            config=config, owner=owner, role="trainer", segment_id=segment_id
        )
    runtime.log_metrics(metrics, numbers)


@dsl.component(**_COMPONENT)
def async_evaluator(config: str, owner: str, segment_id: str, metrics: Output[Metrics]):
    """The evaluator: held-out evaluation of each published version that is due (v0, every
    eval.every x S gradient steps, the lineage's last), until the segment is done."""
    from replayrl.kfp import async_runtime, runtime

    with runtime.user_errors_as_exit():
        numbers = async_runtime.async_role(
            config=config, owner=owner, role="evaluator", segment_id=segment_id
        )
    runtime.log_metrics(metrics, numbers)
