"""The components called directly (`component.python_func`, in this process), the
lineage lease, and opening a lineage the way the pipelines do: what they write and return."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from kfp.dsl import Markdown, Metrics
from kfp_helpers import small

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.engine.tracking import Tracker
from replayrl.errors import ReplayRLError
from replayrl.kfp import runtime
from replayrl.kfp.components import (
    compact,
    evaluate,
    evaluate_initial,
    generate,
    open_lineage,
    record_iteration,
    release_lineage,
    run_iterations,
    train,
)
from replayrl.storage import lease

pytestmark = pytest.mark.pipeline


def open_as(cfg, owner: str, required: int, **kwargs):
    """`runtime.open_run` of `cfg` as run `owner`, asking for `required` iterations, with no
    run parameter set (the config's arm, lineage and run root)."""
    return runtime.open_run(
        config=cfg.to_yaml(),
        arm="",
        lineage="",
        run_root="",
        owner=owner,
        required_iterations=required,
        **kwargs,
    )


def test_one_iteration_through_the_components_commits_it(tmp_path):
    cfg = small(tmp_path, "iterations=1")
    opened = open_lineage.python_func(
        config=cfg.to_yaml(),
        arm="",
        lineage="via-components",
        run_root="",
        owner="run-a",
        required_iterations=1,
    )
    config, owner, t, v, remaining, due, last = opened
    assert (owner, t, v, remaining, due, last) == ("run-a", 1, 0, 1, True, 1)
    assert "lineage: via-components" in config
    m = {name: Metrics(name=name, uri=str(tmp_path / name)) for name in "icgte"}
    # Opening (a CPU pod) left v0's evaluation to its own task, which logs it at step 0 once.
    paths = storage.lineage_paths(cfg.storage.run_root, "via-components")
    state = storage.read_state(paths)
    tracker = Tracker(state.tracking_uri, cfg.tracking.experiment)
    assert tracker.logged_steps(state.mlflow_run_id) == set()
    evaluate_initial.python_func(config=config, owner=owner, metrics=m["i"])
    (initial,) = tracker.client.get_metric_history(state.mlflow_run_id, "eval/pass1")
    assert initial.step == 0 and initial.value == m["i"].metadata["pass1"]
    evaluate_initial.python_func(config=config, owner=owner, metrics=m["c"])  # a retry
    assert len(tracker.client.get_metric_history(state.mlflow_run_id, "eval/pass1")) == 1
    assert m["c"].metadata == {}
    # Iteration 0: where the lineage's state says (an unrolled iteration past a run's first).
    generated, at, version = generate.python_func(
        config=config, owner=owner, iteration=0, policy_version=0, metrics=m["g"]
    )
    assert (at, version) == (t, v) == (1, 0)
    assert json.loads(generated)["iteration"] == 1
    assert json.loads(generated)["rows"] == cfg.rollouts_per_iteration == m["g"].metadata["rows"]
    compacted, buffer_version = compact.python_func(
        config=config, owner=owner, iteration=t, policy_version=v, metrics=m["c"]
    )
    trained, new_version, due = train.python_func(
        config=config,
        owner=owner,
        iteration=t,
        policy_version=v,
        buffer_version=buffer_version,
        metrics=m["t"],
    )
    # the tiny config's model: ~18k parameters
    assert (new_version, due) == (1, True) and json.loads(trained)["num_params"] > 10_000
    (evaluated,) = evaluate.python_func(
        config=config, owner=owner, policy_version=new_version, metrics=m["e"]
    )
    assert 0.0 <= m["e"].metadata["pass1"] <= 1.0

    # Another run cannot write while run-a holds the lease: it stops before writing.
    with pytest.raises(SystemExit, match="is being advanced by run 'run-a'"):
        generate.python_func(
            config=config, owner="run-b", iteration=t, policy_version=v, metrics=m["g"]
        )

    report = Markdown(name="report", uri=str(tmp_path / "report.md"))
    next_iteration, policy_version = record_iteration.python_func(
        config=config,
        owner=owner,
        generated=generated,
        compacted=compacted,
        trained=trained,
        evaluated=evaluated,
        release=True,
        report=report,
    )
    assert (next_iteration, policy_version) == (2, 1)
    state = storage.read_state(paths)
    assert (state.next_iteration, state.policy_version) == (2, 1)
    assert ReplayBuffer(paths.buffer).read().num_rows == cfg.rollouts_per_iteration
    assert "via-components: iteration 1 of 1" in (tmp_path / "report.md").read_text()
    assert lease.read(paths) is None  # released with the last record

    # Recording the same iteration again (a second run's late record) is refused.
    with pytest.raises(SystemExit, match="another run advanced the lineage"):
        record_iteration.python_func(
            config=config,
            owner="run-c",
            generated=generated,
            compacted=compacted,
            trained=trained,
            evaluated=evaluated,
            release=True,
            report=report,
        )
    assert storage.read_state(paths).next_iteration == 2


def test_a_finished_lineage_has_nothing_left_and_keeps_no_lease(tmp_path):
    cfg = small(tmp_path, "iterations=1")
    open_lineage.python_func(
        config=cfg.to_yaml(), arm="", lineage="", run_root="", owner="a", required_iterations=0
    )
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    state = storage.read_state(paths)
    # As if run "a" ran iteration 1 (ending in its full checkpoint) and finished: the
    # lineage has reached its `iterations`.
    done = replace(
        state,
        next_iteration=2,
        policy_version=1,
        checkpoint={**state.checkpoint, "iteration": 1, "policy_version": 1},
    )
    storage.advance_state(paths, done, expected_next_iteration=1)
    assert lease.release(paths, owner="a")
    _, t, _, remaining, _ = open_as(cfg, "b", 0)
    assert (t, remaining) == (2, 0)
    assert lease.read(paths) is None
    with pytest.raises(ReplayRLError, match="has 0 iteration\\(s\\) left before iterations=1"):
        open_as(cfg, "c", 3)
    assert lease.read(paths) is None


def test_lease_excludes_other_owners_until_it_expires(tmp_path):
    paths = storage.lineage_paths(str(tmp_path / "runs"), "leased")
    first = lease.hold(paths, owner="run-a", ttl_s=100, now=1000.0)
    again = lease.hold(paths, owner="run-a", ttl_s=100, now=1050.0)
    assert (again.acquired_at, again.expires_at) == (first.acquired_at, 1150.0)
    with pytest.raises(ReplayRLError, match="being advanced by run 'run-a'"):
        lease.hold(paths, owner="run-b", ttl_s=100, now=1100.0)
    assert lease.read(paths).owner == "run-a"
    taken = lease.hold(paths, owner="run-b", ttl_s=100, now=1200.0)  # run-a's expired
    assert taken.owner == "run-b"
    assert not lease.release(paths, owner="run-a")
    assert lease.release(paths, owner="run-b") and lease.read(paths) is None


def test_the_exit_task_releases_only_this_runs_leases(tmp_path, capsys):
    cfg = small(tmp_path, "iterations=1")
    open_lineage.python_func(
        config=cfg.to_yaml(), arm="", lineage="", run_root="", owner="a", required_iterations=1
    )
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    other = storage.lineage_paths(cfg.storage.run_root, "never-opened")
    both = dict(
        config=cfg.to_yaml(),
        run_root="",
        arm="",
        lineage="",
        second_arm="",
        second_lineage="never-opened",
        pair=True,
    )
    release_lineage.python_func(owner="b", **both)  # another run's exit task: not its lease
    assert lease.read(paths).owner == "a"
    release_lineage.python_func(owner="a", **both)
    assert lease.read(paths) is None
    assert not storage.exists(other.root), "releasing writes nothing where no lease was"
    said = capsys.readouterr().out
    assert f"released the lease of {paths.root}" in said and "no lease of run b" in said
    # A config that never resolved opened nothing: nothing to release, and no failure.
    release_lineage.python_func(
        config="buffer: {capacty: 3}", run_root="", owner="a", arm="replay", lineage=""
    )
    assert "nothing to release for arm 'replay'" in capsys.readouterr().out


def test_a_task_of_iterations_outputs_the_lineage_so_far_as_metrics(tmp_path):
    """What KFP's compare-runs view shows beside each run: final and best pass@1 over the
    lineage's evaluations (its MLflow history, v0 included), generated tokens, seconds, μ."""
    cfg = small(tmp_path, "iterations=2", "eval.every=1")
    config, owner, t, _, _, _, _ = open_lineage.python_func(
        config=cfg.to_yaml(),
        arm="",
        lineage="summary",
        run_root="",
        owner="run-s",
        required_iterations=2,
    )
    evaluate_initial.python_func(
        config=config, owner=owner, metrics=Metrics(name="i", uri=str(tmp_path / "i"))
    )
    summary = Metrics(name="summary", uri=str(tmp_path / "summary"))
    report = Markdown(name="report", uri=str(tmp_path / "report.md"))
    run_iterations.python_func(
        config=config,
        owner=owner,
        iteration=t,
        count=2,
        release=True,
        report=report,
        summary=summary,
    )
    got = summary.metadata
    state = storage.read_state(storage.lineage_paths(cfg.storage.run_root, "summary"))
    tracker = Tracker(state.tracking_uri, cfg.tracking.experiment)
    history = [
        m.value for m in tracker.client.get_metric_history(state.mlflow_run_id, "eval/pass1")
    ]
    assert len(history) == 3  # v0, v1, v2
    assert got["best_pass1"] == max(history) and got["final_pass1"] == history[-1]
    assert got["iterations_done"] == 2.0
    assert got["generated_tokens"] > 0 and got["seconds"] > 0 and got["mu"] > 0


def test_a_pod_refuses_a_run_root_off_s3_before_any_work(tmp_path, monkeypatch):
    cfg = small(tmp_path, "iterations=1")
    root = tmp_path / "runs"
    assert not root.exists()
    monkeypatch.setenv(runtime.POD_ENV, "replay-loop-x7k2p-open-lineage")
    # a pod's check also sets the config's MLflow URI in the (here: this test's) environment
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(SystemExit) as e:
        open_lineage.python_func(
            config=cfg.to_yaml(), arm="", lineage="", run_root="", owner="a", required_iterations=1
        )
    message = str(e.value)
    assert message.startswith("replayrl: error: The run root") and "\n" not in message
    assert "inside this pod (replay-loop-x7k2p-open-lineage)" in message and "s3://" in message
    report = Markdown(name="report", uri=str(tmp_path / "report.md"))
    with pytest.raises(SystemExit, match="is a path inside this pod"):
        run_iterations.python_func(
            config=cfg.to_yaml(),
            owner="a",
            iteration=1,
            count=1,
            release=True,
            report=report,
            summary=Metrics(name="s", uri=str(tmp_path / "s")),
        )
    m = Metrics(name="g", uri=str(tmp_path / "g"))
    with pytest.raises(SystemExit, match="is a path inside this pod"):
        generate.python_func(
            config=cfg.to_yaml(), owner="a", iteration=1, policy_version=0, metrics=m
        )
    assert not root.exists(), "nothing was written"
    # On S3 the same config passes the check.
    on_s3 = replace(cfg, storage=replace(cfg.storage, run_root="s3://bucket/runs"))
    runtime.check_run_root(on_s3)


def test_config_parameter_takes_text_or_a_uri_and_applies_run_parameters(tmp_path):
    cfg = small(tmp_path)
    stored = tmp_path / "stored.yaml"
    stored.write_text(cfg.to_yaml())
    from_uri = runtime.resolve(f"file://{stored}", arm="on-policy", lineage="x", run_root="rel")
    assert from_uri.arm == "on-policy" and from_uri.lineage == "x"
    assert from_uri.buffer.capacity == cfg.train.steps_per_iteration * cfg.train.batch_size
    assert from_uri.storage.run_root == storage.normalize_root("rel")
    from_text = runtime.resolve(cfg.to_yaml())
    assert from_text.config_hash() == cfg.config_hash()
    with pytest.raises(ReplayRLError, match="Cannot read the config"):
        runtime.resolve(str(tmp_path / "missing.yaml"))
    with pytest.raises(ReplayRLError, match="Did you mean 'capacity'"):
        runtime.resolve("buffer: {capacty: 3}")


def test_run_parameters_override_the_config_and_iterations_stay_within_the_compiled_most(
    tmp_path,
):
    cfg = small(tmp_path, "iterations=3")
    with pytest.raises(ReplayRLError, match="iterations parameter is 4; this pipeline was"):
        open_as(cfg, "a", 4, max_iterations=3)
    with pytest.raises(ReplayRLError, match="iterations parameter is 0"):
        open_as(cfg, "a", 0, max_iterations=3)
    assert not Path(cfg.storage.run_root).exists()  # refused before anything was written
    with pytest.raises(ReplayRLError, match="Unknown arm 'replay_plain'. Choose one of"):
        runtime.resolve(cfg.to_yaml(), arm="replay_plain")
    # model_id and dataset_id replace the config's model and prompts (and their revisions).
    tree = yaml.safe_load(cfg.to_yaml())
    tree["model"]["revision"] = "abc123"  # a commit of the config's model, not of model_id's
    tree["model"]["source"] = "Qwen/Qwen3-0.6B"
    tree.pop("kubernetes", None)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    moved = runtime.resolve(
        yaml.safe_dump(tree),
        model_id="Qwen/Qwen2.5-0.5B-Instruct",
        dataset_id=str(data),
        run_root=str(tmp_path / "elsewhere"),
        lineage="named",
    )
    assert moved.model.source == "Qwen/Qwen2.5-0.5B-Instruct" and moved.model.revision is None
    assert moved.task.path == str(data)
    assert moved.lineage == "named" and moved.storage.run_root == str(tmp_path / "elsewhere")
    kept = runtime.resolve(yaml.safe_dump(tree))
    assert kept.model.source == "Qwen/Qwen3-0.6B" and kept.model.revision == "abc123"
