"""A GPU step on a machine without CUDA: the `evaluate` component body, run in its own
process as a pod runs it, with the `REPLAYRL_REQUIRE_GPU` its pod carries, stops before it
touches the lineage, with exactly one line on stderr that names the problem. Without the
variable (a CPU step, or kfp.local) the same body evaluates on the CPU (here, in this
process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kfp.dsl import Metrics
from kfp_helpers import PRESET

from replayrl import storage
from replayrl.config import load_config
from replayrl.kfp.components import evaluate
from replayrl.policy.gpu import REQUIRE_GPU_ENV
from replayrl.policy.models import save_policy
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer
from replayrl.storage import lease

pytestmark = pytest.mark.pipeline
SRC = Path(__file__).parents[2] / "src"

# The component body as the pod's entry point calls it (KFP's executor calls python_func).
BODY = """
import sys
from kfp.dsl import Metrics
from replayrl.kfp.components import evaluate

(result,) = evaluate.python_func(
    config=open(sys.argv[1]).read(),
    owner="guard-test",
    policy_version=0,
    metrics=Metrics(name="metrics", uri=sys.argv[2]),
)
print(result)
"""


@pytest.fixture
def lineage_with_v0(tmp_path):
    """A config file whose lineage has checkpoint v0 (a random tiny model: evaluation only
    needs weights), and the lineage's paths."""
    cfg = load_config(
        PRESET,
        overrides=[
            f"storage.run_root={tmp_path / 'runs'}",
            f"model.cache_dir={tmp_path / 'cache'}",
            "task.num_train=32",
            "task.num_eval=4",
            "eval.num_prompts=4",
            "eval.num_samples=2",
            "eval.pass_k=1",
        ],
    )
    local = tmp_path / "v0"
    save_policy(build_tiny_model(vocab_size=VOCAB_SIZE, seed=1), build_byte_tokenizer(), local)
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    storage.write_checkpoint(local, paths.checkpoint(0))
    config = tmp_path / "config.yaml"
    config.write_text(cfg.to_yaml())
    return config, paths


def run_body(tmp_path: Path, config: Path, *, gpus: str):
    env = {**os.environ, REQUIRE_GPU_ENV: gpus}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", BODY, str(config), str(tmp_path / "metrics")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable GPU")
def test_a_gpu_step_without_cuda_stops_with_one_line_and_a_cpu_step_runs(
    tmp_path, lineage_with_v0, monkeypatch
):
    config, paths = lineage_with_v0
    lineage = Path(paths.root)
    before = sorted(p.relative_to(lineage) for p in lineage.rglob("*"))

    asked = run_body(tmp_path, config, gpus="1")
    assert asked.returncode != 0
    lines = asked.stderr.strip().splitlines()
    assert len(lines) == 1, asked.stderr
    (line,) = lines
    assert line.startswith("replayrl: error: This step asked for 1 GPU but CUDA is not usable")
    assert f"torch {torch.__version__} is a CPU build" in line
    assert "driver >= 580.65.06" in line
    # It stopped first thing: no lease taken, nothing downloaded or written.
    assert sorted(p.relative_to(lineage) for p in lineage.rglob("*")) == before
    assert asked.stdout == ""

    # Without the variable the same body runs here, on the CPU, and takes the lease.
    monkeypatch.delenv(REQUIRE_GPU_ENV, raising=False)
    metrics = Metrics(name="metrics", uri=str(tmp_path / "metrics"))
    (result,) = evaluate.python_func(
        config=config.read_text(), owner="guard-test", policy_version=0, metrics=metrics
    )
    assert json.loads(result)["num_prompts"] == 4 and 0.0 <= metrics.metadata["pass1"] <= 1.0
    assert lease.read(paths).owner == "guard-test"
