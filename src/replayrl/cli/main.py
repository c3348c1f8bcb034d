"""`replayrl` command line: run a lineage, inspect its buffer.

Every failure ends in one line on stderr, without a traceback:
- user errors (ReplayRLError) and paths the file system refuses (OSError) exit 2;
- anything else (a bug, or a library's error that no edge translated yet) exits 1 with a
  line naming the exception and the log file.
The log file (`replayrl.config.cli_log_file`: $REPLAYRL_LOG_FILE, else
`<cache>/logs/replayrl.log`) keeps every command's log lines and, for every failure, its
traceback (redacted like the terminal's); `-v` also prints the traceback on stderr.
Each group of commands lives in a module of its own: run.py (`run`), buffer.py (`buffer`),
kubeflow.py (`compile`, `preflight`, `submit`, `schedule`), analysis.py (`compare`, `experiment`,
`advise`), sweep.py (`sweep`), config_cmd.py (`config explain`, `config docs`), register.py
(`register`) and plan.py (`plan`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from replayrl import __version__, logs
from replayrl.cli import analysis, buffer, config_cmd, kubeflow, plan, register, run
from replayrl.cli import sweep as sweep_cmd
from replayrl.cli.args import one_line_errors
from replayrl.config import cli_log_file
from replayrl.errors import ReplayRLError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The log file starts over (the old one kept as replayrl.log.1) once it passes this size.
LOG_FILE_MAX_BYTES = 10_000_000


def build_parser() -> argparse.ArgumentParser:
    parser = one_line_errors(
        argparse.ArgumentParser(prog="replayrl", description=__doc__.splitlines()[0])
    )
    parser.add_argument("--version", action="version", version=f"replayrl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    run.add_parser(sub)
    buffer.add_parser(sub)
    kubeflow.add_parsers(sub)
    analysis.add_parsers(sub)
    config_cmd.add_parser(sub)
    register.add_parser(sub)
    sweep_cmd.add_parser(sub)
    plan.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT)
    log_file = _open_log_file()
    # Every logger's records (botocore's debug log carries session tokens and signatures)
    # and any traceback are redacted before they are written, in the log file too.
    logs.install(os.environ)
    _to_log_file(logging.INFO, "replayrl %s: %s", __version__, " ".join(sys.argv))
    for noisy in ("alembic", "mlflow", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return _run(args, log_file)
    finally:
        _close_log_file()


def _run(args: argparse.Namespace, log_file: Path | None) -> int:
    """The command, and the one line each way it can fail."""
    try:
        return args.func(args)
    except ReplayRLError as e:
        _keep_traceback(log_file, "ReplayRLError")
        _error_line(" ".join(str(e).split()))
        return 2
    except OSError as e:
        # The file system refused a path (a file where a folder should be, no permission, a
        # full disk): the user's to fix, so one line naming it.
        _keep_traceback(log_file, "OSError")
        where = f" ({e.filename})" if e.filename and str(e.filename) not in str(e) else ""
        _error_line(f"{e}{where}; check the path, its permissions and the free space.")
        return 2
    except KeyboardInterrupt:
        print("replayrl: interrupted; re-run the same command to resume.", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the last resort: one line, the traceback kept
        # Nothing committed is lost by stopping here: every write is atomic or fenced, and
        # a rerun of the same command resumes from the last commit.
        _keep_traceback(log_file, "unexpected error", level=logging.ERROR)
        where = f"the traceback is in {log_file}" if log_file else "rerun with -v to see it"
        _error_line(
            f"unexpected {type(e).__name__}: {' '.join(str(e).split())[:300]} ({where}; "
            f"nothing committed is lost: rerun the same command to resume, and report it "
            f"if it persists)."
        )
        return 1


def _error_line(text: str) -> None:
    print(
        f"replayrl: error: {logs.redact(text, secrets=logs.known_secrets(os.environ))}",
        file=sys.stderr,
    )


def _open_log_file() -> Path | None:
    """Add the log file to the root logger's handlers (before `logs.install`, so its records
    are redacted too); None when it cannot be opened (a read-only home), which costs only
    the file."""
    root = logging.getLogger()
    path = cli_log_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size > LOG_FILE_MAX_BYTES:
            os.replace(path, path.with_name(path.name + ".1"))
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError:
        return None
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    _FILE_HANDLERS.append(handler)
    return path


_FILE_HANDLERS: list[logging.Handler] = []


def _close_log_file() -> None:
    """Take the log file off the root logger (main() may run again in this process)."""
    while _FILE_HANDLERS:
        handler = _FILE_HANDLERS.pop()
        logging.getLogger().removeHandler(handler)
        handler.close()


def _to_log_file(level: int, msg: str, *args: object, exc_info=None, terminal=False) -> None:
    """A record for the log file only (`terminal`: for stderr's handler too)."""
    logger = logging.getLogger("replayrl.cli")
    record = logger.makeRecord(logger.name, level, __file__, 0, msg, args, exc_info, func="main")
    for handler in logging.getLogger().handlers:
        if handler in _FILE_HANDLERS or terminal:
            handler.handle(record)


def _keep_traceback(log_file: Path | None, what: str, *, level: int = logging.INFO) -> None:
    """The current exception's traceback into the log file only (the terminal gets one
    line), and on stderr too with -v."""
    exc_info = sys.exc_info()
    # The library error an edge translated (`raise ReplayRLError(...) from None`) is what a
    # bug report needs: show the whole chain.
    e, seen = exc_info[1], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__suppress_context__ = False
        e = e.__cause__ or e.__context__
    verbose = logging.getLogger().isEnabledFor(logging.DEBUG)
    _to_log_file(level, "%s", what, exc_info=exc_info, terminal=verbose)


if __name__ == "__main__":
    sys.exit(main())
