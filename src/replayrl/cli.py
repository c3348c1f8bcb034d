"""`replayrl` command line: run a lineage, inspect its buffer.

User errors (ReplayRLError) print one line on stderr, without a traceback, and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from replayrl import __version__
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
    cfg = load_config(args.config, overrides=overrides, arm=args.arm)
    if args.engine != "inline":
        raise ReplayRLError(f"Engine '{args.engine}' is not available; use --engine inline.")
    from replayrl.loop import run_inline

    print(
        f"replayrl: lineage '{cfg.lineage}' ({cfg.arm}), R={cfg.rollouts_per_iteration} rollouts/iter, "
        f"N={cfg.buffer.capacity}, B={cfg.train.batch_size}×S={cfg.train.steps_per_iteration}, "
        f"replay ratio y={cfg.replay_ratio:g}, {cfg.iterations} iterations",
        file=sys.stderr,
    )
    summary = run_inline(cfg)
    _print_summary(summary)
    return 0


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
    if summary.tracking_uri.startswith("sqlite:///"):
        console.print(f"open the UI: mlflow ui --backend-store-uri {summary.tracking_uri}")


def _buffer(args: argparse.Namespace) -> int:
    import json

    from replayrl import storage
    from replayrl.buffer import ReplayBuffer

    paths = storage.lineage_paths(args.run_root, args.lineage)
    state = storage.read_state(paths)
    if state is None:
        raise ReplayRLError(f"No lineage '{args.lineage}' under '{args.run_root}' (no state.json).")
    buf = ReplayBuffer(paths.buffer, storage_options=storage.delta_storage_options(paths.buffer))
    if args.buffer_command == "stats":
        stats = buf.stats(current_policy_version=state.policy_version)
        print(json.dumps(stats.as_dict(), indent=2, default=str))
    elif args.buffer_command == "inspect":
        table = buf.read(
            columns=[
                "rollout_id",
                "iteration",
                "policy_version",
                "prompt",
                "completion",
                "reward",
                "advantage",
            ]
        )
        for row in table.slice(0, args.limit).to_pylist():
            print(json.dumps(row, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replayrl", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"replayrl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run (or resume) a lineage")
    run.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny-cpu.yaml")
    run.add_argument(
        "--arm", choices=None, default=None, help="replay | on-policy (default: the config's)"
    )
    run.add_argument("--run-root", help="file path or s3://bucket/prefix (default: the config's)")
    run.add_argument("--lineage", help="lineage name (default: <task>-<arm>-s<seed>)")
    run.add_argument("--iterations", type=int, help="total iterations (default: the config's)")
    run.add_argument("--engine", default="inline", help="inline (default)")
    run.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override, e.g. buffer.capacity=1024"
    )
    run.set_defaults(func=_run)

    buf = sub.add_parser("buffer", help="see the replay buffer of a lineage")
    buf.add_argument("buffer_command", choices=["stats", "inspect"])
    buf.add_argument("--run-root", default="runs")
    buf.add_argument("--lineage", required=True)
    buf.add_argument("--limit", type=int, default=10)
    buf.set_defaults(func=_buffer)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("alembic", "mlflow", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return args.func(args)
    except ReplayRLError as e:
        print(f"replayrl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("replayrl: interrupted; re-run the same command to resume.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
