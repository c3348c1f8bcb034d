"""Shared pieces of the pipeline tier: a tiny config, and a stand-in for the KFP REST API
(served by the `kfp_standin` fixture in conftest.py).

`small()` is a tiny configuration (a 100-step warm start cached for the session, 4 prompts
× 8 samples per iteration, a 16-prompt held-out set), so a kfp.local run spends its time in
process start-up, not in training, while some rollouts still earn rewards.

`kfp_standin` is NOT Kubeflow Pipelines. It is a small HTTP server on 127.0.0.1 that
implements the handful of KFP v2beta1 REST endpoints `kfp.Client` calls for `replayrl
submit` and `schedule` (healthz, pipelines and their versions, experiments, runs, recurring
runs and their enable/disable), checks each request's path, method and body, answers 400 to
anything it does not expect, and keeps what it was sent, so tests can assert on the
resulting server state. No KFP backend runs on this machine.
"""

from __future__ import annotations

import email.parser
import email.policy
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import yaml

from replayrl.config import load_config

PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
API = "/apis/v2beta1"


def small_overrides(tmp_path: Path, *extra: str, root: str = "runs") -> list[str]:
    return [
        f"storage.run_root={tmp_path / root}",
        f"model.cache_dir={tmp_path.parent / 'shared-cache'}",
        "iterations=2",
        "task.num_train=200",
        "task.num_eval=16",
        "eval.num_prompts=16",
        "eval.every=1",
        # 100 warm-start steps (cached for the session): enough that some rollouts earn a
        # reward, so the gradient steps change the policy.
        "model.warm_start_max_steps=100",
        "model.warm_start_eval_every=50",
        "rollout.prompts_per_iteration=4",
        "buffer.capacity=64",
        "train.batch_size=16",
        "train.steps_per_iteration=4",
        *extra,
    ]


def small(tmp_path: Path, *extra: str, root: str = "runs", arm: str | None = None):
    return load_config(PRESET, overrides=small_overrides(tmp_path, *extra, root=root), arm=arm)


# ---------------------------------------------------------------- the KFP REST stand-in


class Rejected(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class StandinState:
    """What the stand-in was sent, as a KFP backend would store it."""

    pipelines: dict[str, dict] = field(default_factory=dict)  # id -> {display_name, versions}
    experiments: dict[str, dict] = field(default_factory=dict)
    runs: dict[str, dict] = field(default_factory=dict)
    recurring_runs: dict[str, dict] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def new_id(self, kind: str) -> str:
        return f"{kind}-{next(self.ids)}"


def _name_filter(query: dict) -> str | None:
    raw = query.get("filter", [""])[0]
    if not raw:
        return None
    predicates = json.loads(raw)["predicates"]
    if len(predicates) != 1 or predicates[0]["key"] != "display_name":
        raise Rejected(400, f"unexpected filter {raw}")
    if predicates[0]["operation"] not in ("EQUALS", 1):
        raise Rejected(400, f"unexpected filter operation {raw}")
    return predicates[0]["stringValue"]


def _uploaded_yaml(headers, body: bytes) -> dict:
    """The pipeline spec in a multipart upload (field `uploadfile`), parsed."""
    ctype = headers.get("Content-Type", "")
    if not ctype.startswith("multipart/form-data"):
        raise Rejected(400, f"upload must be multipart/form-data, got {ctype!r}")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {ctype}\r\n\r\n".encode() + body
    )
    parts = {p.get_param("name", header="content-disposition"): p for p in message.iter_parts()}
    if "uploadfile" not in parts:
        raise Rejected(400, f"upload has no 'uploadfile' part: {sorted(parts)}")
    docs = list(yaml.safe_load_all(parts["uploadfile"].get_payload(decode=True)))
    if not docs or "pipelineInfo" not in docs[0] or "root" not in docs[0]:
        raise Rejected(400, "uploaded file is not a compiled KFP pipeline")
    return docs[0]


def _check_job_body(state: StandinState, body: dict, *, recurring: bool) -> None:
    ref = body.get("pipeline_version_reference") or {}
    pipeline = state.pipelines.get(ref.get("pipeline_id"))
    if pipeline is None or ref.get("pipeline_version_id") not in pipeline["versions"]:
        raise Rejected(400, f"unknown pipeline version reference {ref}")
    if body.get("experiment_id") not in state.experiments:
        raise Rejected(400, f"unknown experiment {body.get('experiment_id')}")
    if not body.get("display_name"):
        raise Rejected(400, "a run needs a display_name")
    params = (body.get("runtime_config") or {}).get("parameters") or {}
    expected = set(pipeline["versions"][ref["pipeline_version_id"]]["parameters"])
    if not set(params) <= expected:
        raise Rejected(400, f"parameters {sorted(set(params) - expected)} are not pipeline inputs")
    if recurring:
        cron = ((body.get("trigger") or {}).get("cron_schedule") or {}).get("cron", "")
        if len(cron.split()) != 6:
            raise Rejected(400, f"cron must have 6 fields, got {cron!r}")
        if body.get("mode") not in ("ENABLE", "DISABLE"):
            raise Rejected(400, f"unknown mode {body.get('mode')}")


def route(state: StandinState, method: str, url: str, headers, body: bytes) -> dict:
    parsed = urlparse(url)
    path, query = parsed.path, parse_qs(parsed.query)
    if not path.startswith(API + "/"):
        raise Rejected(404, f"not a v2beta1 path: {path}")
    path = path[len(API) :]
    data = (
        json.loads(body)
        if body and method == "POST" and not path.startswith("/pipelines/upload")
        else {}
    )
    if method == "GET" and path == "/healthz":
        return {"multi_user": False}
    if method == "GET" and path == "/pipelines":
        name = _name_filter(query)
        found = [
            {"pipeline_id": pid, "display_name": p["display_name"]}
            for pid, p in state.pipelines.items()
            if name is None or p["display_name"] == name
        ]
        return {"pipelines": found, "total_size": len(found)} if found else {}
    if method == "POST" and path == "/pipelines":
        name = data.get("display_name", "")
        if not name or any(p["display_name"] == name for p in state.pipelines.values()):
            raise Rejected(409, f"pipeline name {name!r} is missing or taken")
        pid = state.new_id("pipeline")
        state.pipelines[pid] = {"display_name": name, "versions": {}}
        return {"pipeline_id": pid, "display_name": name}
    if method == "POST" and path == "/pipelines/upload_version":
        spec = _uploaded_yaml(headers, body)
        pid, name = query.get("pipelineid", [""])[0], query.get("name", [""])[0]
        if pid not in state.pipelines or not name:
            raise Rejected(400, f"upload_version needs a known pipelineid and a name: {query}")
        versions = state.pipelines[pid]["versions"]
        if any(v["display_name"] == name for v in versions.values()):
            raise Rejected(409, f"version name {name!r} exists")
        vid = state.new_id("version")
        params = spec["root"].get("inputDefinitions", {}).get("parameters", {})
        versions[vid] = {"display_name": name, "spec": spec, "parameters": params}
        return {"pipeline_id": pid, "pipeline_version_id": vid, "display_name": name}
    if method == "GET" and path.startswith("/pipelines/") and path.endswith("/versions"):
        pid = path.split("/")[2]
        if pid not in state.pipelines:
            raise Rejected(404, f"no pipeline {pid}")
        name = _name_filter(query)
        items = [
            {"pipeline_id": pid, "pipeline_version_id": vid, "display_name": v["display_name"]}
            for vid, v in state.pipelines[pid]["versions"].items()
            if name is None or v["display_name"] == name
        ]
        size = int(query.get("page_size", ["10"])[0])
        return {"pipeline_versions": items[:size]} if items else {}
    if method == "GET" and path == "/experiments":
        name = _name_filter(query)
        found = [
            {"experiment_id": eid, **e}
            for eid, e in state.experiments.items()
            if name is None or e["display_name"] == name
        ]
        return {"experiments": found} if found else {}
    if method == "POST" and path == "/experiments":
        if not data.get("display_name"):
            raise Rejected(400, "an experiment needs a display_name")
        eid = state.new_id("experiment")
        state.experiments[eid] = {"display_name": data["display_name"]}
        return {"experiment_id": eid, "display_name": data["display_name"]}
    if method == "POST" and path == "/runs":
        _check_job_body(state, data, recurring=False)
        rid = state.new_id("run")
        state.runs[rid] = data
        return {"run_id": rid, "display_name": data["display_name"]}
    if method == "POST" and path == "/recurringruns":
        _check_job_body(state, data, recurring=True)
        rid = state.new_id("recurring")
        state.recurring_runs[rid] = data
        return {"recurring_run_id": rid, "display_name": data["display_name"]}
    if method == "GET" and path == "/recurringruns":
        name = _name_filter(query)
        eid = query.get("experiment_id", [None])[0]
        found = [
            {"recurring_run_id": rid, "display_name": r["display_name"]}
            for rid, r in state.recurring_runs.items()
            if (name is None or r["display_name"] == name)
            and (eid is None or r["experiment_id"] == eid)
        ]
        return {"recurringRuns": found} if found else {}
    if method == "POST" and path.startswith("/recurringruns/") and ":" in path:
        rid, action = path[len("/recurringruns/") :].split(":", 1)
        if rid not in state.recurring_runs or action not in ("enable", "disable"):
            raise Rejected(404, f"no recurring run {rid} or action {action}")
        state.recurring_runs[rid]["mode"] = "ENABLE" if action == "enable" else "DISABLE"
        return {}
    raise Rejected(404, f"the stand-in does not implement {method} {API}{path}")
