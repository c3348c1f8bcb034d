"""`replayrl submit` and `replayrl schedule` against a STAND-IN for the KFP REST API.

No Kubeflow Pipelines backend runs here. `kfp_standin` and `kfp_multiuser` (conftest.py)
serve a small HTTP server on 127.0.0.1 (the module `kfp_standin`) that implements the
v2beta1 operations kfp.Client calls, checks every request and answer against the API
document (`kfp_openapi`), applies namespaces as the KFP 2.15 API server does in single-user
and multi-user mode, and stores what it accepted. The tests assert on that stored state and
on the command's exit code and output; most upload the committed pipeline YAML
(`--package`) so they do not compile.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml
from kfp_helpers import PRESET
from kfp_openapi import DOCUMENT, Violation
from kfp_standin import StandinState, handle

from replayrl.cli.main import main
from replayrl.kfp.client import MIN_BACKEND, parse_version

pytestmark = pytest.mark.pipeline

COMPILED = Path(__file__).parents[2] / "pipelines" / "compiled"
LOOP = ["--package", str(COMPILED / "replay_loop.yaml")]
ITERATION = ["--package", str(COMPILED / "replay_iteration.yaml")]
RUNNER = "replayrl-pipeline-runner"  # the account k8s/base creates, when a config names it


def cli(standin, *args: str) -> int:
    # No Kubernetes API here: the preflight is tested in test_preflight.py.
    return main([*args, "--host", standin.url, "--skip-preflight"])


@pytest.mark.slow
def test_submit_uploads_once_reuses_the_version_and_starts_runs(kfp_standin, capsys, tmp_path):
    args = ["submit", "--config", str(PRESET), "--lineage", "gsm-a", "--iterations", "2"]
    assert cli(kfp_standin, *args, "--run-root", "s3://bucket/runs") == 0
    assert cli(kfp_standin, *args, "--run-name", "second") == 0
    state = kfp_standin.state
    assert kfp_standin.rejected == []
    (pipeline,) = state.pipelines.values()
    assert pipeline["display_name"] == "replay-loop"  # one name: the spec's, the UI's, the file's
    (version,) = pipeline["versions"].values()  # same code, same YAML: the version is reused
    assert version["spec"]["pipelineInfo"]["name"] == "replay-loop"
    # The version's description is the parameter guide the UI's run form lacks.
    guide = version["description"].splitlines()
    assert guide[0].startswith("replayrl:")
    assert any(line.startswith("config: Run config, one line:") for line in guide)
    assert any("replay-plain" in line for line in guide if line.startswith("arm: "))
    assert [e["display_name"] for e in state.experiments.values()] == ["replayrl"]
    first, second = state.runs.values()
    params = first["runtime_config"]["parameters"]
    assert params["lineage"] == "gsm-a" and params["run_root_s3_uri"] == "s3://bucket/runs"
    assert yaml.safe_load(params["config"])["buffer"]["capacity"] == 512
    # Without --run-root, the required run_root_s3_uri is the config's storage.run_root.
    assert second["display_name"] == "second"
    assert second["runtime_config"]["parameters"]["run_root_s3_uri"].endswith("/runs")
    # kubernetes.service_account is null by default: KFP's default account of the namespace.
    assert "service_account" not in first and "service_account" not in second
    out = capsys.readouterr().out
    assert "run-" in out and "service account the namespace default" in out

    # Different code (another unroll count) becomes a new version of the same pipeline.
    assert cli(kfp_standin, "submit", "--iterations", "3") == 0
    assert len(pipeline["versions"]) == 2 and len(state.pipelines) == 1


def test_schedule_creates_a_recurring_run_then_pauses_and_resumes_it(kfp_standin, capsys):
    assert cli(kfp_standin, "schedule", "create", "--cron", "0 * * * *", "--lineage", "hourly") == 0
    assert kfp_standin.rejected == []
    ((rid, job),) = kfp_standin.state.recurring_runs.items()
    assert job["display_name"] == "hourly-recurring"
    assert job["trigger"]["cron_schedule"]["cron"] == "0 0 * * * *"
    assert int(job["max_concurrency"]) == 1 and job["no_catchup"] is True
    assert job["mode"] == "ENABLE"
    (pipeline,) = kfp_standin.state.pipelines.values()
    (version,) = pipeline["versions"].values()
    assert version["spec"]["pipelineInfo"]["name"] == "replay-iteration"
    params = job["runtime_config"]["parameters"]
    # The run root parameter is required: without --run-root, the config's (made absolute).
    assert params == {"lineage": "hourly", "run_root_s3_uri": str(Path.cwd() / "runs")}
    assert "service_account" not in job

    assert cli(kfp_standin, "schedule", "pause", "--name", "hourly-recurring") == 0
    assert kfp_standin.state.recurring_runs[rid]["mode"] == "DISABLE"
    assert cli(kfp_standin, "schedule", "resume", "--id", rid) == 0
    assert kfp_standin.state.recurring_runs[rid]["mode"] == "ENABLE"
    assert f"recurring run {rid} resumed" in capsys.readouterr().out

    # A second schedule with the same name is refused, with the way out.
    assert cli(kfp_standin, "schedule", "create", "--cron", "0 * * * *", "--lineage", "hourly") == 2
    assert "already exists" in capsys.readouterr().err
    assert len(kfp_standin.state.recurring_runs) == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["schedule", "create", "--cron", "every hour"], "is not a cron expression"),
        (["schedule", "create"], "needs --cron"),
        (["schedule", "pause", "--name", "nope"], "No recurring run named 'nope'"),
        (["submit", "--config", "missing.yaml"], "does not exist"),
        (["submit", "--arm", "sideways"], "Unknown arm 'sideways'"),
    ],
)
def test_user_errors_are_one_line(kfp_standin, capsys, args, message):
    if args[:2] == ["schedule", "pause"]:
        cli(kfp_standin, "submit")  # makes the experiment the lookup searches
        capsys.readouterr()
    assert cli(kfp_standin, *args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unreachable_host_says_how_to_fix_it(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    assert main(["submit", "--host", f"http://127.0.0.1:{port}", "--skip-preflight"]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--host" in err and "Traceback" not in err


def test_the_configs_pipeline_root_goes_with_every_run_and_recurring_run(kfp_standin, tmp_path):
    # A KFP backend reads a run's pipeline root only from the run request (never from the
    # spec's defaultPipelineRoot), so submit and schedule send the compiled one.
    config = yaml.safe_load(PRESET.read_text())
    config.setdefault("kubernetes", {})["pipeline_root"] = "s3://rl-artifacts/kfp"
    path = tmp_path / "rooted.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli(kfp_standin, "submit", "--config", str(path), "--iterations", "1") == 0
    assert cli(kfp_standin, "schedule", "create", "--cron", "0 * * * *", "--config", str(path)) == 0
    assert cli(kfp_standin, "submit", "--iterations", "1") == 0  # no root: KFP's default
    assert kfp_standin.rejected == []
    rooted, default = kfp_standin.state.runs.values()
    (job,) = kfp_standin.state.recurring_runs.values()
    assert rooted["runtime_config"]["pipeline_root"] == "s3://rl-artifacts/kfp"
    assert job["runtime_config"]["pipeline_root"] == "s3://rl-artifacts/kfp"
    assert not default["runtime_config"].get("pipeline_root")
    versions = [
        v["spec"] for p in kfp_standin.state.pipelines.values() for v in p["versions"].values()
    ]
    assert {v.get("defaultPipelineRoot") for v in versions} == {"s3://rl-artifacts/kfp", None}


# ---------------------------------------------------------------- namespaces


def test_multi_user_submit_lives_in_the_namespace_and_reuses_its_pipeline(kfp_multiuser, capsys):
    state = kfp_multiuser.state
    # A shared pipeline of the same name (namespace ""): a list without namespace would find
    # only it, and creating alice's own a second time would be refused.
    state.pipelines["shared"] = {
        "id": "shared",
        "name": "replay-loop",
        "display_name": "replay-loop",
        "description": "",
        "namespace": "",
        "versions": {},
    }
    for run in ("first", "second"):
        assert cli(kfp_multiuser, "submit", *LOOP, "--namespace", "alice", "--run-name", run) == 0
    assert kfp_multiuser.refused == []
    (mine,) = [p for p in state.pipelines.values() if p["namespace"] == "alice"]
    assert mine["name"] == "replay-loop" and len(mine["versions"]) == 1  # reused, twice
    assert state.pipelines["shared"]["versions"] == {}
    (exp,) = state.experiments.values()
    assert (exp["display_name"], exp["namespace"]) == ("replayrl", "alice")
    assert [(r["display_name"], r["namespace"]) for r in state.runs.values()] == [
        ("first", "alice"),
        ("second", "alice"),
    ]
    assert all("service_account" not in r for r in state.runs.values())
    assert "namespace alice" in capsys.readouterr().out

    # bob gets his own pipeline, version and experiment; alice's are untouched.
    assert cli(kfp_multiuser, "submit", *LOOP, "--namespace", "bob") == 0
    assert sorted(p["namespace"] for p in state.pipelines.values()) == ["", "alice", "bob"]
    assert sorted(e["namespace"] for e in state.experiments.values()) == ["alice", "bob"]
    assert len(mine["versions"]) == 1 and kfp_multiuser.refused == []


def test_multi_user_without_a_namespace_is_one_line_error(kfp_multiuser, capsys, monkeypatch):
    monkeypatch.delenv("KF_PIPELINES_NAMESPACE", raising=False)
    assert cli(kfp_multiuser, "submit", *LOOP) == 2
    err = capsys.readouterr().err
    assert "multi-user" in err and "--namespace" in err and len(err.strip().splitlines()) == 1
    assert kfp_multiuser.state.pipelines == {} and kfp_multiuser.state.runs == {}


def test_single_user_ignores_the_namespace_and_the_config_names_the_service_account(
    kfp_standin, tmp_path, capsys
):
    config = yaml.safe_load(PRESET.read_text())
    config.setdefault("kubernetes", {})["service_account"] = RUNNER
    path = tmp_path / "named-account.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli(kfp_standin, "submit", *LOOP, "--namespace", "alice", "--config", str(path)) == 0
    assert cli(kfp_standin, "submit", *LOOP) == 0
    state = kfp_standin.state
    (pipeline,) = state.pipelines.values()
    assert pipeline["namespace"] == "" and len(pipeline["versions"]) == 1
    first, second = state.runs.values()
    assert first["service_account"] == RUNNER
    assert "service_account" not in second  # KFP's default account of the namespace
    out = capsys.readouterr().out
    assert f"no namespace (single-user), service account {RUNNER}" in out
    assert "no namespace (single-user), service account the namespace default" in out


def test_recurring_runs_are_found_by_name_within_the_namespace(kfp_multiuser, capsys):
    state = kfp_multiuser.state
    for ns in ("alice", "bob"):
        args = ["schedule", "create", *ITERATION, "--cron", "0 * * * *", "--namespace", ns]
        assert cli(kfp_multiuser, *args, "--lineage", "hourly") == 0
    by_ns = {r["namespace"]: rid for rid, r in state.recurring_runs.items()}
    assert sorted(by_ns) == ["alice", "bob"]
    assert all("service_account" not in r for r in state.recurring_runs.values())
    # The same name again in alice's namespace is refused before anything is created.
    assert cli(kfp_multiuser, *args[:-2], "--namespace", "alice", "--lineage", "hourly") == 2
    assert "already exists" in capsys.readouterr().err and len(state.recurring_runs) == 2

    pause = ["schedule", "pause", "--name", "hourly-recurring"]
    assert cli(kfp_multiuser, *pause, "--namespace", "bob") == 0
    assert state.recurring_runs[by_ns["bob"]]["mode"] == "DISABLE"
    assert state.recurring_runs[by_ns["alice"]]["mode"] == "ENABLE"
    assert cli(kfp_multiuser, *pause, "--namespace", "carol") == 2
    assert "No experiment 'replayrl' in namespace 'carol'" in capsys.readouterr().err
    assert kfp_multiuser.refused == []


# ---------------------------------------------------------------- the backend version


def test_a_backend_older_than_the_floor_is_refused_before_anything_is_sent(kfp_standin, capsys):
    kfp_standin.state.tag_name = "2.14.4"
    assert cli(kfp_standin, "submit", *LOOP) == 2
    err = capsys.readouterr().err.strip()
    assert "2.14.4" in err and "2.15.0 or newer" in err and "CreateContainerConfigError" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert cli(kfp_standin, "schedule", "resume", "--id", "recurring-1") == 2
    assert "2.14.4" in capsys.readouterr().err
    assert kfp_standin.state.pipelines == {} and kfp_standin.refused == []


def test_a_backend_without_a_release_number_gets_a_warning(kfp_standin, caplog):
    kfp_standin.state.tag_name = "unknown"  # a build without TAG_NAME
    with caplog.at_level(logging.WARNING, logger="replayrl.kfp.client"):
        assert cli(kfp_standin, "submit", *LOOP) == 0
    assert "reports version 'unknown'" in caplog.text and len(kfp_standin.state.runs) == 1


@pytest.mark.parametrize(
    "tag,version",
    [
        ("2.15.0", (2, 15, 0)),
        ("v2.17.1", (2, 17, 1)),
        ("2.15.0-rc.1", (2, 15, 0)),
        ("2.14", (2, 14, 0)),
        ("unknown", None),
        ("master", None),
        ("", None),
    ],
)
def test_release_numbers_are_read_from_healthz_tag_name(tag, version):
    assert parse_version(tag) == version
    assert MIN_BACKEND == (2, 15, 0)


# ---------------------------------------------------------------- the API document


def _pipeline_request(body: dict, query: str = "") -> tuple:
    return (
        "POST",
        f"/apis/v2beta1/pipelines{query}",
        {"Content-Type": "application/json"},
        json.dumps(body).encode(),
    )


def test_the_document_refuses_what_the_api_does_not_have():
    ok = DOCUMENT.request(*_pipeline_request({"name": "p", "namespace": "alice"}))
    assert ok.operation.name == "pipeline_service_create_pipeline"
    bad = [
        _pipeline_request({"name": "p", "namespaces": "alice"}),  # no such field
        _pipeline_request({"name": "p", "namespace": ["alice"]}),  # wrong type
        _pipeline_request({"name": "p"}, "?namespace=alice"),  # no such query parameter
        ("GET", "/apis/v2beta1/pipelines?page_size=ten", {}, b""),
        ("GET", "/apis/v2beta1/pipeline", {}, b""),  # no such path
        ("POST", "/apis/v2beta1/recurringruns/r-1:pause", {}, b""),
        ("POST", "/apis/v2beta1/recurringruns/r-1:enable", {}, b'{"x": 1}'),  # takes no body
    ]
    for request in bad:
        with pytest.raises(Violation):
            DOCUMENT.request(*request)
    op = DOCUMENT.operations["pipeline_service_list_pipelines"]
    DOCUMENT.response(op, 200, {"pipelines": [{"pipeline_id": "p-1", "name": "p"}]})
    with pytest.raises(Violation, match="pipelines/0"):
        DOCUMENT.response(op, 200, {"pipelines": [{"id": "p-1"}]})  # v1beta1's field name
    with pytest.raises(Violation):
        DOCUMENT.response(op, 404, {"error_message": "no"})  # errors are google.rpc.Status


def test_the_standin_rejects_a_request_outside_the_document_and_refuses_as_the_server_does():
    state = StandinState(multi_user=True)
    status, answer = handle(state, *_pipeline_request({"display_name": "p", "nmespace": "a"}))
    assert status == 400 and len(state.rejected) == 1 and "nmespace" in state.rejected[0]
    assert state.pipelines == {}
    # Valid by the document, refused by the server: an unknown filter key, no namespace.
    bad_key = json.dumps({"predicates": [{"key": "namespace", "string_value": "a"}]})
    status, answer = handle(state, "GET", f"/apis/v2beta1/recurringruns?filter={bad_key}", {}, b"")
    assert status == 400 and "unrecognized field 'namespace'" in answer["message"]
    status, _ = handle(state, "GET", "/apis/v2beta1/experiments", {}, b"")
    assert status == 400 and len(state.refused) == 2 and len(state.rejected) == 1
