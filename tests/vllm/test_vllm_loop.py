"""The inline loop with `rollout.backend: vllm` (the CPU build, run by `make test-vllm`): one
engine serves every iteration and every evaluation of the run (the warm start's included),
taking the trainer's new weights in place after each training phase, and the behaviour
log-probs it stores are those of the policy that generated them (checked against each
checkpoint with transformers, within 1e-4 in float32). An evaluation without workers (one
pod per step) starts an engine of its own from the checkpoint and gives the same numbers.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from vllm_reference import forward_logprobs

from replayrl import storage
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import load_config
from replayrl.engine import steps
from replayrl.engine.inline import run_inline
from replayrl.policy.generation import Completion
from replayrl.policy.generation_vllm import VLLMBackend
from replayrl.policy.models import load_policy

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
LOGPROB_ATOL = 1e-4
ITERATIONS = 3


def test_one_engine_serves_every_iteration_with_weights_updated_in_place(tmp_path):
    cfg = load_config(
        PRESET,
        overrides=[
            f"storage.run_root={tmp_path / 'runs'}",
            f"model.cache_dir={tmp_path / 'cache'}",
            f"iterations={ITERATIONS}",
            "model.warm_start_max_steps=60",
            "model.warm_start_eval_every=30",
            "task.num_train=200",
            "task.num_eval=16",
            "eval.num_prompts=8",
            "eval.every=0",
            "rollout.prompts_per_iteration=4",
            "rollout.backend=vllm",
            "rollout.vllm_dtype=float32",
            "buffer.capacity=128",  # every iteration's rows stay
            "buffer.positive_bias=0.0",
            "train.batch_size=16",
            "train.steps_per_iteration=2",
            # AsymRE's advantage is nonzero even when every reward in a group is equal (a
            # barely warm-started model), and a large learning rate: each iteration's policy
            # visibly differs from the last
            "train.loss=asymre",
            "train.lr=3e-3",
            # every policy version gets a checkpoint, to check each iteration's rows against
            "train.checkpoint_every=1",
            "train.keep_checkpoints=0",
        ],
    )
    built = VLLMBackend.engines_built
    run_inline(cfg)
    assert VLLMBackend.engines_built - built == 1, "a second engine was built"

    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    # The warm start (step 0), the first and the last iteration were evaluated, on that one
    # engine: vLLM returns no distribution, so no evaluation has an entropy to log
    # (transformers logs one at every evaluation).
    state = storage.read_state(paths)
    client = MlflowClient(state.tracking_uri)
    logged = {
        key: {m.step: m.value for m in client.get_metric_history(state.mlflow_run_id, key)}
        for key in ("eval/pass1", "eval/pass_at_4", "eval/response_length", "eval/entropy")
    }
    s = cfg.train.steps_per_iteration  # MLflow steps are gradient steps: iteration t at t·S
    assert sorted(logged["eval/pass1"]) == [0, s, ITERATIONS * s]
    assert logged["eval/entropy"] == {}

    # One pod per step: evaluation starts its own engine from the weights-only copy of the
    # checkpoint (and closes it), with the same numbers as the run's engine.
    built = VLLMBackend.engines_built
    alone = steps.evaluate(cfg, paths, policy_version=ITERATIONS)
    assert VLLMBackend.engines_built - built == 1
    assert math.isnan(alone.entropy)
    last = ITERATIONS * s
    assert alone.pass1 == logged["eval/pass1"][last]
    assert alone.pass_at_k == pytest.approx(logged["eval/pass_at_4"][last], abs=1e-12)
    assert alone.response_length == pytest.approx(logged["eval/response_length"][last])

    rows = ReplayBuffer(paths.buffer).read()
    assert sorted(set(rows.column("iteration").to_pylist())) == list(range(1, ITERATIONS + 1))
    previous = None
    for t in range(1, ITERATIONS + 1):
        mine = rows.filter(rows.column("iteration").to_numpy() == t).to_pylist()
        assert {r["policy_version"] for r in mine} == {t - 1}
        # the policy that generated iteration t's rows: checkpoint v_{t-1}, in transformers
        model, _ = load_policy(Path(storage.checkpoint_files_uri(paths.checkpoint(t - 1))))
        model.eval()
        completions = [
            Completion(
                prompt_index=i,
                sample_index=0,
                prompt_token_ids=r["prompt_token_ids"],
                completion_token_ids=r["completion_token_ids"],
                logprobs=r["behavior_logprobs"],
                text=r["completion"],
                finish_reason=r["finish_reason"],
            )
            for i, r in enumerate(mine)
        ]
        want = forward_logprobs(model, completions, temperature=1.0, top_p=1.0)
        for c, ref in zip(completions, want, strict=True):
            assert c.logprobs == pytest.approx(ref, abs=LOGPROB_ATOL)
        # and not the previous policy's: the engine's weights really moved
        if previous is not None:
            stale = forward_logprobs(previous, completions, temperature=1.0, top_p=1.0)
            gap = max(
                abs(a - b)
                for c, s in zip(completions, stale, strict=True)
                for a, b in zip(c.logprobs, s, strict=True)
            )
            assert gap > 1e-3
        previous = model
