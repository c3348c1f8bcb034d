"""A lineage's checkpoints in MLflow: each full checkpoint a logged model of the lineage's run,
one of them registered as a model version, and a registered version loaded back.

- `log_checkpoint_model`: the full checkpoint `v000003` of lineage `alpha` becomes the logged
  model `alpha-v000003` of the lineage's run, output at the checkpoint's gradient step, with
  the evaluation metrics the run has at that step linked to it (so the run's "Logged models"
  tab lists the lineage's checkpoints with their pass@1). It refers to the checkpoint under
  the run root (the `checkpoint` tag; a small `replayrl-checkpoint.json` artifact says the
  same): the weights are not copied into MLflow's artifact store unless
  `tracking.copy_models` says so. Exactly once: the model is looked up by name and run before
  it is created, and a model a crash left PENDING is finished, not made again.
- `register`: one logged model registered as a version of a registered model, tagged with
  the lineage, run root, config hash, buffer versions and hub revisions, and aliased.
  Registering the same checkpoint twice gives the version made the first time.
- `load_registered`: the local folder of a registered version's weights and tokenizer, the
  folder `from_pretrained` reads, every file checked against its checkpoint's sha256.

A checkpoint pruned by `train.keep_checkpoints` keeps its logged model (its metrics stay
comparable) but, unless copied, can no longer be registered or loaded: `register` refuses it
with the fix. Knows nothing about models' contents: it moves folders and tags.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from replayrl import storage
from replayrl.config import temp_root
from replayrl.engine.tracking import Tracker, connect_uri
from replayrl.errors import ReplayRLError
from replayrl.storage import LineagePaths, LineageState

log = logging.getLogger(__name__)
MODEL_TYPE = "replayrl-policy"
REFERENCE_FILE = "replayrl-checkpoint.json"
# Metrics of the run linked to a checkpoint's logged model: its evaluation at its step.
LINKED_PREFIX = "eval/"
# Run params copied onto a registered version: the commits hub names resolved to.
HUB_PARAM_PREFIX = "hub."


def model_name(lineage: str, policy_version: int) -> str:
    """`alpha-v000003`: the lineage and the checkpoint's folder name. A '.' of the lineage's
    name (`lr0.001`, allowed: `storage.check_lineage_name`) is '_' here: MLflow refuses it
    in a logged model's name."""
    return f"{lineage.replace('.', '_')}-v{policy_version:06d}"


def find_checkpoint_model(tracker: Tracker, *, run_id: str, name: str):
    """The logged model `name` of run `run_id`, or None. Lineages of one name in two run roots
    may share an experiment, so the run is compared too."""
    from mlflow.entities import LoggedModelStatus

    found = [
        m
        for m in _search(tracker, f"name = '{name}'")
        if m.source_run_id == run_id and m.status != LoggedModelStatus.FAILED
    ]
    # Only one is ever made (the lineage's lease); the oldest, should a store hold two.
    return min(found, key=lambda m: (m.creation_timestamp, m.model_id), default=None)


def checkpoint_models(tracker: Tracker, run_id: str) -> list:
    """The run's finished checkpoint models, oldest checkpoint first."""
    from mlflow.entities import LoggedModelStatus

    found = [
        m
        for m in _search(tracker, f"source_run_id = '{run_id}'")
        if m.model_type == MODEL_TYPE and m.status == LoggedModelStatus.READY
    ]
    return sorted(found, key=lambda m: int(m.tags["policy_version"]))


def _search(tracker: Tracker, filter_string: str) -> list:
    out, token = [], None
    while True:
        page = tracker.client.search_logged_models(
            [tracker.experiment_id], filter_string=filter_string, page_token=token
        )
        out += list(page)
        token = page.token
        if not token:
            return out


def log_checkpoint_model(
    tracker: Tracker,
    paths: LineagePaths,
    *,
    run_id: str,
    checkpoint: dict,
    step: int,
    copy: bool = False,
) -> str:
    """Record full checkpoint `checkpoint` (its record in `state.json`) as a logged model of
    run `run_id` at gradient step `step`; returns its model id. Idempotent: a finished model is
    left as it is; a PENDING one (the last call died half-way) is finished. Called after the
    state points at the checkpoint, and again when a lineage is opened, so a crash in between
    loses nothing."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric

    version = int(checkpoint["policy_version"])
    uri = paths.checkpoint(version)
    name = model_name(_lineage(paths), version)
    model = find_checkpoint_model(tracker, run_id=run_id, name=name)
    if model is not None and model.status == LoggedModelStatus.READY:
        return model.model_id
    if model is None:
        run = tracker.client.get_run(run_id)
        tags = {
            **{k: run.data.tags[k] for k in ("run_root", "lineage", "config_hash")},
            "checkpoint": uri,
            "policy_version": str(version),
            "iteration": str(checkpoint["iteration"]),
            "rollouts_version": _tag(checkpoint.get("rollouts_version")),
            "usage_version": _tag(checkpoint.get("usage_version")),
            "copied": str(copy).lower(),
            **{k: v for k, v in run.data.params.items() if k.startswith(HUB_PARAM_PREFIX)},
        }
        model = tracker.client.create_logged_model(
            tracker.experiment_id, name=name, source_run_id=run_id, tags=tags, model_type=MODEL_TYPE
        )
    model_id = model.model_id
    _log_artifacts(tracker, model_id, uri, copy=copy)
    run = tracker.client.get_run(run_id)
    outputs = run.outputs.model_outputs if run.outputs else []
    if not any(o.model_id == model_id for o in outputs):
        tracker.client.log_outputs(run_id, [LoggedModelOutput(model_id, step=step)])
    linked = {(m.key, m.step, m.timestamp) for m in model.metrics or []}
    metrics = [
        Metric(m.key, m.value, m.timestamp, m.step, run_id=run_id, model_id=model_id)
        for key in sorted(run.data.metrics)
        if key.startswith(LINKED_PREFIX)
        for m in tracker.client.get_metric_history(run_id, key)
        if m.step == step and (m.key, m.step, m.timestamp) not in linked
    ]
    if metrics:
        tracker.client.log_batch(run_id, metrics=metrics)
    tracker.client.finalize_logged_model(model_id, LoggedModelStatus.READY)
    log.info("checkpoint v%d logged as MLflow model %s (%s)", version, name, model_id)
    return model_id


def _tag(value: object) -> str:
    return "none" if value is None else str(value)


def _log_artifacts(tracker: Tracker, model_id: str, uri: str, *, copy: bool) -> None:
    """The reference file, and with `copy` the checkpoint's weights and tokenizer (never its
    training state), uploaded to the model's artifact location. Safe to repeat."""
    with tempfile.TemporaryDirectory(prefix="replayrl-model-", dir=temp_root()) as tmp:
        folder = Path(tmp)
        manifest = storage.read_manifest(uri)
        reference = {"checkpoint": uri, "files": manifest.files_uri}
        (folder / REFERENCE_FILE).write_text(json.dumps(reference, indent=2) + "\n")
        if copy:
            local = storage.checkpoint_local_dir(uri, folder / ".cache", weights_only=True)
            for f in sorted(local.iterdir()):
                if f.is_file() and not storage.is_training_state(f.name) and f.name[0] != ".":
                    shutil.copyfile(f, folder / f.name)
            shutil.rmtree(folder / ".cache", ignore_errors=True)
        tracker.client.log_model_artifacts(model_id, str(folder))


def register(
    tracker: Tracker,
    paths: LineagePaths,
    state: LineageState,
    *,
    name: str,
    alias: str | None = "candidate",
    version: int | None = None,
    best: str | None = None,
):
    """Register one checkpoint model of the lineage as a version of registered model `name`
    and point `alias` at it; returns the ModelVersion. Which checkpoint: `version` (a policy
    version), else the one whose logged model has the highest value of metric `best` (among
    checkpoints still under the run root, or copied), else the lineage's last full
    checkpoint."""
    from mlflow.exceptions import MlflowException

    run_id = state.mlflow_run_id
    if state.checkpoint is not None:  # a lineage whose last checkpoint was never logged
        ck = state.checkpoint
        log_checkpoint_model(
            tracker,
            paths,
            run_id=run_id,
            checkpoint=ck,
            step=_step(tracker, run_id, ck),
            copy=False,
        )
    models = checkpoint_models(tracker, run_id)
    model = _choose(models, paths, state, version=version, best=best)
    tags = {
        **model.tags,
        "model_id": model.model_id,
        "run_id": run_id,
    }
    try:
        tracker.client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    existing = [
        mv
        for mv in tracker.client.search_model_versions(f"name = '{name}'")
        if mv.tags.get("model_id") == model.model_id
    ]
    if existing:
        mv = min(existing, key=lambda v: int(v.version))
    else:
        mv = tracker.client.create_model_version(
            name,
            source=model.artifact_location,
            run_id=run_id,
            tags=tags,
            model_id=model.model_id,
        )
    if alias:
        tracker.client.set_registered_model_alias(name, alias, mv.version)
    log.info(
        "registered %s (checkpoint v%s of %s) as %s version %s%s",
        model.name,
        model.tags["policy_version"],
        _lineage(paths),
        name,
        mv.version,
        f" @{alias}" if alias else "",
    )
    return mv


def _step(tracker: Tracker, run_id: str, checkpoint: dict) -> int:
    """The gradient step of `checkpoint`: where the run logged its iteration marker."""
    t = int(checkpoint["iteration"])
    for m in tracker.client.get_metric_history(run_id, "iteration"):
        if int(m.value) == t:
            return m.step
    return t


def _choose(models: list, paths: LineagePaths, state: LineageState, *, version, best):
    def usable(m) -> bool:
        return m.tags.get("copied") == "true" or storage.is_complete(m.tags["checkpoint"])

    listed = ", ".join(f"v{m.tags['policy_version']}" for m in models) or "none"
    if version is not None:
        chosen = [m for m in models if int(m.tags["policy_version"]) == version]
        if not chosen:
            raise ReplayRLError(
                f"Lineage '{_lineage(paths)}' has no logged full checkpoint v{version} "
                f"(logged: {listed}). Pick one of those with --version."
            )
        model = chosen[0]
    elif best is not None:
        scored = [(m, _last_value(m, best)) for m in models if usable(m)]
        scored = [(m, v) for m, v in scored if v is not None]
        if not scored:
            raise ReplayRLError(
                f"No checkpoint of lineage '{_lineage(paths)}' still under the run root has "
                f"metric '{best}' (logged checkpoints: {listed}). Name an evaluation metric, "
                "e.g. --best eval/pass1, or pick one with --version."
            )
        model = max(scored, key=lambda mv: (mv[1], int(mv[0].tags["policy_version"])))[0]
    else:
        newest = state.checkpoint["policy_version"] if state.checkpoint else None
        chosen = [m for m in models if int(m.tags["policy_version"]) == newest]
        if not chosen:
            raise ReplayRLError(
                f"Lineage '{_lineage(paths)}' has no logged full checkpoint yet: run it first."
            )
        model = chosen[0]
    if not usable(model):
        raise ReplayRLError(
            f"Checkpoint v{model.tags['policy_version']} of lineage '{_lineage(paths)}' was "
            f"pruned (train.keep_checkpoints) and its weights were not copied to MLflow: "
            f"register a checkpoint still under the run root (--version, one of "
            f"{', '.join(str(v) for v in storage.complete_versions(paths))})."
        )
    return model


def _last_value(model, key: str) -> float | None:
    values = [m for m in model.metrics or [] if m.key == key]
    return max(values, key=lambda m: (m.step, m.timestamp)).value if values else None


def load_registered(
    tracking_uri: str,
    name: str,
    *,
    alias: str | None = "candidate",
    version: int | None = None,
    cache_dir: Path,
) -> Path:
    """The local folder holding the weights and tokenizer of version `version` (or the version
    `alias` points at) of registered model `name`: pass it to `from_pretrained`. A checkpoint
    under a local run root is used where it lies, one on S3 or copied to MLflow is downloaded
    into `cache_dir`; every file of a referenced checkpoint is checked against the sha256 its
    COMPLETE marker lists. Downloads nothing from the Hugging Face hub."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=connect_uri(tracking_uri))
    try:
        mv = (
            client.get_model_version(name, str(version))
            if version is not None
            else client.get_model_version_by_alias(name, alias or "")
        )
    except Exception as e:  # MLflow raises many types
        which = f"version {version}" if version is not None else f"alias '{alias}'"
        raise ReplayRLError(
            f"No {which} of registered model '{name}' on {tracking_uri}: {e}. Register one "
            "with `replayrl register`."
        ) from None
    if mv.tags.get("copied") == "true":
        import mlflow.artifacts

        dst = Path(cache_dir) / "mlflow-models" / (mv.model_id or f"{name}-{mv.version}")
        dst.mkdir(parents=True, exist_ok=True)
        path = mlflow.artifacts.download_artifacts(
            artifact_uri=mv.source, dst_path=str(dst), tracking_uri=connect_uri(tracking_uri)
        )
        return Path(path)
    return storage.checkpoint_local_dir(mv.tags["checkpoint"], Path(cache_dir), weights_only=True)


def _lineage(paths: LineagePaths) -> str:
    return paths.root.rstrip("/").rsplit("/", 1)[-1]
