"""`replayrl config`: the configuration's reference, from the help each field carries.

replayrl config explain [NAME]   every key (or one section, or one key): type, default, help
replayrl config docs [--out F]   the same as Markdown: docs/configuration.md
replayrl config json FILE        the config as one line of JSON, for a one-line form field
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


def _json(args: argparse.Namespace) -> int:
    from replayrl.errors import ReplayRLError
    from replayrl.kfp.pipelines import one_line_config

    if not Path(args.file).is_file():
        raise ReplayRLError(f"Config file '{args.file}' does not exist.")
    print(one_line_config(args.file))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`replayrl config explain`, `replayrl config docs` and `replayrl config json`."""
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
    as_json = cfg_sub.add_parser(
        "json",
        help="the config FILE as one line of JSON that loads to the same config: what the "
        "KFP UI's one-line `config` field takes (tracking credentials left out)",
    )
    as_json.add_argument("file", help="a config file, e.g. configs/qwen2.5-0.5b-gsm8k.yaml")
    as_json.set_defaults(func=_json)
