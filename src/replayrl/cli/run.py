"""`replayrl run`: run (or resume) a lineage with the inline, kfp-local or async engine, and
print its summary with the links to MLflow's UI.

SIGTERM or Ctrl-C stops the inline and async engines at their next safe point
(`replayrl.engine.stopping`): the lease is released and the command exits with 128 + the
signal's number after one line, `replayrl: stopped by SIGTERM before iteration 3; re-run the
same command to resume`. A second signal stops at once."""

from __future__ import annotations

import argparse
import os
import sys

from replayrl.cli.args import lineage_name, number, one_line_errors
from replayrl.errors import ReplayRLError


def _run(args: argparse.Namespace) -> int:
    from replayrl.config import load_config

    overrides = list(args.set or [])
    if args.run_root:
        overrides.append(f"storage.run_root={args.run_root}")
    if args.lineage:
        overrides.append(f"storage.lineage={args.lineage}")
    if args.iterations is not None:
        overrides.append(f"iterations={args.iterations}")
    if args.engine not in ENGINES:
        raise ReplayRLError(
            f"Engine '{args.engine}' is not available; use --engine {', '.join(ENGINES)}."
        )
    if args.engine == "async":
        overrides.append("asynchronous.enabled=true")
    cfg = load_config(args.config, overrides=overrides, arm=args.arm)
    if cfg.asynchronous.enabled and args.engine != "async":
        raise ReplayRLError(
            "The config sets asynchronous.enabled: true; run it with --engine async."
        )
    if args.accept_changed_task_data:
        from replayrl.engine.inputs import accept_task_inputs

        if accept_task_inputs(cfg):
            print(
                f"replayrl: lineage '{cfg.lineage}' goes on with the task data as it is now "
                f"(the change is recorded in its inputs/task.json)",
                file=sys.stderr,
            )
    from replayrl.config import default_cache_dir
    from replayrl.policy.gpu import cuda_env, warn_if_old_driver

    # Before CUDA starts: compile caches beside the run's cache; expandable segments where
    # no sleep-mode vLLM engine shares the process (policy.gpu.cuda_env).
    cuda_env(
        os.environ, cache_dir=default_cache_dir(cfg), vllm_sleep_mode=cfg.rollout.backend == "vllm"
    )
    warn_if_old_driver()
    print(
        f"replayrl: lineage '{cfg.lineage}' ({cfg.arm}), R={cfg.rollouts_per_iteration} rollouts/iter, "
        f"N={cfg.buffer.capacity}, B={cfg.train.batch_size}×S={cfg.train.steps_per_iteration}, "
        f"replay ratio y={cfg.replay_ratio:g}, {cfg.iterations} iterations",
        file=sys.stderr,
    )
    if args.engine == "kfp-local":
        _print_summary(_run_kfp_local(cfg))
        return 0

    def work(signals) -> int:
        if args.engine == "async":
            _print_async_summary(_run_async(cfg, signals))
        else:
            from replayrl.engine.inline import run_inline

            _print_summary(run_inline(cfg, signals=signals))
        return 0

    return until_stopped(work)


def until_stopped(work) -> int:
    """`work(signals)` under one `StopSignals` for the whole command: the first SIGTERM or
    SIGINT stops the lineage that is running at its next safe point (its lease released),
    and the command ends with one line and exit 128 + the signal (143 for SIGTERM); the
    same command then resumes."""
    from replayrl.engine.stopping import Stopped, StopSignals

    with StopSignals() as signals:
        try:
            return work(signals)
        except Stopped as e:
            print(f"replayrl: {e}", file=sys.stderr)
            return 128 + e.signum


def _run_async(cfg, signals):
    from replayrl.engine.asynchronous.supervisor import run_async

    a = cfg.asynchronous
    print(
        f"replayrl: asynchronous split, W={a.workers} worker(s), T={a.trainers} trainer, "
        f"weights published every {a.publish_every} gradient steps, "
        f"{cfg.total_gradient_steps} gradient steps in all",
        file=sys.stderr,
    )
    return run_async(cfg, signals=signals)


ENGINES = ("inline", "kfp-local", "async")


def _print_async_summary(summary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{summary.lineage} ({summary.arm}, asynchronous)")
    table.add_column("gradient step", justify="right")
    table.add_column("pass@1", justify="right")
    table.add_column("wall s at publication", justify="right")
    for step, pass1, seconds in summary.evaluations:
        table.add_row(str(step), f"{pass1:.3f}", f"{seconds:.1f}")
    console = Console()
    console.print(table)
    restarts = ", ".join(f"{k} x{v}" for k, v in summary.restarts.items()) or "none"
    console.print(
        f"segment: gradient steps {summary.first_step} -> {summary.final_step}; "
        f"roles restarted: {restarts}\nrun root: {summary.run_root}\n"
        f"MLflow: {summary.tracking_uri} (run {summary.mlflow_run_id})\n"
        f"wall time: {summary.wall_seconds:.1f} s"
    )
    print_ui_links(summary.tracking_uri, run_id=summary.mlflow_run_id)


def _run_kfp_local(cfg):
    """`replay_loop` under kfp.local: one subprocess per step, like one pod per step."""
    from replayrl.kfp.local import outputs_dir_for, run_kfp_local

    print(f"replayrl: kfp.local task outputs under {outputs_dir_for(cfg)}", file=sys.stderr)
    return run_kfp_local(cfg)


def _print_summary(summary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{summary.lineage} ({summary.arm})")
    table.add_column("iteration", justify="right")
    table.add_column("pass@1", justify="right")
    table.add_column("cum. generated tokens", justify="right")
    table.add_column("cum. gen+train s", justify="right")
    if summary.initial_pass1 is not None:
        table.add_row("0 (warm start)", f"{summary.initial_pass1:.3f}", "0", "0.0")
    for r in summary.rows:
        table.add_row(
            str(r.iteration),
            f"{r.pass1:.3f}",
            f"{int(r.cumulative_generated_tokens):,}",
            f"{r.cumulative_seconds:.1f}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"run root: {summary.run_root}\nMLflow: {summary.tracking_uri} (run {summary.mlflow_run_id})\n"
        f"wall time: {summary.wall_seconds:.1f} s"
    )
    # Plain print: rich would fold a long link across lines.
    print_ui_links(summary.tracking_uri, run_id=summary.mlflow_run_id)


def print_ui_links(uri: str, *, run_id: str, print=print) -> None:
    """How to open the runs in MLflow's UI: the command for a local store, then the links."""
    from replayrl.engine.tracking import experiment_of_run, ui_link

    if not uri.startswith(("http://", "https://")):
        print(f"open the UI: mlflow ui --backend-store-uri {uri}")
    experiment_id = experiment_of_run(uri, run_id)
    print(f"runs: {ui_link(uri, experiment_id)}")
    print(f"this run: {ui_link(uri, experiment_id, run_id)}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`replayrl run`."""
    run = one_line_errors(sub.add_parser("run", help="run (or resume) a lineage"))
    run.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny-cpu.yaml")
    run.add_argument(
        "--arm",
        choices=None,
        default=None,
        help="replay | on-policy | replay-plain (default: the config's)",
    )
    run.add_argument("--run-root", help="file path or s3://bucket/prefix (default: the config's)")
    run.add_argument(
        "--lineage", type=lineage_name, help="lineage name (default: <task>-<arm>-s<seed>)"
    )
    run.add_argument(
        "--iterations",
        type=number(int, "[1, inf)"),
        help="total iterations (default: the config's)",
    )
    run.add_argument(
        "--engine",
        default="inline",
        help="inline (default: one process), kfp-local (the Kubeflow pipeline under "
        "kfp.local) or async (generation workers, a trainer and an evaluator side by side)",
    )
    run.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override, e.g. buffer.capacity=1024"
    )
    run.add_argument(
        "--accept-changed-task-data",
        action="store_true",
        help="go on with an existing lineage although its task file now gives other problems "
        "(recorded, with the iteration, in the lineage's inputs/task.json)",
    )
    run.set_defaults(func=_run)
