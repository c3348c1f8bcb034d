"""Engine overhead: wall time of `replayrl run` for the same tiny iterations with the inline
engine (one process) and the kfp-local engine (kfp.local, one subprocess per task), and
the overhead kfp-local adds per iteration.

Both run the CLI in a fresh process on a fresh run root with the same config (the tiny
model without its warm start, so only the engine differs), interleaved. kfp-local runs the
"task" layout: open, then tasks of `kubernetes.iterations_per_task` iterations, each task
one process with long-lived workers. Target: at most 3 s of overhead per iteration over
inline for 20 iterations in tasks of 10 (one pod per step paid ~74 s per iteration).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import median, parse_args, report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLI = Path(sys.executable).parent / "replayrl"


def run_once(engine: str, *, iterations: int, per_task: int, quick: bool) -> tuple[float, int]:
    """Seconds of one `replayrl run`, and the kfp.local tasks it ran (0 inline)."""
    with tempfile.TemporaryDirectory(prefix=f"bench-engine-{engine}-") as tmp:
        sets = [
            "model.warm_start_max_steps=0",
            f"model.cache_dir={tmp}/cache",
            "task.num_train=256",
            "task.num_eval=32",
            "eval.num_prompts=32",
            "storage.lineage=bench",
            f"kubernetes.iterations_per_task={per_task}",
        ]
        if quick:
            sets += ["rollout.prompts_per_iteration=4", "train.batch_size=16"]
        args = [str(CLI), "run", "--config", str(REPO / "configs/tiny-cpu.yaml")]
        args += ["--iterations", str(iterations), "--engine", engine, "--run-root", f"{tmp}/runs"]
        for s in sets:
            args += ["--set", s]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env.pop("MLFLOW_TRACKING_URI", None)
        start = time.perf_counter()
        done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"replayrl run --engine {engine} failed:\n{done.stderr[-3000:]}")
        # kfp.local logs one "Executing task" line per component it runs (task folders are
        # reused across iterations, so they undercount).
        tasks = (done.stdout + done.stderr).count("Executing task")
        return seconds, tasks


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    # One round: a kfp-local run is minutes on 2 shared cores; the spread shows in *_all.
    repeats = args.repeats or 1
    iterations, per_task = (2, 1) if args.quick else (20, 10)
    inline, kfp_local, tasks = [], [], 0
    for _ in range(repeats):
        inline.append(
            run_once("inline", iterations=iterations, per_task=per_task, quick=args.quick)[0]
        )
        seconds, tasks = run_once(
            "kfp-local", iterations=iterations, per_task=per_task, quick=args.quick
        )
        kfp_local.append(seconds)
    inline_s, kfp_s = median(inline), median(kfp_local)
    figures = {
        "iterations": iterations,
        "iterations_per_task": per_task,
        "inline_wall_s": inline_s,
        "kfp_local_wall_s": kfp_s,
        "inline_wall_s_all": inline,
        "kfp_local_wall_s_all": kfp_local,
        "kfp_local_tasks": tasks,
        "per_task_overhead_s": (kfp_s - inline_s) / tasks if tasks else None,
        "per_iteration_overhead_s": (kfp_s - inline_s) / iterations,
    }
    ratios = {"kfp_local_over_inline": kfp_s / inline_s}
    targets = {"per_iteration_overhead_s": "<= 3"}
    report("engine", args=args, figures=figures, ratios=ratios, targets=targets)


if __name__ == "__main__":
    main()
