"""The allowed values of numeric knobs, written once beside each knob and checked generically.

A knob's range is field metadata, in interval notation next to its help:
`field(default=0.9, metadata={"range": "[0, 1)", "help": ...})`; a knob that may be null
also says what null means (`"null": "for no limit"`), for the error message. `check_ranges`
checks every numeric field of a section against its range when the config is loaded, before
anything is written, and refuses NaN and ±inf in every float knob, ranged or not (NaN passes
every `<` and `>` test, so a hand-written `if x <= 0` lets it through), an int beyond 64 bits
and a float beyond float32 (`INT_LIMIT`, `FLOAT_LIMIT`). `Range.describe` gives the words the
errors and the generated docs use: "> 0", ">= 1", "in [0, 1)".

    >>> Range.parse("(0, 1]").contains(1.0), Range.parse("[1, inf)").describe()
    (True, '>= 1')
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from replayrl.errors import ReplayRLError

# The largest magnitude of an int knob: a signed 64-bit integer, what numpy, torch, Arrow and
# Delta store it in; and of a float knob: float32's, what the policy's tensors and optimizer
# hold (train.lr = 1e300 failed torch's conversion at the first step). A larger one passes
# Python's arithmetic at load and fails deep in a run.
INT_LIMIT = 2**63 - 1
FLOAT_LIMIT = 3.4028234663852886e38
_INTERVAL = re.compile(r"([\[(])\s*(-inf|[-+.\deE]+)\s*,\s*(inf|[-+.\deE]+)\s*([\])])")


@dataclass(frozen=True)
class Range:
    """An interval of allowed values; `low_open`/`high_open` for "(" and ")"."""

    low: float
    high: float
    low_open: bool
    high_open: bool

    @classmethod
    def parse(cls, text: str) -> Range:
        """ "[0, 1)", "(0, inf)", "[1, inf)": a bracket for a bound that is allowed, a
        parenthesis for one that is not (always one at an infinite end)."""
        match = _INTERVAL.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not an interval such as '[0, 1)': {text!r}")
        opening, low, high, closing = match.groups()
        return cls(float(low), float(high), opening == "(", closing == ")")

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        """In words: "> 0", ">= 1", "<= 5", or "in [0, 1)"."""
        if math.isinf(self.high) and math.isinf(self.low):
            return "finite"
        if math.isinf(self.high):
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        if math.isinf(self.low):
            return f"{'<' if self.high_open else '<='} {_number(self.high)}"
        return (
            f"in {'(' if self.low_open else '['}{_number(self.low)}, "
            f"{_number(self.high)}{')' if self.high_open else ']'}"
        )


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def range_of(f: dataclasses.Field) -> Range | None:
    """The range a field's metadata declares, or None."""
    text = f.metadata.get("range")
    return None if text is None else Range.parse(text)


def check_ranges(section: Any, prefix: str) -> None:
    """Refuse a non-finite float in any numeric field of the dataclass `section`, any value
    outside its field's declared range, an int beyond 64 bits and a float beyond float32;
    `prefix` names the section in the message ("train" -> "train.lr"; "" for the top-level
    keys). None (a knob's "off") is not checked, nor are non-numeric fields."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        allowed = range_of(f)
        if isinstance(value, float) and not math.isfinite(value):
            must = f" {allowed.describe()}" if allowed is not None else ""
            raise ReplayRLError(f"{key} must be a finite number{must}, got {value}.")
        if allowed is not None and not allowed.contains(value):
            if "None" in str(f.type):  # null is a value of its own ("off", "derived")
                null = " ".join(("or null", f.metadata.get("null", ""))).strip()
                raise ReplayRLError(f"{key} must be {allowed.describe()}, {null}; got {value}.")
            raise ReplayRLError(f"{key} must be {allowed.describe()}, got {value}.")
        if isinstance(value, int) and abs(value) > INT_LIMIT:
            raise ReplayRLError(
                f"{key} must be an integer of at most {INT_LIMIT} (64 bits: what numpy, torch "
                f"and the buffer's tables hold), got {value}."
            )
        if isinstance(value, float) and abs(value) > FLOAT_LIMIT:
            raise ReplayRLError(
                f"{key} must be a number of at most 3.4e38 (float32: what the policy's tensors "
                f"hold), got {value}."
            )
