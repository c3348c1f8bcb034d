"""Replay vs on-policy: `replayrl compare`, `experiment` and `advise`."""

from __future__ import annotations

import argparse
import os
import sys

from replayrl.cli.args import number, one_line_errors
from replayrl.cli.run import print_ui_links, until_stopped
from replayrl.errors import ReplayRLError
from replayrl.logs import without_credentials


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
    from replayrl.experiments.compare import restate_file, run_compare

    if args.from_json:
        paths = restate_file(args.from_json, args.out)
        print(paths[1].read_text())
        for path in paths:
            print(path, file=sys.stderr)
        return 0
    result = run_compare(
        tracking_uri=_tracking_uri(args),
        experiment=args.experiment,
        out_dir=args.out,
        target=args.target,
        what_if_mu=_lineages_what_if_mu(args),
        metric=args.metric,
        peak=args.peak,
        allow_mixed_hardware=args.allow_mixed_hardware,
    )
    print((result.paths[1]).read_text())
    for path in result.paths:
        print(path, file=sys.stderr)
    if result.mlflow_run_id:
        print(f"MLflow comparison run: {result.mlflow_run_id}", file=sys.stderr)
        print_ui_links(
            _tracking_uri(args),
            run_id=result.mlflow_run_id,
            print=lambda line: print(line, file=sys.stderr),
        )
    return 0


def _experiment(args: argparse.Namespace) -> int:
    return until_stopped(lambda signals: _run_experiment(args, signals))


def _run_experiment(args: argparse.Namespace, signals) -> int:
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
            signals=signals,
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
        what_if_mu=_config_what_if_mu(args),
        plain_replay=args.plain_replay,
        metric=args.metric,
        peak=args.peak,
        signals=signals,
    )
    print(done.comparison.paths[1].read_text())
    print(
        f"files: {', '.join(str(p) for p in done.comparison.paths)}\nMLflow: {without_credentials(done.tracking_uri)} "
        f"(experiment '{done.experiment}')\nwall time: {done.wall_seconds:.0f} s",
        file=sys.stderr,
    )
    if done.comparison.mlflow_run_id:
        print_ui_links(
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


def _tracking_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tracking-uri",
        help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///$PWD/runs/mlflow.db)",
    )


def _config_what_if_mu(args: argparse.Namespace) -> float:
    """--mu, else the config's model.paper_mu (the paper's μ for the preset's model), else
    the default what-if μ."""
    from replayrl.config import load_config
    from replayrl.experiments.statistics import PAPER_MU

    if args.mu is not None:
        return args.mu
    mu = load_config(args.config, overrides=list(args.set or [])).model.paper_mu
    return PAPER_MU if mu is None else mu


def _lineages_what_if_mu(args: argparse.Namespace) -> float:
    """--mu, else the model.paper_mu the experiment's lineages were run with (when they all
    name the same one), else the default what-if μ."""
    from replayrl.engine.tracking import NULL_PARAM
    from replayrl.experiments.compare import read_lineages
    from replayrl.experiments.statistics import PAPER_MU

    if args.mu is not None:
        return args.mu
    # Only their params: the comparison itself checks their hardware.
    lineages = read_lineages(
        tracking_uri=_tracking_uri(args), experiment=args.experiment, allow_mixed_hardware=None
    )
    # A lineage run with no paper μ logged the param as NULL_PARAM.
    named = {p.get("model.paper_mu", NULL_PARAM) for p in lineages.params.values()}
    if len(named) == 1 and (value := named.pop()) not in (NULL_PARAM, "None", ""):
        return float(value)
    return PAPER_MU


def _target_arguments(p: argparse.ArgumentParser) -> None:
    from replayrl.experiments.statistics import PAPER_MU

    p.add_argument(
        "--target",
        type=number(float, "[0, 1]"),
        help="pass@1 to reach (default: on-policy's final median)",
    )
    p.add_argument(
        "--mu",
        type=number(float, "[0, inf)"),
        default=None,
        help="what-if μ, cost units shown beside the measured μ's (default: the config's "
        f"model.paper_mu, the paper's μ for the preset's model, else {PAPER_MU}; the paper "
        "measured 5.28 for Qwen2.5-7B and 6.84 for Qwen3-0.6B, §3.2)",
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """`replayrl compare`, `experiment` and `advise`."""
    cmp = one_line_errors(
        sub.add_parser(
            "compare", help="replay vs on-policy: plot, table and JSON from an MLflow experiment"
        )
    )
    cmp.add_argument(
        "--experiment", default="replayrl", help="MLflow experiment (default replayrl)"
    )
    _tracking_argument(cmp)
    _target_arguments(cmp)
    cmp.add_argument("--out", required=True, help="folder for comparison.{png,json,md}")
    _accuracy_arguments(cmp)
    cmp.add_argument(
        "--from-json",
        metavar="COMPARISON_JSON",
        help="no MLflow: restate a committed comparison.json with the current statistics "
        "(paired tests, crossing rules, smoothing) into --out",
    )
    cmp.add_argument(
        "--allow-mixed-hardware",
        action="store_true",
        help="compare lineages whose rollouts were generated on different accelerator models "
        "(their system.accelerator tags differ); refused by default: generation seconds are "
        "not comparable across GPU models",
    )
    cmp.set_defaults(func=_compare)
    _add_experiment_parser(sub)
    _add_advise_parser(sub)


def _accuracy_arguments(p: argparse.ArgumentParser) -> None:
    """Which accuracy a comparison reads, and final or peak values (compare, experiment)."""
    p.add_argument(
        "--metric",
        choices=("pass1", "pass1_sampled", "pass_at_k"),
        default="pass1",
        help="accuracy to compare: greedy eval/pass1 (default); eval/pass1_sampled, the "
        "paper's pass@1 at temperature 0.1 (logged when eval.pass1_temperature is set); or "
        "eval/pass_at_<k>",
    )
    p.add_argument(
        "--peak",
        action="store_true",
        help="report each seed's best value over the run (the paper's peaks), not the final one",
    )


def _add_experiment_parser(sub: argparse._SubParsersAction) -> None:
    exp = one_line_errors(
        sub.add_parser("experiment", help="run the arms for K seeds (inline), then compare them")
    )
    exp.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny-cpu.yaml")
    exp.add_argument(
        "--seeds", type=number(int, "[1, inf)"), default=3, help="seeds per arm (default 3)"
    )
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
    _target_arguments(exp)
    _accuracy_arguments(exp)
    exp.set_defaults(func=_experiment)


def _add_advise_parser(sub: argparse._SubParsersAction) -> None:
    adv = one_line_errors(
        sub.add_parser(
            "advise",
            help="buffer capacity and replay ratio of Theorem 4.5 from μ, ρ and α",
            description=ADVISE_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    # Finite here; `advise` checks each range in the theorem's words (μ >= 0, ρ in [0, 1],
    # α > 0) for the library's callers too.
    adv.add_argument(
        "--mu",
        type=number(float),
        help="μ = generation / training cost per rollout (default: measured in --experiment)",
    )
    adv.add_argument(
        "--experiment",
        help="MLflow experiment whose ledger gives μ (default replayrl) and B, S, G",
    )
    _tracking_argument(adv)
    adv.add_argument(
        "--rho",
        type=number(float),
        required=True,
        help="ρ in [0, 1]: correlation of replayed samples' gradient noise (Theorem 4.5)",
    )
    adv.add_argument(
        "--alpha",
        type=number(float),
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
