"""The command line's last resort: whatever an edge did not translate ends in one line and
exit 1, and the log file keeps the traceback (redacted), for every failure."""

from __future__ import annotations

import pytest

from replayrl.cli import buffer as buffer_cmd
from replayrl.cli import main as cli_main
from replayrl.errors import ReplayRLError

ARGS = ["buffer", "stats", "--run-root", "runs", "--lineage", "x"]


@pytest.fixture
def log_file(tmp_path, monkeypatch):
    path = tmp_path / "logs" / "replayrl.log"
    monkeypatch.setenv("REPLAYRL_LOG_FILE", str(path))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value-123")
    return path


def _raise(error: BaseException):
    def command(args):
        try:
            raise KeyError("library detail")
        except KeyError:
            raise error from None

    return command


def test_an_unexpected_error_is_one_line_and_its_traceback_is_in_the_log_file(
    log_file, monkeypatch, capsys
):
    boom = RuntimeError("disk said no\nsecond line s3cr3t-value-123")
    monkeypatch.setattr(buffer_cmd, "_buffer", _raise(boom))
    assert cli_main.main(ARGS) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("replayrl: error: unexpected RuntimeError")
    assert "Traceback" not in err and "s3cr3t" not in err and str(log_file) in err
    kept = log_file.read_text()
    assert "Traceback" in kept and "RuntimeError: disk said no" in kept
    assert "KeyError: 'library detail'" in kept  # the chain an edge hid, kept for the report
    assert "s3cr3t" not in kept  # redacted like the terminal


def test_a_user_error_keeps_its_traceback_in_the_log_file_too(log_file, monkeypatch, capsys):
    monkeypatch.setattr(buffer_cmd, "_buffer", _raise(ReplayRLError("Fix the thing.")))
    assert cli_main.main(ARGS) == 2
    assert capsys.readouterr().err == "replayrl: error: Fix the thing.\n"
    assert "ReplayRLError: Fix the thing." in log_file.read_text()
    # A second command in the same process appends to the same file, once per record.
    assert cli_main.main(ARGS) == 2
    assert log_file.read_text().count("ReplayRLError: Fix the thing.") == 2


def test_an_unwritable_log_file_costs_only_the_file(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("REPLAYRL_LOG_FILE", str(blocker / "replayrl.log"))
    monkeypatch.setattr(buffer_cmd, "_buffer", _raise(RuntimeError("boom")))
    assert cli_main.main(ARGS) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rerun with -v" in err


def test_an_unknown_or_missing_command_is_one_line(capsys):
    for argv in ([], ["frobnicate"]):
        with pytest.raises(SystemExit) as done:
            cli_main.main(argv)
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("replayrl: error: replayrl: ")
