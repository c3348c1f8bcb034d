"""A sweep (`replayrl.experiments.sweep`) on Kubeflow: one `replay_loop` run per point.

`replay_loop` is compiled once per distinct (iterations, image, `kubernetes:` section) of the
points; every run passes its point's whole config as the `config` parameter (one line of
JSON, tracking credentials removed: Kubeflow stores and shows it), its lineage and the run
root, and `replayrl.kfp.client.submit` uploads each distinct package once (a version named
by its content hash). Asynchronous points are refused: on Kubeflow an asynchronous lineage
runs as recurring `async_segment` runs, not as one run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from replayrl.config import RunConfig
from replayrl.errors import ReplayRLError
from replayrl.experiments.seeds import finished
from replayrl.experiments.sweep import Sweep, say, write_manifest


@dataclass(frozen=True)
class PlannedRun:
    lineage: str
    package: Path  # the compiled replay_loop YAML this run uses
    params: dict[
        str, str
    ]  # the pipeline's parameters: config (JSON text), lineage, run_root_s3_uri
    service_account: str | None


def public_config(cfg: RunConfig) -> str:
    """A point's whole config as one line of JSON (which is YAML) without tracking
    credentials, for the pipeline's `config` parameter."""
    from replayrl.kfp.pipelines import without_tracking_credentials

    return json.dumps(without_tracking_credentials(cfg.to_dict()), default=str)


def _compile_loop(cfg: RunConfig, out: Path, *, image: str) -> Path:
    """`replay_loop` for `cfg`'s iterations and pods, default config empty (each run passes
    its own), written to `out/replay_loop.yaml` (only after it compiled and fits)."""
    from kfp import compiler

    from replayrl.kfp.pipelines import LOOP_FILE, check_spec_size, replay_loop_pipeline

    pipeline = replay_loop_pipeline(iterations=cfg.iterations, image=image, k8s=cfg.kubernetes)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="replayrl-sweep-") as tmp:
        draft = Path(tmp) / LOOP_FILE
        compiler.Compiler().compile(pipeline, str(draft))
        check_spec_size(draft, name=LOOP_FILE, iterations=cfg.iterations, k8s=cfg.kubernetes)
        shutil.copyfile(draft, out / LOOP_FILE)
    return out / LOOP_FILE


def plan_kubeflow(sweep: Sweep, *, packages_dir: str | Path, image: str) -> list[PlannedRun]:
    """Compile `replay_loop` once per distinct (iterations, image, `kubernetes:` section) of
    the points, into `packages_dir/<hash>/`, and the parameters of one run per point (also
    written to `packages_dir/runs.json`)."""
    if "://" not in sweep.run_root:
        raise ReplayRLError(
            f"A sweep on Kubeflow needs a run root the pods share, e.g. --run-root "
            f"s3://bucket/sweeps; got '{sweep.run_root}'."
        )
    asynchronous = [p.lineage for p in sweep.points if p.config.asynchronous.enabled]
    if asynchronous:
        raise ReplayRLError(
            f"{asynchronous[0]} is asynchronous: on Kubeflow an asynchronous lineage runs as "
            f"recurring async_segment runs (`replayrl schedule`), not one run per point; run "
            f"the (W, T) grid here (without --kubeflow) or schedule its lineages."
        )
    compiled: dict[str, Path] = {}
    planned = []
    for p in sweep.points:
        k8s = p.config.to_dict()["kubernetes"]
        key = hashlib.sha256(
            json.dumps([p.config.iterations, image, k8s], sort_keys=True, default=str).encode()
        ).hexdigest()[:12]
        if key not in compiled:
            compiled[key] = _compile_loop(p.config, Path(packages_dir) / key, image=image)
        planned.append(
            PlannedRun(
                lineage=p.lineage,
                package=compiled[key],
                params={
                    "config": public_config(p.config),
                    "lineage": p.lineage,
                    "run_root_s3_uri": sweep.run_root,
                },
                service_account=p.config.kubernetes.service_account or None,
            )
        )
    Path(packages_dir).mkdir(parents=True, exist_ok=True)
    (Path(packages_dir) / "runs.json").write_text(
        json.dumps(
            [
                {"lineage": r.lineage, "package": str(r.package), "params": r.params}
                for r in planned
            ],
            indent=2,
        )
    )
    return planned


def submit_kubeflow(
    sweep: Sweep, runs: list[PlannedRun], *, connection, experiment: str, pipeline_name: str
) -> list[str]:
    """Submit the planned runs in point order; the run ids. A point whose lineage already
    finished (when its run root is readable from here) is not submitted again."""
    from replayrl.kfp.client import submit

    write_manifest(sweep)
    ids = []
    for p, run in zip(sweep.points, runs, strict=True):
        try:
            done = finished(p.config)
        except ReplayRLError:  # the cluster's run root may be unreachable from here
            done = False
        if done:
            say(f"{p.lineage}: finished earlier, not submitted")
            continue
        result = submit(
            connection,
            package=run.package,
            pipeline_name=pipeline_name,
            experiment=experiment,
            run_name=f"{p.lineage}-{time.strftime('%Y%m%d-%H%M%S')}",
            params=run.params,
            service_account=run.service_account,
        )
        say(f"{p.lineage}: run {result.run_id}")
        ids.append(result.run_id)
    return ids
