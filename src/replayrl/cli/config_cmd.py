"""`replayrl config`: the configuration's reference, from the help each field carries.

replayrl config explain [NAME]   every key (or one section, or one key): type, default, help
replayrl config docs [--out F]   the same as Markdown: docs/configuration.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _explain(args: argparse.Namespace) -> int:
    from replayrl.config.explain import render_text, select

    sys.stdout.write(render_text(select(args.name)))
    return 0


def _docs(args: argparse.Namespace) -> int:
    from replayrl.config.explain import render_markdown

    text = render_markdown()
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`replayrl config explain` and `replayrl config docs`."""
    from replayrl.config.explain import DOCS_PATH

    cfg = sub.add_parser("config", help="explain the configuration's keys; write its reference")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    explain = cfg_sub.add_parser(
        "explain",
        help="every key with its type, default and help; or one section or key",
    )
    explain.add_argument(
        "name",
        nargs="?",
        help="a section (buffer), a top-level key (iterations) or a key (buffer.capacity); "
        "default: all",
    )
    explain.set_defaults(func=_explain)
    docs = cfg_sub.add_parser("docs", help=f"the reference as Markdown ({DOCS_PATH})")
    docs.add_argument("--out", help=f"write it to this file, e.g. {DOCS_PATH} (default: stdout)")
    docs.set_defaults(func=_docs)
