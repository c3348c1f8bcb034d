"""What the cluster self-test (`replayrl_smoke`, built in `replayrl.kfp.smoke`) checks inside
its two pods, which get the namespace's Secrets and ConfigMaps as the real tasks do.

The CPU pod (`namespace_checks`): the config resolves with the run's run root; which of the
variables the pods take from Secrets and ConfigMaps are set (names only); the run root is
writable and its store honours conditional writes (`preflight.check_run_root`, i.e.
`storage.ensure_writable`, the probe every lineage runs: two small probe objects, deleted at
once); the MLflow store the config's tracking settings name answers (`stores.make_tracker`,
as a lineage connects, with short HTTP timeouts; it creates the experiment when it is
missing, as the first lineage would); and, only where `HF_TOKEN` is set, the hub accepts it
(a whoami call; nothing is downloaded).

The GPU pod (`gpu_checks`): CUDA (torch sees as many GPUs as the pod asked for; their names
and memory) and the NVIDIA driver (`nvidia-smi` or /proc) against the minimum of torch's CUDA
(`replayrl.policy.gpu`).

Each check is one line, `✓`/`✗`/`?` as in `replayrl preflight` (`preflight.Check`). `finish`
prints every line, writes them to the task's Markdown and a 1/0 per check to its Metrics, and
then fails the task when a check failed (✗), naming the failures on the last line: a
self-test's run fails when the namespace is not ready. A finding that does not fail it is `?`.
Outside a KFP pod (kfp.local, a direct call) the GPU task probes this machine, not a GPU
node, so there "no GPU" is a `?` finding and the task succeeds.

Knows nothing about pipelines or pod settings; imports no `kfp` module.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from replayrl import logs
from replayrl.errors import ReplayRLError
from replayrl.kfp import runtime
from replayrl.kfp.preflight import FAILED, OK, UNCHECKED, Check, check_run_root
from replayrl.policy import gpu

# (metric key, check): the key names the check in the task's Metrics.
Finding = tuple[str, Check]

# MLflow's HTTP client waits 120 s per request and retries 7 times with backoff: minutes
# before an unreachable server is reported. The self-test waits this long, once retried.
MLFLOW_TIMEOUTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}
HF_TOKEN_ENV = "HF_TOKEN"


# ---------------------------------------------------------------- the CPU pod


def namespace_checks(
    config: str, run_root: str, sources: str, environ: MutableMapping[str, str]
) -> list[Finding]:
    """The CPU pod's checks, for the pipeline's `config` and `run_root_s3_uri` parameters;
    `sources`: JSON, the Secrets and ConfigMaps the pod takes variables from, and which
    (`environment_check`)."""
    try:
        cfg = runtime.resolve(config, run_root=run_root)
    except ReplayRLError as e:
        return [("config", Check.failed("config", e))]
    root = cfg.storage.run_root
    return [
        ("config", Check(OK, f"config: loads; run root {root}")),
        ("environment", environment_check(json.loads(sources or "{}"), environ)),
        ("bucket", check_run_root(root)),
        ("mlflow", mlflow_check(cfg, environ)),
        ("hub_token", hub_token_check(environ)),
    ]


def environment_check(sources: Mapping[str, list[str]], environ: Mapping[str, str]) -> Check:
    """Which variables of each source the pod takes them from (`sources`: "Secret replayrl-s3"
    -> its variables) are set in this pod (names only, never values): a Secret or a key
    that is missing shows here as unset."""
    parts = []
    for source, names in sources.items():
        present = [env for env in names if environ.get(env)]
        absent = [env for env in names if not environ.get(env)]
        said = f"{source}: {', '.join(present) or 'none'} set"
        parts.append(said + (f" ({', '.join(absent)} unset)" if absent else ""))
    return Check(OK, "environment: " + ("; ".join(parts) or "no Secret or ConfigMap configured"))


@contextlib.contextmanager
def short_http_timeouts(environ: MutableMapping[str, str]) -> Iterator[None]:
    """`MLFLOW_TIMEOUTS` where the pod does not set its own, for the duration."""
    added = {k: v for k, v in MLFLOW_TIMEOUTS.items() if not environ.get(k)}
    environ.update(added)
    try:
        yield
    finally:
        for key in added:
            environ.pop(key, None)


def mlflow_check(cfg: Any, environ: MutableMapping[str, str]) -> Check:
    """The tracking store a lineage of `cfg` would log to, connected to as a lineage does."""
    from replayrl.engine import stores

    try:
        uri = stores.tracking_uri(cfg)
        with short_http_timeouts(environ):
            tracker = stores.make_tracker(cfg, uri)
    except ReplayRLError as e:
        return Check.failed("MLflow", e)
    return Check(
        OK,
        f"MLflow {tracker.uri}: experiment {cfg.tracking.experiment!r} "
        f"(id {tracker.experiment_id})",
    )


def hub_token_check(environ: Mapping[str, str]) -> Check:
    """Whether the hub accepts `HF_TOKEN`; not set: `?` (public repositories only). No call
    is made without a token, or with the hub offline (`HF_HUB_OFFLINE`)."""
    token = environ.get(HF_TOKEN_ENV, "").strip()
    if not token:
        return Check(
            UNCHECKED,
            "hub token: HF_TOKEN not set: public Hugging Face repositories only",
            "for a gated or private model or dataset, put HF_TOKEN in the kubernetes.hf_secret "
            "Secret",
        )
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        return Check(UNCHECKED, "hub token: HF_TOKEN is set; not checked: HF_HUB_OFFLINE is on")
    fix = "put a valid token (huggingface.co/settings/tokens) in the kubernetes.hf_secret Secret"
    try:
        who = HfApi().whoami(token=token)
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            return Check(FAILED, f"hub token: the hub refuses HF_TOKEN ({status})", fix)
        return Check(FAILED, f"hub token: the hub answered {status} to whoami", fix)
    except Exception as e:  # httpx's connection errors: no route to the hub from this pod
        shown = logs.redact(" ".join(str(e).split())[:200], secrets=[token])
        return Check(
            FAILED,
            f"hub token: the hub is not reachable from this pod ({e.__class__.__name__}: {shown})",
            "allow the pods egress to huggingface.co (or HF_ENDPOINT), or load models and data "
            "from s3:// (model.source, task.path)",
        )
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    return Check(OK, f"hub token: HF_TOKEN is {who.get('name')}'s" + (f" ({role})" if role else ""))


# ---------------------------------------------------------------- the GPU pod


def gpu_checks(requested: int, environ: Mapping[str, str]) -> list[Finding]:
    """The GPU pod's checks: CUDA serves the `requested` GPUs, and the NVIDIA driver. A
    problem is ✗ in a KFP pod that asked for GPUs, a `?` finding elsewhere."""
    found = gpu.Found.probe()
    required = requested > 0 and bool(environ.get(runtime.POD_ENV))
    miss = FAILED if required else UNCHECKED
    where = "" if required else _not_required(requested)
    asked = max(requested, 1)
    reason = gpu.problem(asked, found)
    if reason is None:
        cuda = Check(
            OK,
            f"CUDA: torch {found.torch_version} (CUDA {found.torch_cuda}) sees "
            f"{found.device_count} GPU(s), {requested} asked: {device_names(found.device_count)}",
        )
    else:
        what, _, fix = reason.partition(". ")
        if not found.available:
            # the build only: the driver has its own line
            what = "no GPU: " + what.split(": ", 1)[-1].split("; ")[0]
        cuda = Check(miss, f"{what}{where}", fix.rstrip("."))
    return [
        ("cuda", cuda),
        ("driver", _driver_check(found, miss if not found.available else UNCHECKED)),
    ]


def _not_required(requested: int) -> str:
    if requested <= 0:
        return " (the config's pods ask for no GPU: kubernetes.*_gpus are 0)"
    return " (outside a KFP pod, e.g. kfp.local, this machine was probed: a finding, not a failure)"


def _driver_check(found: gpu.Found, miss: str) -> Check:
    needed = gpu.minimum_driver(found.cuda)
    if found.driver is None:
        return Check(
            miss,
            "NVIDIA driver: none found (no nvidia-smi, no /proc/driver/nvidia/version)",
            "run on a GPU node with the NVIDIA container runtime (the NVIDIA GPU operator)",
        )
    if needed and gpu.driver_older(found.driver, needed):
        warning = gpu.driver_warning(found)
        if warning:  # CUDA works (a forward-compatibility package): a finding
            return Check(UNCHECKED, warning)
        return Check(
            miss,
            f"NVIDIA driver {found.driver} is older than {needed}, the minimum for CUDA {found.cuda}",
            "upgrade the node's driver, or use nodes with a newer one (kubernetes.gpu_node_selector)",
        )
    return Check(
        OK,
        f"NVIDIA driver {found.driver}"
        + (f" (CUDA {found.cuda} needs >= {needed})" if needed else ""),
    )


def device_names(count: int) -> str:
    """'8 x NVIDIA H200 (140 GiB)': the GPUs torch sees, by name and memory."""
    import torch

    seen = Counter(
        f"{torch.cuda.get_device_name(i)} "
        f"({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
        for i in range(count)
    )
    return ", ".join(f"{n} x {name}" for name, n in seen.items())


# ---------------------------------------------------------------- the task's outputs


def finish(findings: list[Finding], report: Any, metrics: Any, *, title: str) -> None:
    """Print every check, write them to `report` (a KFP Markdown artifact) and 1/0 per
    decided check to `metrics` (`?` is left out; `failed` counts the ✗), then raise one
    ReplayRLError naming the failed checks, if any. (KFP keeps a failed task's log, not its
    output artifacts: the log lists every check.)"""
    for _, check in findings:
        print(check.render(), flush=True)
    lines = [f"### {title}", ""]
    for _, check in findings:
        lines.append(f"- {check.status} {check.line}")
        if check.fix:
            lines.append(f"  - → {check.fix}")
    with open(report.path, "w") as f:
        f.write("\n".join(lines) + "\n")
    failed = [key for key, check in findings if check.status == FAILED]
    for key, check in findings:
        if check.status != UNCHECKED:
            metrics.log_metric(key, 1.0 if check.status == OK else 0.0)
    metrics.log_metric("failed", float(len(failed)))
    if failed:
        raise ReplayRLError(
            f"self-test: {len(failed)} of {len(findings)} checks failed ({', '.join(failed)}); "
            "the ✗ lines above say what was found and how to fix it."
        )


def drop_gpu_guard(environ: MutableMapping[str, str]) -> None:
    """The GPU task probes CUDA itself and lists what it finds: the pods' guard
    (`REPLAYRL_REQUIRE_GPU`, `gpu.check_pod`) would stop it at the first problem."""
    environ.pop(gpu.REQUIRE_GPU_ENV, None)
