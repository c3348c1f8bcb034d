"""`replayrl submit` and `replayrl schedule` against a STAND-IN for the KFP REST API.

No Kubeflow Pipelines backend runs here. `kfp_standin` (see conftest.py) is a small HTTP
server on 127.0.0.1 implementing the v2beta1 endpoints kfp.Client calls; it checks paths,
methods and bodies, refuses anything else, and stores what it accepted. The tests assert on
that stored state and on the command's exit code and output.
"""

from __future__ import annotations

import pytest
import yaml
from kfp_helpers import PRESET

from replayrl.cli import main

pytestmark = pytest.mark.pipeline


def cli(standin, *args: str) -> int:
    return main([*args, "--host", standin.url])


def test_submit_uploads_once_reuses_the_version_and_starts_runs(kfp_standin, capsys, tmp_path):
    args = ["submit", "--config", str(PRESET), "--lineage", "gsm-a", "--iterations", "2"]
    assert cli(kfp_standin, *args, "--run-root", "s3://bucket/runs") == 0
    assert cli(kfp_standin, *args, "--run-name", "second") == 0
    state = kfp_standin.state
    assert kfp_standin.rejected == []
    (pipeline,) = state.pipelines.values()
    assert pipeline["display_name"] == "replayrl-loop"
    (version,) = pipeline["versions"].values()  # same code, same YAML: the version is reused
    assert version["spec"]["pipelineInfo"]["name"] == "replay-loop"
    assert [e["display_name"] for e in state.experiments.values()] == ["replayrl"]
    first, second = state.runs.values()
    params = first["runtime_config"]["parameters"]
    assert params["lineage"] == "gsm-a" and params["run_root"] == "s3://bucket/runs"
    assert yaml.safe_load(params["config"])["buffer"]["capacity"] == 512
    assert (
        second["display_name"] == "second"
        and "run_root" not in second["runtime_config"]["parameters"]
    )
    assert "run-" in capsys.readouterr().out

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
    assert job["runtime_config"]["parameters"] == {"lineage": "hourly"}

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
    assert main(["submit", "--host", f"http://127.0.0.1:{port}"]) == 2
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
