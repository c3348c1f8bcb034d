"""The ONE tiny configuration of the test suite, and its warm start, built once per run.

Every tier's lineages (integration, pipeline, the fault trials) start from the same tiny model
and the same warm start: a byte-level Qwen2 of 32 hidden units and one layer, warm-started for
100 supervised steps on 200 two-digit sums (enough that some rollouts earn a reward, so
gradient steps move the policy). Everything the warm start reads (its cache key: the model's
shape, the warm-start knobs, the task and its sizes, the seed, max_new_tokens, the rollout
batch size) is fixed HERE, so the warm start is computed once per pytest run and shared by
every test, every xdist worker and every subprocess the tests start. A test varies the loop
(iterations, buffer, batch, evaluation, run root) with `extra` overrides, never those keys.

The `tiny` fixture (tests/conftest.py) is this module; the per-tier helpers (kfp_helpers,
fault_helpers, the `small()` of a few test files) call `overrides()` here.

The cache lives in one folder per pytest run, shared by its xdist workers (the controller
names it in `REPLAYRL_TEST_CACHE` before they start); the library's build holds a file lock,
so two workers never write the same warm start.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

PRESET = Path(__file__).parents[1] / "configs" / "tiny-cpu.yaml"
CACHE_ENV = "REPLAYRL_TEST_CACHE"

# What the warm start reads: the same for every test, so it is built once.
MODEL = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=64",
    "model.warm_start_max_steps=100",
    "model.warm_start_eval_every=50",
]
TASK = ["task.num_train=200", "task.num_eval=16"]
# The small loop most tests run (each may override any of it): 4 prompts x 8 samples per
# iteration, a 64-row buffer, 4 gradient steps of 16 rows, 16 held-out prompts evaluated
# every iteration with 2 samples each.
LOOP = [
    "iterations=2",
    "rollout.prompts_per_iteration=4",
    "buffer.capacity=64",
    "train.batch_size=16",
    "train.steps_per_iteration=4",
    "eval.num_prompts=16",
    "eval.every=1",
    "eval.num_samples=2",
    "eval.pass_k=2",
]


def cache_dir() -> Path:
    """This run's shared model cache (see the module docstring)."""
    path = os.environ.get(CACHE_ENV)
    if not path:  # imported outside pytest (a child started by a test sets its overrides)
        path = tempfile.mkdtemp(prefix="replayrl-test-cache-")
        os.environ[CACHE_ENV] = path
    return Path(path)


def overrides(run_root, *extra: str) -> list[str]:
    """The tiny config's overrides of configs/tiny-cpu.yaml for a lineage under `run_root`
    (a path or a URI), then `extra` (later ones win). Builds the warm start first."""
    ensure_warm_start()
    return [
        f"storage.run_root={run_root}",
        f"model.cache_dir={cache_dir()}",
        *MODEL,
        *TASK,
        *LOOP,
        *extra,
    ]


def config(run_root, *extra: str, arm: str | None = None):
    from replayrl.config import load_config

    return load_config(PRESET, overrides=overrides(run_root, *extra), arm=arm)


def locked_initial_policy(cfg) -> Path:
    """`initial_policy_dir(cfg)`: the first caller builds the warm start, the others (other
    xdist workers) wait for it and reuse it (the library holds a lock on the cache entry
    while it builds, `replayrl.policy.models.built_once`)."""
    from replayrl.engine.steps import task_splits
    from replayrl.policy.models import initial_policy_dir

    return initial_policy_dir(cfg, task_splits(cfg))


_built: Path | None = None


def ensure_warm_start() -> Path:
    """The tiny config's warm start, built on the first call of this process (or found in
    the run's cache, where another worker built it)."""
    global _built
    if _built is None:
        from replayrl.config import load_config

        # A run root of its own: task_splits checks the lineage's recorded task data, and the
        # preset's `runs` is the clone's own folder, where `make run` leaves a lineage.
        cfg = load_config(
            PRESET,
            overrides=[
                f"model.cache_dir={cache_dir()}",
                f"storage.run_root={cache_dir() / 'runs'}",
                *MODEL,
                *TASK,
                *LOOP,
            ],
        )
        _built = locked_initial_policy(cfg)
    return _built
