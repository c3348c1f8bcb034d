"""`replayrl` command line: run a lineage, inspect its buffer.

User errors (ReplayRLError), and paths the file system refuses (OSError), print one line on
stderr, without a traceback, and exit 2.
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

from replayrl import __version__, logs
from replayrl.cli import analysis, buffer, config_cmd, kubeflow, plan, register, run
from replayrl.cli import sweep as sweep_cmd
from replayrl.errors import ReplayRLError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replayrl", description=__doc__.splitlines()[0])
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
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Every logger's records (botocore's debug log carries session tokens and signatures)
    # and any traceback are redacted before they are written.
    logs.install(os.environ)
    for noisy in ("alembic", "mlflow", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return args.func(args)
    except ReplayRLError as e:
        print(
            f"replayrl: error: {logs.redact(str(e), secrets=logs.known_secrets(os.environ))}",
            file=sys.stderr,
        )
        return 2
    except OSError as e:
        # The file system refused a path (a file where a folder should be, no permission, a
        # full disk): the user's to fix, so one line naming it; -v logs where it happened.
        logging.getLogger("replayrl").debug("OSError", exc_info=True)
        where = f" ({e.filename})" if e.filename and str(e.filename) not in str(e) else ""
        line = f"{e}{where}; check the path and its permissions."
        print(
            f"replayrl: error: {logs.redact(line, secrets=logs.known_secrets(os.environ))}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("replayrl: interrupted; re-run the same command to resume.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
