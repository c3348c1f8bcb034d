"""Two `replay_iteration` runs started at once on one lineage, in two processes under
kfp.local: exactly one advances the lineage; the other stops at its first step with a
message naming the run that holds the lineage; no row and no metric is duplicated."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from kfp_helpers import small
from mlflow.tracking import MlflowClient

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.engine.inline import run_inline
from replayrl.storage import lease

pytestmark = pytest.mark.pipeline

RUN_ONE_ITERATION = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from replayrl.config import load_config
    from replayrl.errors import ReplayRLError
    from replayrl.kfp.local import run_kfp_local

    cfg = load_config(sys.argv[1])
    try:
        run_kfp_local(cfg, pipeline="iteration", outputs_dir=Path(sys.argv[2]), quiet=True)
    except ReplayRLError as e:
        print(f"replayrl: error: {e}", file=sys.stderr)
        sys.exit(2)
    """
)


@pytest.mark.slow
def test_two_replay_iteration_runs_at_once_exactly_one_advances(tmp_path):
    # Iteration 1 inline; the two runs race for iteration 2 (a task of one iteration, which
    # does not evaluate: eval.every=0, iterations=3).
    task = "kubernetes.iterations_per_task=1"
    run_inline(small(tmp_path, "iterations=1", "eval.every=0", task))
    cfg = small(tmp_path, "iterations=3", "eval.every=0", task)
    config = tmp_path / "config.yaml"
    config.write_text(cfg.to_yaml())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RUN_ONE_ITERATION, str(config), str(tmp_path / f"kfp-{i}")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [(p.wait(timeout=900), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "is being advanced by run" in loser, loser
    assert "stops before writing anything" in loser

    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    state = storage.read_state(paths)
    assert (state.next_iteration, state.policy_version) == (3, 2)
    rows = ReplayBuffer(paths.buffer).read()
    ids = rows.column("rollout_id").to_pylist()
    assert len(ids) == len(set(ids))
    assert rows.column("iteration").to_pylist().count(2) == cfg.rollouts_per_iteration
    usage = ReplayBuffer(paths.buffer).read_usage()
    per_iteration = usage.column("iteration").to_pylist()
    assert per_iteration.count(2) == cfg.train.steps_per_iteration * cfg.train.batch_size

    client = MlflowClient(state.tracking_uri)
    marker = client.get_metric_history(state.mlflow_run_id, "iteration")
    s = cfg.train.steps_per_iteration  # MLflow steps are gradient steps: iteration t at t·S
    assert sorted(m.step for m in marker) == [0, s, 2 * s]
    losses = client.get_metric_history(state.mlflow_run_id, "train/loss")
    assert sorted(m.step for m in losses) == [s, 2 * s]
    assert not [
        m for m in client.get_metric_history(state.mlflow_run_id, "eval/pass1") if m.step == 2 * s
    ]
    assert lease.read(storage.lineage_paths(str(tmp_path / "runs"), cfg.lineage)) is None
