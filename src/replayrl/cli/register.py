"""`replayrl register`: register one full checkpoint of a lineage as an MLflow model version."""

from __future__ import annotations

import argparse

from replayrl.cli.args import lineage_name, number, one_line_errors
from replayrl.errors import ReplayRLError


def _register(args: argparse.Namespace) -> int:
    from replayrl import storage
    from replayrl.config import tracking_uri_from_env
    from replayrl.engine.lineage import config_from_dict_safe
    from replayrl.engine.models import register
    from replayrl.engine.stores import make_tracker

    paths = storage.lineage_paths(args.run_root, args.lineage)
    state = storage.read_state(paths)
    if state is None:
        raise ReplayRLError(f"No lineage '{args.lineage}' under '{args.run_root}' (no state.json).")
    if not state.mlflow_run_id or not (state.tracking_uri or tracking_uri_from_env()):
        raise ReplayRLError(f"Lineage '{args.lineage}' has no MLflow run recorded in its state.")
    cfg = config_from_dict_safe(paths)
    if cfg is None:
        raise ReplayRLError(
            f"Lineage '{args.lineage}' has no readable config.yaml at {paths.config}."
        )
    tracker = make_tracker(cfg, state.tracking_uri or tracking_uri_from_env() or "")
    mv = register(
        tracker,
        paths,
        state,
        name=args.name or args.lineage,
        alias=args.alias or None,
        version=args.version,
        best=args.best,
    )
    alias = f" (alias '{args.alias}')" if args.alias else ""
    print(f"{mv.name} version {mv.version}{alias}: checkpoint v{mv.tags['policy_version']}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "register",
        help="register a lineage's full checkpoint as an MLflow model version",
        description="Register one full checkpoint of a lineage (its logged model in the "
        "lineage's MLflow run) as a version of a registered model, tagged with the lineage, "
        "config hash, buffer versions and hub revisions, and point an alias at it. Without "
        "--version or --best: the lineage's last full checkpoint. Registering the same "
        "checkpoint again gives the same version.",
    )
    one_line_errors(p)
    p.add_argument("--run-root", required=True, help="the lineage's run root")
    p.add_argument("--lineage", required=True, type=lineage_name, help="the lineage's name")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--version", type=number(int, "[0, inf)"), help="the checkpoint's policy version"
    )
    which.add_argument(
        "--best",
        metavar="METRIC",
        help="the checkpoint (still under the run root) with the highest value of this "
        "evaluation metric, e.g. eval/pass1",
    )
    p.add_argument("--name", help="registered model name (default: the lineage's name)")
    p.add_argument("--alias", default="candidate", help="alias to set ('' = none)")
    p.set_defaults(func=_register)
