"""Kubeflow commands: `replayrl compile`, `preflight`, `submit` and `schedule`.

`submit` and `schedule create` run the preflight (`replayrl.kfp.preflight`) on the package
they are about to upload and stop, before anything is sent, when a check fails;
`--skip-preflight` leaves it out."""

from __future__ import annotations

import argparse
import os

from replayrl.cli.args import lineage_name, number, one_line_errors
from replayrl.errors import ReplayRLError


def _compile(args: argparse.Namespace) -> int:
    from replayrl.kfp import DEFAULT_IMAGE
    from replayrl.kfp.pipelines import compile_pipelines

    if args.config and not os.path.isfile(args.config):
        raise ReplayRLError(f"Config file '{args.config}' does not exist.")
    if args.config and args.image == DEFAULT_IMAGE:
        from replayrl.config import load_config

        if load_config(args.config).model.source != "tiny":
            raise ReplayRLError(
                f"compile --config {args.config} trains a real model: give the image your "
                f"cluster pulls, by digest (--image registry/replayrl@sha256:...); the default "
                f"{DEFAULT_IMAGE} is the tag of a local build, which no cluster can pull."
            )
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


def _public_text(text: str) -> str:
    """A config file's text as it may be sent to Kubeflow (which stores and shows it): with a
    tracking URI that carries credentials, the config as JSON without them."""
    import json

    import yaml

    from replayrl.kfp.pipelines import without_tracking_credentials

    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # refused with its own message when the config is checked
    public = without_tracking_credentials(tree) if isinstance(tree, dict) else tree
    return text if public is tree else json.dumps(public, default=str)


def _run_params(
    args: argparse.Namespace,
) -> tuple[dict[str, str], str | None, str | None, str | None]:
    """Pipeline parameters from the flags, the local config file (if any) whose
    `kubernetes:` section sets the pods, the service account runs use (that section's
    `service_account`; None: the namespace's default) and the run root (None where the
    config is a URI only the pipeline reads). A local config is checked before anything is
    sent."""
    from replayrl.config import KubernetesConfig
    from replayrl.kfp.runtime import resolve

    params: dict[str, str] = {}
    config_file = None
    if args.config:
        if os.path.isfile(args.config):
            config_file = args.config
            params["config"] = _public_text(open(args.config).read())
        elif "://" in args.config:
            params["config"] = args.config  # read by the pipeline's first step
        else:
            raise ReplayRLError(
                f"Config file '{args.config}' does not exist; pass a YAML file or an s3:// URI."
            )
    for key in ("arm", "lineage", "model_id", "dataset_id"):
        if getattr(args, key, None):
            params[key] = getattr(args, key)
    service_account = KubernetesConfig().service_account
    run_root = args.run_root
    if config_file or not args.config:
        # Fail here, not in a pod: the config must load with this run's parameters.
        # The run root is not touched (the preflight checks it, unless skipped).
        cfg = resolve(
            params.get("config", ""),
            arm=params.get("arm", ""),
            lineage=params.get("lineage", ""),
            run_root=run_root or "",
            model_id=params.get("model_id", ""),
            dataset_id=params.get("dataset_id", ""),
        )
        service_account = cfg.kubernetes.service_account
        run_root = cfg.storage.run_root
    if not run_root:
        raise ReplayRLError(
            f"The config '{args.config}' is read by the pipeline, not here: pass --run-root "
            f"s3://bucket/prefix (the pipelines' run_root_s3_uri parameter has no default)."
        )
    # The pipelines' run root parameter is required: the config's, unless --run-root.
    params["run_root_s3_uri"] = run_root
    return params, config_file, service_account or None, run_root


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

    from replayrl.kfp.client import pipeline_name, submit

    params, config_file, service_account, run_root = _run_params(args)
    run_name = (
        args.run_name or f"{params.get('lineage', 'replayrl')}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    with tempfile.TemporaryDirectory(prefix="replayrl-compile-") as tmp:
        package = _package(args, args.pipeline, config_file, tmp)
        name = args.pipeline_name or pipeline_name(package, f"replay-{args.pipeline}")
        conn = _connection(args)
        if not args.skip_preflight:
            _preflight_or_stop(args, conn, package, service_account, run_root)
        result = submit(
            conn,
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

    from replayrl.kfp.client import normalize_cron, pipeline_name, schedule, set_enabled

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
    params, config_file, service_account, run_root = _run_params(args)
    job = args.name or f"{params.get('lineage', 'replayrl')}-recurring"
    with tempfile.TemporaryDirectory(prefix="replayrl-compile-") as tmp:
        package = _package(args, "iteration", config_file, tmp)
        name = args.pipeline_name or pipeline_name(package, "replay-iteration")
        if not args.skip_preflight:
            _preflight_or_stop(args, conn, package, service_account, run_root)
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


def _preflight_checks(args, conn, package, service_account: str | None, run_root: str | None):
    """Run the preflight on `package` in the namespace runs go to; print each check."""
    from replayrl.kfp import preflight, preflight_kube

    namespace = conn.namespace or preflight_kube.kube_namespace(args.kubeconfig, args.context)
    if not namespace:
        raise ReplayRLError(
            "The preflight needs the namespace runs go to: pass --namespace (or set "
            "KF_PIPELINES_NAMESPACE, or a namespace in your kubeconfig context)."
        )
    target = preflight.Target(
        namespace=namespace,
        service_account=service_account,
        run_root=run_root,
        needs=preflight.needs_of(package),
    )
    checks = preflight.run(conn, target, kubeconfig=args.kubeconfig, context=args.context)
    for check in checks:
        print(check.render())
    return checks


def _preflight_or_stop(args, conn, package, service_account, run_root) -> None:
    from replayrl.kfp.preflight import failures

    failed = failures(_preflight_checks(args, conn, package, service_account, run_root))
    if failed:
        raise ReplayRLError(
            f"Preflight: {failed} check(s) failed (✗ above); nothing was submitted. Fix them, "
            f"or pass --skip-preflight to submit anyway."
        )


def _preflight(args: argparse.Namespace) -> int:
    import tempfile

    from replayrl.kfp.preflight import failures

    params, config_file, service_account, run_root = _run_params(args)
    with tempfile.TemporaryDirectory(prefix="replayrl-compile-") as tmp:
        package = _package(args, args.pipeline, config_file, tmp)
        checks = _preflight_checks(args, _connection(args), package, service_account, run_root)
    failed = failures(checks)
    print(f"preflight: {failed} check(s) failed" if failed else "preflight: ready to submit")
    return 1 if failed else 0


def _add_kube_arguments(p: argparse.ArgumentParser, *, skippable: bool) -> None:
    p.add_argument(
        "--kubeconfig",
        help="kubeconfig of the cluster, for the preflight (default: $KUBECONFIG, "
        "~/.kube/config, else the pod's own service account)",
    )
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    if skippable:
        p.add_argument(
            "--skip-preflight",
            action="store_true",
            help="submit without the preflight checks (`replayrl preflight`)",
        )


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
        help="auth cookies, e.g. oauth2_proxy=... (default: $KF_PIPELINES_COOKIES)",
    )
    p.add_argument("--experiment", default="replayrl", help="KFP experiment (default: replayrl)")
    if not run_params:
        return
    p.add_argument(
        "--config",
        help="YAML file (sent as text; its kubernetes: section sets the pods) or s3:// URI",
    )
    p.add_argument("--arm", help="replay | on-policy | replay-plain (default: the config's)")
    p.add_argument("--lineage", type=lineage_name, help="lineage name (default: the config's)")
    p.add_argument(
        "--run-root",
        help="s3://bucket/prefix, the run_root_s3_uri parameter (default: the config's)",
    )
    p.add_argument("--model-id", help="the model to train (default: the config's model.source)")
    p.add_argument("--dataset-id", help="the prompts' dataset (default: the config's task.path)")
    p.add_argument(
        "--pipeline-name",
        help="name of the uploaded pipeline (default: the package's own, e.g. replay-loop)",
    )
    p.add_argument("--package", help="upload this compiled YAML instead of compiling now")
    p.add_argument(
        "--image", default=DEFAULT_IMAGE, help=f"image of every step (default {DEFAULT_IMAGE})"
    )
    p.add_argument(
        "--iterations",
        type=number(int, "[1, inf)"),
        default=DEFAULT_ITERATIONS,
        help="iterations of replay_loop",
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """`replayrl compile`, `preflight`, `submit` and `schedule`."""
    from replayrl.kfp import DEFAULT_IMAGE, DEFAULT_ITERATIONS

    comp = one_line_errors(sub.add_parser("compile", help="write the Kubeflow pipeline YAML"))
    comp.add_argument(
        "--out", default="pipelines/compiled", help="folder (default: pipelines/compiled)"
    )
    comp.add_argument(
        "--iterations",
        type=number(int, "[1, inf)"),
        default=DEFAULT_ITERATIONS,
        help=f"iterations replay_loop unrolls (default {DEFAULT_ITERATIONS})",
    )
    comp.add_argument(
        "--image", default=DEFAULT_IMAGE, help=f"image of every step (default {DEFAULT_IMAGE})"
    )
    comp.add_argument("--config", help="YAML file: default `config` parameter and pod settings")
    comp.set_defaults(func=_compile)

    pre = sub.add_parser(
        "preflight",
        help="check that a namespace can run the pipeline (read-only); exit 1 on any ✗",
        description="Check, with read-only Kubernetes and KFP calls, that runs of the "
        "pipeline can start and commit in --namespace: the KFP backend's version, the service account, the Secrets "
        "and ConfigMaps the pods read, kfp-launcher, GPU nodes for the accelerator pods, the "
        "run root's S3 store (two probe objects written and deleted) and the image reference. "
        "Each check prints ✓, or ✗ and a line saying what to create or fix.",
    )
    one_line_errors(pre)
    pre.add_argument("--pipeline", choices=["loop", "iteration"], default="loop")
    _add_kfp_arguments(pre, run_params=True)
    _add_kube_arguments(pre, skippable=False)
    pre.set_defaults(func=_preflight)

    subm = one_line_errors(
        sub.add_parser("submit", help="upload a pipeline (or new version) and start a run")
    )
    subm.add_argument("--pipeline", choices=["loop", "iteration"], default="loop")
    subm.add_argument("--run-name", help="run name (default: <lineage>-<time>)")
    _add_kfp_arguments(subm, run_params=True)
    _add_kube_arguments(subm, skippable=True)
    subm.set_defaults(func=_submit)

    sch = one_line_errors(
        sub.add_parser("schedule", help="recurring runs of replay_iteration: create, pause, resume")
    )
    sch.add_argument("action", choices=["create", "pause", "resume"])
    sch.add_argument(
        "--cron", help="cron, 5 fields ('0 * * * *' = hourly) or KFP's 6 (seconds first)"
    )
    sch.add_argument("--name", help="recurring run name (default: <lineage>-recurring)")
    sch.add_argument("--id", help="recurring run id (pause/resume)")
    _add_kfp_arguments(sch, run_params=True)
    _add_kube_arguments(sch, skippable=True)
    sch.set_defaults(func=_schedule)
