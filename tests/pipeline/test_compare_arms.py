"""`compare_arms`: the committed YAML parses strictly, the two arms are parallel branches
that only the comparison joins, the comparison is a CPU step; and the `compare` component,
called directly on two real tiny lineages, writes the Markdown table, the HTML plot and the
metrics the KFP UI shows."""

from __future__ import annotations

import pytest
from kfp import compiler
from kfp.dsl import HTML, Markdown, Metrics
from kfp_helpers import small
from mlflow.tracking import MlflowClient
from test_kfp_compile import COMMITTED, RETRIED, parse, tasks

from replayrl.config import KubernetesConfig
from replayrl.engine.inline import run_inline
from replayrl.engine.tracking import tracking_uri
from replayrl.kfp.components import compare
from replayrl.kfp.pipelines import COMPARE_FILE, compare_arms_pipeline

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
        "run_root",
        "replay_lineage",
        "on_policy_lineage",
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


def test_the_arms_are_parallel_branches_joined_only_by_the_comparison():
    spec, _, _ = parse(COMMITTED / COMPARE_FILE)
    dag = spec.components["comp-exit-handler-1"].dag.tasks  # all but the exit task
    opens = {n: t for n, t in dag.items() if t.task_info.name.startswith("open ")}
    assert sorted(t.task_info.name for t in opens.values()) == ["open on-policy", "open replay"]
    arms = {
        t.task_info.name.removeprefix("open "): t.inputs.parameters["arm"].runtime_value.constant
        for t in opens.values()
    }
    assert {k: v.string_value for k, v in arms.items()} == {
        "replay": "replay",
        "on-policy": "on-policy",
    }
    assert all(not t.dependent_tasks for t in opens.values())  # both start at once
    (cmp_name,) = [n for n, t in dag.items() if t.task_info.name == "compare arms"]
    waits_for = {dag[d].task_info.name for d in dag[cmp_name].dependent_tasks}
    assert {"replay iterations +1..+10", "on-policy iterations +1..+10"} <= waits_for
    # It compares the two lineages its own arms opened (their resolved configs).
    inputs = dag[cmp_name].inputs.parameters
    sources = {
        name: dag[inputs[name].task_output_parameter.producer_task].task_info.name
        for name in ("replay_config", "on_policy_config")
    }
    assert sources == {"replay_config": "open replay", "on_policy_config": "open on-policy"}


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
    body = spec.components["comp-exit-handler-1"].dag.tasks.values()
    names = sorted(t.task_info.name for t in body if "initial evaluation" not in t.task_info.name)
    assert names == sorted(
        ["compare arms", "open on-policy", "open replay"]
        + [f"{arm} {n}" for arm in ("replay", "on-policy") for n in per_arm]
    )


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
