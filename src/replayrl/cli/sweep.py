"""`replayrl sweep run | report | distributions`: grids of lineages (here or on Kubeflow) and
their report (see replayrl.experiments.sweep and replayrl.experiments.sweep_report)."""

from __future__ import annotations

import argparse
import os
import sys

from replayrl.cli.args import lineage_name, number, one_line_errors
from replayrl.errors import ReplayRLError

SWEEP_HELP = """\
A grid over config keys, one lineage per point. --grid KEY=V1,V2 (repeatable; dotted keys,
or N = buffer.capacity, lr = train.lr, W / T = asynchronous.workers / trainers, x and y =
Theorem 4.5's staleness horizon and replay ratio, realised through
rollout.prompts_per_iteration and buffer.capacity; K1:K2=a1:a2,b1:b2 varies keys together).
--named: the paper's grids, with N = k·R_iter (k = 1, 2, 4, ..., 32; this loop needs
N >= R_iter): seeds-n (N; with --seeds, seeds × N), wt-n ((W, T) in 7:1, 6:2, 5:3, 4:4 × N;
asynchronous), lr-n (train.lr × 1/3, 1, 3 × N), xy (y nearest 1, 2, 4, 8 × four horizons x).
--seeds K repeats every point over K seeds. Re-running skips finished lineages and resumes
unfinished ones; `sweep report` writes heatmaps, the Pareto frontier, the advisor's
prediction and per-lineage histograms.
Example: replayrl sweep run --config configs/tiny-cpu.yaml --grid N=256,512 --grid y=1,2 \\
  --seeds 3 --out sweeps/n-y && replayrl sweep report --out sweeps/n-y
"""


def _spec(args: argparse.Namespace) -> dict:
    from replayrl.experiments.sweep import read_sweep_file

    spec = read_sweep_file(args.file) if args.file else {}
    config = args.config or spec.get("config")
    if not config:
        raise ReplayRLError("sweep run needs --config (or a sweep file with `config:`).")
    return dict(
        config_path=config,
        grid=[*spec.get("grid", []), *(args.grid or [])],
        named=args.named or spec.get("named"),
        seeds=args.seeds if args.seeds is not None else int(spec.get("seeds", 1)),
        overrides=[*(spec.get("set") or []), *(args.set or [])],
        experiment=args.experiment or spec.get("experiment"),
        out_dir=args.out,
        run_root=args.run_root,
    )


def _run(args: argparse.Namespace) -> int:
    from replayrl.experiments import sweep as sw

    s = sw.sweep_points(**_spec(args))
    if not args.kubeflow:
        from replayrl.cli.run import until_stopped

        def work(signals) -> int:
            done = sw.run_local(s, signals=signals)
            ran = sum(v == "ran" for v in done.values())
            print(
                f"{len(done)} lineages ({ran} run, {len(done) - ran} finished earlier) under "
                f"{s.run_root}; report: replayrl sweep report --out {args.out}"
            )
            return 0

        return until_stopped(work)
    from replayrl.cli.kubeflow import _connection
    from replayrl.kfp.sweep import plan_kubeflow, submit_kubeflow

    runs = plan_kubeflow(s, packages_dir=os.path.join(args.out, "kubeflow"), image=args.image)
    if args.dry_run:
        sw.write_manifest(s)
        for r in runs:
            print(f"{r.lineage}: {r.package}")
        return 0
    ids = submit_kubeflow(
        s,
        runs,
        connection=_connection(args),
        experiment=args.kfp_experiment,
        pipeline_name=args.pipeline_name,
    )
    print(f"{len(ids)} Kubeflow run(s) submitted: {', '.join(ids)}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from replayrl.experiments.sweep_report import write_report

    _, paths = write_report(args.out, rho=args.rho, alpha=args.alpha, mu=args.mu)
    print(paths[1].read_text())
    for p in paths:
        print(p, file=sys.stderr)
    return 0


def _distributions(args: argparse.Namespace) -> int:
    from pathlib import Path

    from replayrl import storage
    from replayrl.experiments.sweep_report import write_distributions

    if storage.read_state(storage.lineage_paths(args.run_root, args.lineage)) is None:
        raise ReplayRLError(f"No lineage '{args.lineage}' under {args.run_root} (no state.json).")
    files = write_distributions(args.run_root, args.lineage, Path(args.out))
    if not files:
        raise ReplayRLError(f"Lineage '{args.lineage}' under {args.run_root} has no uses yet.")
    for f in files:
        print(f)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`replayrl sweep run | report | distributions`."""
    from replayrl.kfp import DEFAULT_IMAGE

    sweep = sub.add_parser(
        "sweep",
        help="a grid of lineages (here or on Kubeflow) and its report",
        description=SWEEP_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmds = sweep.add_subparsers(dest="sweep_command", required=True)
    run = one_line_errors(
        cmds.add_parser("run", help="run (or resume) every point, or submit them to Kubeflow")
    )
    run.add_argument("--config", help="YAML config, e.g. configs/tiny-cpu.yaml")
    run.add_argument("--file", help="sweep YAML: config, grid, named, seeds, set, experiment")
    run.add_argument("--grid", action="append", metavar="KEY=V1,V2", help="an axis of the grid")
    run.add_argument(
        "--named",
        choices=["seeds-n", "wt-n", "lr-n", "xy"],
        help="a paper grid, values from the config's loop (see `replayrl sweep -h`)",
    )
    run.add_argument("--seeds", type=number(int, "[1, inf)"), help="seeds per point (default 1)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for all")
    run.add_argument("--out", required=True, help="folder: sweep.json, runs/, the report")
    run.add_argument("--run-root", help="where lineages live (default <out>/runs)")
    run.add_argument("--experiment", help="MLflow experiment (default <config name>-sweep)")
    run.add_argument("--kubeflow", action="store_true", help="one Kubeflow run per point")
    run.add_argument("--dry-run", action="store_true", help="with --kubeflow: compile only")
    run.add_argument("--image", default=DEFAULT_IMAGE, help="image of every step")
    run.add_argument("--pipeline-name", default="replayrl-sweep", help="uploaded pipeline")
    run.add_argument("--kfp-experiment", default="replayrl", help="KFP experiment")
    for flag, help_ in (
        ("--host", "KFP API endpoint (default: $KF_PIPELINES_ENDPOINT)"),
        ("--token", "bearer token (default: $KF_PIPELINES_TOKEN)"),
        ("--namespace", "profile namespace (default: $KF_PIPELINES_NAMESPACE)"),
        ("--cookies", "auth cookies (default: $KF_PIPELINES_COOKIES)"),
    ):
        run.add_argument(flag, help=help_)
    run.set_defaults(func=_run)

    rep = one_line_errors(
        cmds.add_parser("report", help="heatmaps, Pareto frontier, advisor, histograms")
    )
    rep.add_argument("--out", required=True, help="the sweep's --out folder")
    rep.add_argument(
        "--rho",
        type=number(float, "[0, 1]"),
        default=0.5,
        help="advisor's ρ (assumed; default 0.5)",
    )
    rep.add_argument(
        "--alpha",
        type=number(float, "(0, inf)"),
        default=0.25,
        help="advisor's α (assumed; default 0.25)",
    )
    rep.add_argument(
        "--mu",
        type=number(float, "[0, inf)"),
        help="advisor's μ (default: the sweep's measured μ)",
    )
    rep.set_defaults(func=_report)

    dist = one_line_errors(
        cmds.add_parser(
            "distributions", help="histograms of staleness, replay ratio, steps since last use"
        )
    )
    dist.add_argument("--run-root", required=True)
    dist.add_argument("--lineage", required=True, type=lineage_name)
    dist.add_argument("--out", required=True, help="folder for <lineage>.{json,png}")
    dist.set_defaults(func=_distributions)
