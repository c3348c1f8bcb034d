"""`replayrl.cli.args`: the one checked type of every numeric command-line argument, and the
one-line report of a bad command line."""

from __future__ import annotations

import argparse

import pytest

from replayrl.cli.args import lineage_name, number, one_line_errors
from replayrl.cli.main import build_parser


def commands(parser: argparse.ArgumentParser, prog: str = "replayrl"):
    """(prog, parser) of every command and sub-command of `parser`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prog} {name}", sub
                yield from commands(sub, f"{prog} {name}")


def test_every_numeric_argument_of_every_command_is_checked():
    """No `type=int` or `type=float` is left: each lets NaN, ±inf (`1e999`) or a 30-digit
    integer through to wherever the value is first used."""
    numeric = []
    for prog, parser in commands(build_parser()):
        for action in parser._actions:
            assert action.type not in (int, float), f"{prog} {action.option_strings}"
            if getattr(action.type, "__qualname__", "").startswith("number."):
                numeric.append(f"{prog} {action.option_strings[0]}")
                assert parser.error.__qualname__.startswith("one_line_errors."), prog
    assert len(numeric) >= 18, numeric
    assert "replayrl buffer --grace-s" in numeric and "replayrl run --iterations" in numeric


def test_every_lineage_argument_is_checked():
    lineages = [
        prog
        for prog, parser in commands(build_parser())
        for action in parser._actions
        if "--lineage" in action.option_strings
    ]
    assert len(lineages) >= 7, lineages
    for prog, parser in commands(build_parser()):
        for action in parser._actions:
            if "--lineage" in action.option_strings:
                assert action.type is lineage_name, prog


@pytest.mark.parametrize(
    "kind,allowed,text,must",
    [
        (float, "[0, inf)", "nan", "must be a finite number >= 0, got 'nan'"),
        (float, "[0, inf)", "inf", "must be a finite number >= 0, got 'inf'"),
        (float, "[0, inf)", "-inf", "must be a finite number >= 0"),
        (float, "[0, inf)", "1e999", "must be a finite number >= 0, got '1e999'"),
        (float, "[0, inf)", "-1", "must be a finite number >= 0, got '-1'"),
        (float, "[0, 1]", "1.5", "must be a finite number in [0, 1], got '1.5'"),
        (float, "(-inf, inf)", "nan", "must be a finite number, got 'nan'"),
        (float, "(0, inf)", "abc", "must be a finite number > 0, got 'abc'"),
        (int, "[1, inf)", "0", "must be an integer >= 1, got '0'"),
        (int, "[1, inf)", "1.5", "must be an integer >= 1, got '1.5'"),
        (int, "[1, inf)", "1e3", "must be an integer >= 1, got '1e3'"),
        (int, "[0, inf)", str(2**63), "(at most 9223372036854775807)"),
        (int, "(-inf, inf)", str(-(2**63) - 1), "(at most 9223372036854775807)"),
    ],
)
def test_a_bad_number_is_refused_saying_what_it_must_be(kind, allowed, text, must):
    with pytest.raises(argparse.ArgumentTypeError) as err:
        number(kind, allowed)(text)
    assert must in str(err.value)


def test_a_good_number_is_parsed():
    assert number(float, "[0, inf)")("0") == 0.0
    assert number(float, "[0, inf)")("1e300") == 1e300
    assert number(float, "[0, 1]")(" 1 ") == 1.0
    assert number(int, "[1, inf)")("3") == 3 and isinstance(number(int)("3"), int)
    assert number(int)(str(2**63 - 1)) == 2**63 - 1


def test_a_bad_command_line_is_one_line(capsys):
    parser = argparse.ArgumentParser(prog="replayrl x")
    one_line_errors(parser)
    parser.add_argument("--n", type=number(int, "[1, inf)"), required=True)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--n", "0"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "replayrl: error: replayrl x: argument --n: must be an integer >= 1, got '0' "
        "(see `replayrl x -h`)\n"
    )
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert capsys.readouterr().err.count("\n") == 1


def test_a_lineage_name_is_checked_like_the_layout():
    assert lineage_name("chain_sum-replay-s0") == "chain_sum-replay-s0"
    assert lineage_name("lr0.001.v2") == "lr0.001.v2"
    for bad in ("", "..", ".x", "-x", "a b", "é", "a/b", "a\\b", "x" * 129):
        with pytest.raises(argparse.ArgumentTypeError, match="is not valid"):
            lineage_name(bad)
