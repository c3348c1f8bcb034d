"""`replayrl buffer`: see, check, repair and vacuum the replay buffer of a lineage."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from replayrl.cli.args import lineage_name, number, one_line_errors
from replayrl.errors import ReplayRLError


def _buffer(args: argparse.Namespace) -> int:
    import json

    from replayrl import storage
    from replayrl.buffer.table import ReplayBuffer

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
    elif args.buffer_command == "check":
        damaged = buf.check()
        for d in damaged:
            print(json.dumps(d.as_dict()))
        if damaged:
            raise ReplayRLError(
                f"{len(damaged)} damaged file(s) in {paths.buffer}: run `replayrl buffer "
                f"repair --run-root {args.run_root} --lineage {args.lineage}` to set them aside."
            )
        print(f"{paths.buffer}: every data file is readable", file=sys.stderr)
    elif args.buffer_command == "repair":
        with _lease(paths, writes=not args.dry_run):
            damaged = buf.repair(dry_run=args.dry_run)
            if damaged and not args.dry_run:
                from replayrl.engine.lineage import adopt_buffer_versions

                adopt_buffer_versions(paths)
        for d in damaged:
            print(json.dumps(d.as_dict()))
        verb = "would move" if args.dry_run else "moved"
        rows = sum(d.rows or 0 for d in damaged)
        print(
            f"{verb} {len(damaged)} damaged file(s) ({rows} rows) to {paths.buffer}/quarantine/",
            file=sys.stderr,
        )
    elif args.buffer_command == "vacuum":
        with _lease(paths, writes=not args.dry_run):
            # Read after the lease fenced the lineage: the checkpoint a rewind restores.
            checkpoint = (storage.read_state(paths) or state).checkpoint or {}
            removed = buf.vacuum(
                grace_s=args.grace_s,
                dry_run=args.dry_run,
                keep_versions={
                    "rollouts": checkpoint.get("rollouts_version"),
                    "usage": checkpoint.get("usage_version"),
                },
            )
        print(json.dumps(removed, indent=2))
    return 0


@contextlib.contextmanager
def _lease(paths, *, writes: bool) -> Iterator[None]:
    """Hold the lineage's lease (and so fence it) while a command that writes runs: it stops,
    writing nothing, when a run is advancing the lineage; a dry run takes nothing."""
    from replayrl import storage
    from replayrl.storage import lease

    if not writes:
        yield
        return
    with lease.held(paths, owner=lease.inline_owner(), ttl_s=storage.cli_lease_ttl_s()) as holder:
        holder.hold()
        yield


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`replayrl buffer`."""
    buf = one_line_errors(sub.add_parser("buffer", help="see the replay buffer of a lineage"))
    buf.add_argument(
        "buffer_command",
        choices=["stats", "inspect", "check", "repair", "vacuum"],
        help="stats | inspect rows | check data files | repair: set damaged files aside | "
        "vacuum: delete files no recent version needs",
    )
    buf.add_argument("--run-root", default="runs")
    buf.add_argument("--lineage", required=True, type=lineage_name)
    buf.add_argument("--limit", type=number(int, "[0, inf)"), default=10, help="inspect: rows")
    buf.add_argument(
        "--grace-s",
        type=number(float, "[0, inf)"),
        default=3600.0,
        help="vacuum: keep files versions younger than this still need (default 3600 s); "
        "the files a rewind to the last full checkpoint needs are kept whatever the grace",
    )
    buf.add_argument("--dry-run", action="store_true", help="repair/vacuum: only list files")
    buf.set_defaults(func=_buffer)
