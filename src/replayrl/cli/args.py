"""Checked command-line values: every numeric argument of every command is parsed by `number`,
every lineage name by `lineage_name`, and each command's parser reports a bad value on one
line (`one_line_errors`).

`number(kind, allowed)` is an argparse `type=` that gives a command-line number the checks a
config field gets (`replayrl.config.ranges`): NaN, ±inf and a float too large to be one
(`1e999`) are refused, an int must fit in 64 bits, and the value must lie in `allowed`,
written in the same interval notation as a config field's range. A refused value ends the
command before it does anything, with one line naming the argument:

    replayrl: error: replayrl buffer: argument --grace-s: must be a finite number >= 0, got
    'nan' (see `replayrl buffer -h`)
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

from replayrl.config.ranges import INT_LIMIT, Range
from replayrl.errors import ReplayRLError


def number(kind: type[int] | type[float], allowed: str = "(-inf, inf)") -> Callable[[str], float]:
    """An argparse `type=` for a number of `kind` (int or float) in the interval `allowed`
    ("[0, inf)", "(0, 1]"; default: any finite number)."""
    bounds = Range.parse(allowed)
    what = "an integer" if kind is int else "a finite number"
    must = f"{what} {bounds.describe()}" if bounds.describe() != "finite" else what

    def parse(text: str) -> float:
        try:
            value = kind(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {must}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {text!r}")
        if isinstance(value, int) and abs(value) > INT_LIMIT:
            raise argparse.ArgumentTypeError(f"must be {must} (at most {INT_LIMIT}), got {text!r}")
        if not bounds.contains(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type by it in its own messages
    return parse


def lineage_name(text: str) -> str:
    """An argparse `type=` for a lineage name (`replayrl.storage.state.check_lineage_name`)."""
    from replayrl.storage.state import check_lineage_name

    try:
        return check_lineage_name(text)
    except ReplayRLError as e:
        raise argparse.ArgumentTypeError(str(e).rstrip(".")) from None


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `parser` report a bad command line (a refused value, a missing or unknown
    argument) like every other error of the CLI: one line, `replayrl: error: ...`, exit 2,
    instead of argparse's usage block. Returns `parser`."""

    def error(message: str) -> NoReturn:
        line = " ".join(f"{parser.prog}: {message} (see `{parser.prog} -h`)".split())
        print(f"replayrl: error: {line}", file=sys.stderr)
        sys.exit(2)

    parser.error = error  # type: ignore[method-assign]
    return parser
