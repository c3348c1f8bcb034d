"""The components called directly (`component.python_func`, in this process), the
lineage lease, and opening a lineage the way the pipelines do: what they write and return."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from kfp.dsl import Markdown, Metrics
from kfp_helpers import small

from replayrl import lease, storage
from replayrl.buffer import ReplayBuffer
from replayrl.errors import ReplayRLError
from replayrl.kfp import runtime
from replayrl.kfp.components import (
    compact,
    evaluate,
    generate,
    open_lineage,
    record_iteration,
    train,
)

pytestmark = pytest.mark.pipeline


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
    config, owner, t, v, remaining = opened
    assert (owner, t, v, remaining) == ("run-a", 1, 0, 1)
    assert "lineage: via-components" in config
    m = {name: Metrics(name=name, uri=str(tmp_path / name)) for name in ("g", "c", "t", "e")}
    (generated,) = generate.python_func(
        config=config, owner=owner, iteration=t, policy_version=v, metrics=m["g"]
    )
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
    assert (new_version, due) == (1, True) and json.loads(trained)["num_params"] > 100_000
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
    paths = storage.lineage_paths(cfg.storage.run_root, "via-components")
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
    _, t, _, remaining = runtime.open_run(
        config=cfg.to_yaml(), arm="", lineage="", run_root="", owner="b", required_iterations=0
    )
    assert (t, remaining) == (2, 0)
    assert lease.read(paths) is None
    with pytest.raises(ReplayRLError, match="has 0 iteration\\(s\\) left before iterations=1"):
        runtime.open_run(
            config=cfg.to_yaml(), arm="", lineage="", run_root="", owner="c", required_iterations=3
        )
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
