"""`compare_arms`: the committed YAML parses strictly, the two arms are parallel branches
that only the comparison joins, the comparison is a CPU step; and the `compare` component,
called directly on two real tiny lineages, writes the Markdown table, the HTML plot and the
metrics the KFP UI shows."""

from __future__ import annotations

from pathlib import Path

import pytest
from kfp import compiler
from kfp.dsl import HTML, Markdown, Metrics
from kfp_helpers import small
from mlflow.tracking import MlflowClient
from test_kfp_compile import COMMITTED, RETRIED, parse, tasks

from replayrl import storage
from replayrl.config import KubernetesConfig
from replayrl.engine.inline import run_inline
from replayrl.engine.stores import tracking_uri
from replayrl.kfp.components import compare
from replayrl.kfp.pipelines import COMPARE_FILE, compare_arms_pipeline
from replayrl.storage import lease

pytestmark = pytest.mark.pipeline


def test_compare_arms_parses_strictly_with_the_comparison_on_cpu():
    spec, deployment, k8s = parse(COMMITTED / COMPARE_FILE)
    found = tasks(spec)
    assert {n for n, _, _ in found} == {
        "open-lineage",
        "evaluate-initial",
        "run-iterations",
        "compare",
        "release-lineage",
    }
    # both arms, 10 iterations each: one task of 10 per arm
    assert len([n for n, _, _ in found if n == "run-iterations"]) == 2
    assert set(spec.root.input_definitions.parameters) == {
        "config",
        "run_root_s3_uri",
        "iterations",
        "replay_lineage",
        "on_policy_lineage",
        "model_id",
        "dataset_id",
    }
    for name, label, task in found:
        container = deployment.executors[label].container
        assert not task.caching_options.enable_cache, name
        if name == "compare":
            assert not container.resources.accelerator.resource_type
            assert container.resources.resource_cpu_request == "1"
            assert task.retry_policy.max_retry_count == 2  # one MLflow run per KFP run id
            assert k8s[label].active_deadline_seconds > 0
        elif name in RETRIED:
            assert task.retry_policy.max_retry_count == 2, name


def names_within(spec, component: str) -> list[str]:
    """The display names of the tasks in `component`'s DAG and in the DAGs it holds (its
    conditions and sub-pipelines), outermost first."""
    out = []
    for task in spec.components[component].dag.tasks.values():
        out.append(task.task_info.name)
        inner = spec.components[task.component_ref.name]
        if inner.HasField("dag"):
            out += names_within(spec, task.component_ref.name)
    return out


def test_the_arms_are_parallel_branches_joined_only_by_the_comparison():
    spec, _, _ = parse(COMMITTED / COMPARE_FILE)
    dag = spec.components["comp-exit-handler-1"].dag.tasks  # all but the exit task
    by_name = {t.task_info.name: (n, t) for n, t in dag.items()}
    assert set(by_name) == {"replay arm", "on-policy arm", "compare arms"}
    for arm in ("replay", "on-policy"):
        _, task = by_name[f"{arm} arm"]
        assert not task.dependent_tasks  # both arms start at once
        # Each arm is a sub-pipeline: its lineage opened with the arm as a constant, then
        # its iterations.
        inner = spec.components[task.component_ref.name].dag.tasks.values()
        (opened,) = [t for t in inner if t.task_info.name == f"open {arm}"]
        assert opened.inputs.parameters["arm"].runtime_value.constant.string_value == arm
        assert f"{arm} iterations +1..+10" in names_within(spec, task.component_ref.name)
    # The comparison waits for both arms, and compares the two lineages they opened (their
    # resolved configs, the arms' outputs).
    _, comparison = by_name["compare arms"]
    inputs = comparison.inputs.parameters
    sources = {
        name: dag[inputs[name].task_output_parameter.producer_task].task_info.name
        for name in ("replay_config", "on_policy_config")
    }
    assert sources == {"replay_config": "replay arm", "on_policy_config": "on-policy arm"}


@pytest.mark.parametrize(
    "layout,per_arm",
    [
        ("task", ["iterations +1..+2"]),
        ("step", ["iteration +1", "iteration +2"]),
    ],
)
def test_iterations_set_the_length_of_each_branch(tmp_path, layout, per_arm):
    pipeline = compare_arms_pipeline(iterations=2, k8s=KubernetesConfig(layout=layout))
    compiler.Compiler().compile(pipeline, str(tmp_path / COMPARE_FILE))
    spec, _, _ = parse(tmp_path / COMPARE_FILE)
    for arm in ("replay", "on-policy"):
        names = names_within(spec, f"comp-replayrl-{arm}-arm")
        assert sorted(n for n in names if n.startswith(f"{arm} iteration")) == [
            f"{arm} {n}" for n in per_arm
        ]
        assert f"open {arm}" in names


def test_compare_component_on_two_real_lineages_writes_what_the_ui_shows(tmp_path):
    arm_cfgs = {}
    # An older replay lineage of the same config in the same experiment (an earlier run of
    # the pipeline): not this run's, so not compared (it used to count as a second seed).
    run_inline(small(tmp_path, "iterations=1", "tracking.experiment=arms", "storage.lineage=old"))
    for arm in ("replay", "on-policy"):
        arm_cfgs[arm] = small(tmp_path, "iterations=1", "tracking.experiment=arms", arm=arm)
        run_inline(arm_cfgs[arm])
    cfg = arm_cfgs["replay"]
    report = Markdown(name="report", uri=str(tmp_path / "report.md"))
    plot = HTML(name="plot", uri=str(tmp_path / "plot.html"))
    metrics = Metrics(name="metrics", uri=str(tmp_path / "metrics"))
    for _ in range(2):  # a retry of the same KFP run reuses its comparison run
        compare.python_func(
            replay_config=cfg.to_yaml(),
            on_policy_config=arm_cfgs["on-policy"].to_yaml(),
            key="kfp-run-1",
            report=report,
            plot=plot,
            metrics=metrics,
        )
    text = (tmp_path / "report.md").read_text()
    assert "| on-policy | 1 |" in text and "| replay | 1 |" in text
    # No data: image in the Markdown (the 2.15 and 2.16 UIs strip it): a link to the
    # comparison's MLflow run instead; the HTML artifact keeps the plot.
    assert "data:image" not in text and "`plot` artifact" in text
    assert "/#/experiments/" in text and "/runs/" in text
    assert "src='data:image/png;base64,iVBOR" in (tmp_path / "plot.html").read_text()
    assert 0.0 <= metrics.metadata["target_pass1"] <= 1.0
    client = MlflowClient(tracking_uri(cfg))
    exp = client.get_experiment_by_name("arms")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.kind = 'comparison'")
    assert len(runs) == 1
    assert {a.path for a in client.list_artifacts(runs[0].info.run_id)} == {
        "comparison.json",
        "comparison.md",
        "comparison.png",
    }


@pytest.mark.slow
def test_compare_arms_under_kfp_local_runs_the_asked_iterations_and_compares_its_own_two(
    tmp_path,
):
    """The pipeline as a KFP backend runs it, on this machine: compiled for at most 2
    iterations per arm in tasks of 1, run with the `iterations` parameter 1 (the second tasks'
    condition is false: they do not run), beside an older replay lineage of the same config
    in the same MLflow experiment, which the comparison leaves out."""
    from kfp import local

    from replayrl.kfp.local import local_pods

    cfg = small(tmp_path, "iterations=2", "tracking.experiment=arms")
    run_inline(small(tmp_path, "iterations=2", "tracking.experiment=arms", "storage.lineage=old"))
    k8s = local_pods(KubernetesConfig(layout="task", iterations_per_task=1))
    pipeline = compare_arms_pipeline(iterations=2, k8s=k8s)
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "kfp-local"),
        raise_on_error=True,
    )
    pipeline(config=cfg.to_yaml(), run_root_s3_uri=cfg.storage.run_root, iterations=1)

    for arm in ("replay", "on-policy"):
        paths = storage.lineage_paths(cfg.storage.run_root, f"{cfg.task.name}-{arm}-s{cfg.seed}")
        state = storage.read_state(paths)
        assert (state.next_iteration, state.policy_version) == (2, 1), arm  # one, not two
        assert lease.read(paths) is None, arm  # the run's last task dropped its lease
    client = MlflowClient(tracking_uri(cfg))
    exp = client.get_experiment_by_name("arms")
    (comparison,) = client.search_runs([exp.experiment_id], "tags.kind = 'comparison'")
    report = Path(client.download_artifacts(comparison.info.run_id, "comparison.md", tmp_path))
    text = report.read_text()
    # One seed per arm: the old replay lineage (same config, same experiment) is not counted.
    assert "| replay | 1 |" in text and "| on-policy | 1 |" in text, text
