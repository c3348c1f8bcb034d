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
    from replayrl.engine.inline import run_inline
    from replayrl.policy.gpu import warn_if_old_driver

    warn_if_old_driver()
    print(
        f"replayrl: lineage '{cfg.lineage}' ({cfg.arm}), R={cfg.rollouts_per_iteration} rollouts/iter, "
        f"N={cfg.buffer.capacity}, B={cfg.train.batch_size}×S={cfg.train.steps_per_iteration}, "
        f"replay ratio y={cfg.replay_ratio:g}, {cfg.iterations} iterations",
        file=sys.stderr,
    )
    if args.engine == "async":
        from replayrl.engine.asynchronous.supervisor import run_async

        a = cfg.asynchronous
        print(
            f"replayrl: asynchronous split, W={a.workers} worker(s), T={a.trainers} trainer, "
            f"weights published every {a.publish_every} gradient steps, "
            f"{cfg.total_gradient_steps} gradient steps in all",
            file=sys.stderr,
        )
        _print_async_summary(run_async(cfg))
        return 0
    summary = run_inline(cfg) if args.engine == "inline" else _run_kfp_local(cfg)
    _print_summary(summary)
    return 0


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
    _print_ui_links(summary.tracking_uri, run_id=summary.mlflow_run_id)


def _run_kfp_local(cfg):
    """`replay_loop` under kfp.local: one subprocess per step, like one pod per step."""
    from replayrl.kfp.local import outputs_dir_for, run_kfp_local

    print(f"replayrl: kfp.local task outputs under {outputs_dir_for(cfg)}", file=sys.stderr)
    return run_kfp_local(cfg)


# ---------------------------------------------------------------- Kubeflow


def _compile(args: argparse.Namespace) -> int:
    from replayrl.kfp.pipelines import compile_pipelines

    if args.config and not os.path.isfile(args.config):
        raise ReplayRLError(f"Config file '{args.config}' does not exist.")
    for path in compile_pipelines(
        args.out, iterations=args.iterations, image=args.image, config_path=args.config
    ):
        print(path)
    return 0


def _connection(args: argparse.Namespace):
    from replayrl.config import kfp_connection_from_env
    from replayrl.kfp.client import Connection

    env = kfp_connection_from_env()
    return Connection(
        host=args.host or env["host"],
        token=args.token or env["token"],
        namespace=args.namespace or env["namespace"],
        cookies=args.cookies or env["cookies"],
    )


def _run_params(args: argparse.Namespace) -> tuple[dict[str, str], str | None, str | None]:
    """Pipeline parameters from the flags, the local config file (if any) whose
    `kubernetes:` section sets the pods, and the service account runs use (that section's
    `service_account`). A local config is checked before anything is sent."""
    from replayrl.config import KubernetesConfig
    from replayrl.kfp.runtime import resolve

    params: dict[str, str] = {}
    config_file = None
    if args.config:
        if os.path.isfile(args.config):
            config_file = args.config
            params["config"] = open(args.config).read()
        elif "://" in args.config:
            params["config"] = args.config  # read by the pipeline's first step
        else:
            raise ReplayRLError(
                f"Config file '{args.config}' does not exist; pass a YAML file or an s3:// URI."
            )
    for key in ("arm", "lineage", "run_root"):
        if getattr(args, key):
            params[key] = getattr(args, key)
    service_account = KubernetesConfig().service_account
    if config_file or not args.config:
        # Fail here, not in a pod: the config must load with this run's arm/lineage/root.
        # The run root is not touched (a cluster's s3:// root may be unreachable from here).
        cfg = resolve(
            params.get("config", ""), arm=params.get("arm", ""), lineage=params.get("lineage", "")
        )
        service_account = cfg.kubernetes.service_account
    return params, config_file, service_account or None


def _where(namespace: str | None, service_account: str | None) -> str:
    ns = f"namespace {namespace}" if namespace else "no namespace (single-user)"
    return f"{ns}, service account {service_account or 'the namespace default'}"


def _package(args: argparse.Namespace, pipeline: str, config_file: str | None, tmp: str):
    from pathlib import Path

    from replayrl.kfp.pipelines import ITERATION_FILE, LOOP_FILE, compile_pipelines

    if args.package:
        if not os.path.isfile(args.package):
            raise ReplayRLError(f"Pipeline package '{args.package}' does not exist.")
        return Path(args.package)
    compile_pipelines(tmp, iterations=args.iterations, image=args.image, config_path=config_file)
    return Path(tmp) / (LOOP_FILE if pipeline == "loop" else ITERATION_FILE)


def _submit(args: argparse.Namespace) -> int:
    import tempfile
    import time

    from replayrl.kfp.client import submit

    params, config_file, service_account = _run_params(args)
    name = args.pipeline_name or f"replayrl-{args.pipeline}"
    run_name = (
        args.run_name or f"{params.get('lineage', 'replayrl')}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    with tempfile.TemporaryDirectory(prefix="replayrl-compile-") as tmp:
        package = _package(args, args.pipeline, config_file, tmp)
        result = submit(
            _connection(args),
            package=package,
            pipeline_name=name,
            experiment=args.experiment,
            run_name=run_name,
            params=params,
            service_account=service_account,
        )
    print(
        f"pipeline {name} version {result.uploaded.version_name} "
        f"({result.uploaded.version_id}); run {result.run_id} in experiment '{args.experiment}' "
        f"({_where(result.namespace, service_account)})"
    )
    return 0


def _schedule(args: argparse.Namespace) -> int:
    import tempfile

    from replayrl.kfp.client import normalize_cron, schedule, set_enabled

    conn = _connection(args)
    if args.action in ("pause", "resume"):
        rid = set_enabled(
            conn,
            enabled=args.action == "resume",
            recurring_run_id=args.id,
            name=args.name,
            experiment=args.experiment,
        )
        print(f"recurring run {rid} {'resumed' if args.action == 'resume' else 'paused'}")
        return 0
    if not args.cron:
        raise ReplayRLError("schedule create needs --cron, e.g. --cron '0 * * * *' (hourly).")
    normalize_cron(args.cron)  # before compiling
    params, config_file, service_account = _run_params(args)
    name = args.pipeline_name or "replayrl-iteration"
    job = args.name or f"{params.get('lineage', 'replayrl')}-recurring"
    with tempfile.TemporaryDirectory(prefix="replayrl-compile-") as tmp:
        package = _package(args, "iteration", config_file, tmp)
        result = schedule(
            conn,
            package=package,
            pipeline_name=name,
            experiment=args.experiment,
            job_name=job,
            cron=args.cron,
            params=params,
            service_account=service_account,
        )
    print(
        f"recurring run {result.recurring_run_id} ('{job}', cron '{result.cron}', max "
        f"concurrency 1, no catch-up) of {name} version {result.uploaded.version_name} "
        f"({_where(result.namespace, service_account)})"
    )
    return 0


def _add_kfp_arguments(p: argparse.ArgumentParser, *, run_params: bool) -> None:
    from replayrl.kfp import DEFAULT_IMAGE, DEFAULT_ITERATIONS

    p.add_argument("--host", help="KFP API endpoint (default: $KF_PIPELINES_ENDPOINT)")
    p.add_argument("--token", help="bearer token (default: $KF_PIPELINES_TOKEN)")
    p.add_argument(
        "--namespace",
        help="profile namespace on a multi-user Kubeflow (default: $KF_PIPELINES_NAMESPACE)",
    )
    p.add_argument(
        "--cookies",
        help="auth cookies, e.g. authservice_session=... (default: $KF_PIPELINES_COOKIES)",
    )
    p.add_argument("--experiment", default="replayrl", help="KFP experiment (default: replayrl)")
    if not run_params:
        return
    p.add_argument(
        "--config",
        help="YAML file (sent as text; its kubernetes: section sets the pods) or s3:// URI",
    )
    p.add_argument("--arm", help="replay | on-policy | replay-plain (default: the config's)")
    p.add_argument("--lineage", help="lineage name (default: the config's)")
    p.add_argument("--run-root", help="s3://bucket/prefix (default: the config's)")
    p.add_argument("--pipeline-name", help="name of the uploaded pipeline")
    p.add_argument("--package", help="upload this compiled YAML instead of compiling now")
    p.add_argument(
        "--image", default=DEFAULT_IMAGE, help=f"image of every step (default {DEFAULT_IMAGE})"
    )
    p.add_argument(
        "--iterations", type=int, default=DEFAULT_ITERATIONS, help="iterations of replay_loop"
    )


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
    _print_ui_links(summary.tracking_uri, run_id=summary.mlflow_run_id)


def _print_ui_links(uri: str, *, run_id: str, print=print) -> None:
    """How to open the runs in MLflow's UI: the command for a local store, then the links."""
    from replayrl.engine.tracking import experiment_of_run, ui_link

    if not uri.startswith(("http://", "https://")):
        print(f"open the UI: mlflow ui --backend-store-uri {uri}")
    experiment_id = experiment_of_run(uri, run_id)
    print(f"runs: {ui_link(uri, experiment_id)}")
    print(f"this run: {ui_link(uri, experiment_id, run_id)}")


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
                f"{len(damaged)} damaged data file(s) in {paths.buffer}: run `replayrl buffer "
                f"repair --run-root {args.run_root} --lineage {args.lineage}` to set them aside."
            )
        print(f"{paths.buffer}: every data file is readable", file=sys.stderr)
    elif args.buffer_command == "repair":
        damaged = buf.repair(dry_run=args.dry_run)
        if damaged and not args.dry_run and state is not None:
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
        removed = buf.vacuum(grace_s=args.grace_s, dry_run=args.dry_run)
        print(json.dumps(removed, indent=2))
    return 0


# ---------------------------------------------------------------- replay vs on-policy


def _tracking_uri(args: argparse.Namespace) -> str:
    from replayrl.config import tracking_uri_from_env

    uri = args.tracking_uri or tracking_uri_from_env()
    if uri:
        return uri
    default = os.path.abspath(os.path.join("runs", "mlflow.db"))
    if os.path.isfile(default):
        return f"sqlite:///{default}"
    raise ReplayRLError(
        "No MLflow store given: pass --tracking-uri (e.g. sqlite:///$PWD/runs/mlflow.db, the "
        "store a local run root holds) or set MLFLOW_TRACKING_URI."
    )


def _compare(args: argparse.Namespace) -> int:
    from replayrl.experiments.compare import run_compare

    result = run_compare(
        tracking_uri=_tracking_uri(args),
        experiment=args.experiment,
        out_dir=args.out,
        target=args.target,
        what_if_mu=args.mu,
    )
    print((result.paths[1]).read_text())
    for path in result.paths:
        print(path, file=sys.stderr)
    if result.mlflow_run_id:
        print(f"MLflow comparison run: {result.mlflow_run_id}", file=sys.stderr)
        _print_ui_links(
            _tracking_uri(args),
            run_id=result.mlflow_run_id,
            print=lambda line: print(line, file=sys.stderr),
        )
    return 0


def _experiment(args: argparse.Namespace) -> int:
    from replayrl.experiments.seeds import run_experiment

    if args.async_split:
        from replayrl.experiments.split import run_split_experiment, split_markdown

        if args.plain_replay:
            raise ReplayRLError("--plain-replay and --async-split are separate experiments.")
        report = run_split_experiment(
            config_path=args.config,
            seeds=args.seeds,
            out_dir=args.out,
            overrides=list(args.set or []),
            experiment=args.experiment,
            target=args.target,
        )
        print(split_markdown(report))
        print(
            f"files: {os.path.join(args.out, 'split.json')}, {os.path.join(args.out, 'split.md')}"
            f"\nwall time: {report['wall_seconds']:.0f} s",
            file=sys.stderr,
        )
        return 0
    done = run_experiment(
        config_path=args.config,
        seeds=args.seeds,
        out_dir=args.out,
        overrides=list(args.set or []),
        experiment=args.experiment,
        target=args.target,
        what_if_mu=args.mu,
        plain_replay=args.plain_replay,
    )
    print(done.comparison.paths[1].read_text())
    print(
        f"files: {', '.join(str(p) for p in done.comparison.paths)}\nMLflow: {done.tracking_uri} "
        f"(experiment '{done.experiment}')\nwall time: {done.wall_seconds:.0f} s",
        file=sys.stderr,
    )
    if done.comparison.mlflow_run_id:
        _print_ui_links(
            done.tracking_uri,
            run_id=done.comparison.mlflow_run_id,
            print=lambda line: print(line, file=sys.stderr),
        )
    return 0


def _advise(args: argparse.Namespace) -> int:
    import json

    from replayrl.experiments.advisor import advise, render

    shape, shape_source = None, ""
    if args.config or args.set:
        from replayrl.config import load_config

        cfg = load_config(args.config, overrides=args.set)
        shape = dict(
            batch_size=cfg.train.batch_size,
            steps_per_iteration=cfg.train.steps_per_iteration,
            samples_per_prompt=cfg.rollout.samples_per_prompt,
        )
        shape_source = args.config or "the config defaults with --set"
    mu, mu_source = args.mu, "--mu"
    if mu is None or (args.experiment and shape is None):
        from replayrl.experiments.compare import experiment_mu

        experiment = args.experiment or "replayrl"
        measured, source, measured_shape = experiment_mu(
            tracking_uri=_tracking_uri(args), experiment=experiment
        )
        if mu is None:
            mu, mu_source = measured, f"measured: {source}"
        if shape is None:
            shape, shape_source = measured_shape, f"experiment '{experiment}'"
    if shape is None:
        from replayrl.config import RunConfig

        d = RunConfig()
        shape = dict(
            batch_size=d.train.batch_size,
            steps_per_iteration=d.train.steps_per_iteration,
            samples_per_prompt=d.rollout.samples_per_prompt,
        )
        shape_source = "the config defaults (pass --config for yours)"
    result = advise(mu=mu, rho=args.rho, alpha=args.alpha, **shape)
    if args.json:
        doc = {**result.to_json(), "mu_source": mu_source, "shape_source": shape_source}
        print(json.dumps(doc, indent=2))
    else:
        print(render(result, source=mu_source) + f"\n(B, S, G from {shape_source})")
    return 0


ADVISE_HELP = """\
Buffer capacity and replay ratio that minimise the variance × cost of Theorem 4.5 of
"Efficient RL Training for LLMs with Experience Replay" (Arnal et al., 2026), and the
loop settings that realise them. Per gradient step (§4): R fresh rollouts, batch B,
buffer N; x = N/R the staleness horizon in gradient steps, y = B/R the replay ratio;
μ = generation / training cost per rollout (§3.2); σ(age) = per-sample gradient-noise
scale, here (age/τ)^α, σ̄(H) its mean over ages 1..H; ρ in [0, 1] = correlation between
replayed samples' noise through the parameter path they both shaped.

  x* = argmin_x σ̄²(x)·(sqrt(1/μ) + sqrt(ρ + 1/x))²,   y* = sqrt(μ / (ρ + 1/x*))
  closed form (App. 9.3.2, α < 1/2): y* = (−α + sqrt(α² + μρ(1 − 2α)))/ρ,
                                     x* = y*²/(2α(μ + y*))

This loop generates R_iter rollouts per iteration, then takes S steps of B: R = R_iter/S,
x = S·N/R_iter, y = S·B/R_iter, so rollout.prompts_per_iteration = S·B/(y*·G) rounded and
buffer.capacity = x*·R_iter/S (at least R_iter: the horizon is at least S steps; when
x* < S, y is re-optimised for x = S). A target y <= 1 means strict on-policy.
ρ and α are not measured by replayrl (no per-sample gradient noise is logged): give them.
Example: replayrl advise --mu 6.84 --rho 0.5 --alpha 0.25 --json
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replayrl", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"replayrl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run (or resume) a lineage")
    run.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny-cpu.yaml")
    run.add_argument(
        "--arm",
        choices=None,
        default=None,
        help="replay | on-policy | replay-plain (default: the config's)",
    )
    run.add_argument("--run-root", help="file path or s3://bucket/prefix (default: the config's)")
    run.add_argument("--lineage", help="lineage name (default: <task>-<arm>-s<seed>)")
    run.add_argument("--iterations", type=int, help="total iterations (default: the config's)")
    run.add_argument(
        "--engine",
        default="inline",
        help="inline (default: one process), kfp-local (the Kubeflow pipeline under "
        "kfp.local) or async (generation workers, a trainer and an evaluator side by side)",
    )
    run.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override, e.g. buffer.capacity=1024"
    )
    run.set_defaults(func=_run)

    buf = sub.add_parser("buffer", help="see the replay buffer of a lineage")
    buf.add_argument(
        "buffer_command",
        choices=["stats", "inspect", "check", "repair", "vacuum"],
        help="stats | inspect rows | check data files | repair: set damaged files aside | "
        "vacuum: delete files no recent version needs",
    )
    buf.add_argument("--run-root", default="runs")
    buf.add_argument("--lineage", required=True)
    buf.add_argument("--limit", type=int, default=10)
    buf.add_argument(
        "--grace-s",
        type=float,
        default=3600.0,
        help="vacuum: keep files versions younger than this still need (default 3600 s)",
    )
    buf.add_argument("--dry-run", action="store_true", help="repair/vacuum: only list files")
    buf.set_defaults(func=_buffer)

    from replayrl.kfp import DEFAULT_IMAGE, DEFAULT_ITERATIONS

    comp = sub.add_parser("compile", help="write the Kubeflow pipeline YAML")
    comp.add_argument(
        "--out", default="pipelines/compiled", help="folder (default: pipelines/compiled)"
    )
    comp.add_argument(
        "--iterations",
        type=int,
        default=DEFAULT_ITERATIONS,
        help=f"iterations replay_loop unrolls (default {DEFAULT_ITERATIONS})",
    )
    comp.add_argument(
        "--image", default=DEFAULT_IMAGE, help=f"image of every step (default {DEFAULT_IMAGE})"
    )
    comp.add_argument("--config", help="YAML file: default `config` parameter and pod settings")
    comp.set_defaults(func=_compile)

    subm = sub.add_parser("submit", help="upload a pipeline (or new version) and start a run")
    subm.add_argument("--pipeline", choices=["loop", "iteration"], default="loop")
    subm.add_argument("--run-name", help="run name (default: <lineage>-<time>)")
    _add_kfp_arguments(subm, run_params=True)
    subm.set_defaults(func=_submit)

    sch = sub.add_parser(
        "schedule", help="recurring runs of replay_iteration: create, pause, resume"
    )
    sch.add_argument("action", choices=["create", "pause", "resume"])
    sch.add_argument(
        "--cron", help="cron, 5 fields ('0 * * * *' = hourly) or KFP's 6 (seconds first)"
    )
    sch.add_argument("--name", help="recurring run name (default: <lineage>-recurring)")
    sch.add_argument("--id", help="recurring run id (pause/resume)")
    _add_kfp_arguments(sch, run_params=True)
    sch.set_defaults(func=_schedule)

    from replayrl.experiments.statistics import PAPER_MU

    def tracking(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--tracking-uri",
            help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///$PWD/runs/mlflow.db)",
        )

    def targets(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--target", type=float, help="pass@1 to reach (default: on-policy's final median)"
        )
        p.add_argument(
            "--mu",
            type=float,
            default=PAPER_MU,
            help=f"what-if μ, cost units shown beside the measured μ's (default {PAPER_MU}; the "
            "paper measured 5.28 and 6.84, §3.2)",
        )

    cmp = sub.add_parser(
        "compare", help="replay vs on-policy: plot, table and JSON from an MLflow experiment"
    )
    cmp.add_argument(
        "--experiment", default="replayrl", help="MLflow experiment (default replayrl)"
    )
    tracking(cmp)
    targets(cmp)
    cmp.add_argument("--out", required=True, help="folder for comparison.{png,json,md}")
    cmp.set_defaults(func=_compare)

    exp = sub.add_parser("experiment", help="run the arms for K seeds (inline), then compare them")
    exp.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny-cpu.yaml")
    exp.add_argument("--seeds", type=int, default=3, help="seeds per arm (default 3)")
    exp.add_argument("--out", required=True, help="folder: runs/ (lineages) and the comparison")
    exp.add_argument(
        "--experiment", help="MLflow experiment (default: the config's, else the file's name)"
    )
    exp.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override, e.g. iterations=50"
    )
    exp.add_argument(
        "--plain-replay",
        action="store_true",
        help="also run replay-plain: the replay arm with buffer.positive_bias=0",
    )
    exp.add_argument(
        "--async-split",
        action="store_true",
        help="instead: sync on-policy (inline) vs async on-policy vs async replay, on wall-clock "
        "time to the on-policy arms' final median pass@1 (split.json, split.md)",
    )
    targets(exp)
    exp.set_defaults(func=_experiment)

    adv = sub.add_parser(
        "advise",
        help="buffer capacity and replay ratio of Theorem 4.5 from μ, ρ and α",
        description=ADVISE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    adv.add_argument(
        "--mu",
        type=float,
        help="μ = generation / training cost per rollout (default: measured in --experiment)",
    )
    adv.add_argument(
        "--experiment",
        help="MLflow experiment whose ledger gives μ (default replayrl) and B, S, G",
    )
    tracking(adv)
    adv.add_argument(
        "--rho",
        type=float,
        required=True,
        help="ρ in [0, 1]: correlation of replayed samples' gradient noise (Theorem 4.5)",
    )
    adv.add_argument(
        "--alpha",
        type=float,
        required=True,
        help="α > 0: gradient-noise scale σ(age) ∝ age^α in gradient steps (closed form: α < 1/2)",
    )
    adv.add_argument("--config", help="YAML config giving B, S, G (train.batch_size, ...)")
    adv.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="config override, e.g. train.batch_size=60",
    )
    adv.add_argument("--json", action="store_true", help="print one JSON object")
    adv.set_defaults(func=_advise)
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
