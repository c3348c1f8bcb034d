"""Rewards: one scalar per completion, from the completion text and the gold answer.

Two kinds, chosen by the task (`TaskSplits.reward_kind`):

- `"integer"`: the bare-expression arithmetic task. The completion must be exactly an
  integer, with optional surrounding whitespace (`" 105"`); anything else is unparsed.
- `"math"`: free-form solutions (GSM8K, MATH) checked with `math-verify`, which extracts
  the final answer (LaTeX, `\\boxed{}`, or a plain number) and compares it symbolically.

A completion that cannot be parsed scores 0 and says so (`parsed=False`) so the caller
can count it as a metric; a bug raises. This module knows nothing about tokens (special
tokens are stripped by the caller), advantages, or where rollouts are stored.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from math_verify import parse, verify

from replayrl.errors import ReplayRLError

REWARD_KINDS = ("integer", "math")

# math-verify's own timeout uses signal.alarm, which only works on the main thread; there
# it guards against pathological inputs (sympy can hang on huge expressions). Elsewhere
# (e.g. a thread pool scoring rollouts) the timeout is off: completions are capped at
# max_new_tokens, so no single parse is unbounded in size.
MATH_VERIFY_TIMEOUT_S = 5

_INTEGER = re.compile(r"\s*(-?\d+)\s*")


@dataclass(frozen=True)
class Reward:
    """The score of one completion.

    `reward` is 1.0 when correct and 0.0 otherwise; `parsed` is False when no answer
    could be extracted from the completion (then `correct` is False too).
    """

    reward: float
    correct: bool
    parsed: bool


def _result(*, correct: bool, parsed: bool) -> Reward:
    return Reward(reward=1.0 if correct else 0.0, correct=correct, parsed=parsed)


def score_integer(*, completion: str, answer: str) -> Reward:
    """Score a completion that must be just an integer, e.g. `" 105"` against `"105"`.

    Raises ValueError if `answer` is not an integer: that is a task bug, not a bad rollout.
    """
    gold = int(answer)
    match = _INTEGER.fullmatch(completion)
    if match is None:
        return _result(correct=False, parsed=False)
    return _result(correct=int(match.group(1)) == gold, parsed=True)


def _timeout_s() -> int | None:
    on_main_thread = threading.current_thread() is threading.main_thread()
    return MATH_VERIFY_TIMEOUT_S if on_main_thread else None


def _gold_latex(answer: str) -> str:
    """Wrap a bare gold answer so math-verify's LaTeX extractor parses it exactly."""
    if "\\boxed" in answer or "$" in answer:
        return answer
    return f"${answer}$"


def score_math(*, completion: str, answer: str) -> Reward:
    """Score a free-form solution with math-verify, e.g. `"... so \\\\boxed{42}"` vs `"42"`.

    Works from any thread (see MATH_VERIFY_TIMEOUT_S). Raises ReplayRLError if the gold
    answer itself cannot be parsed: the task data is malformed.
    """
    timeout_s = _timeout_s()
    gold = parse(_gold_latex(answer), parsing_timeout=timeout_s)
    if not gold:
        raise ReplayRLError(
            f"math-verify cannot parse the gold answer {answer!r}; fix the task data so "
            "each answer is a number or a LaTeX expression"
        )
    pred = parse(completion, parsing_timeout=timeout_s)
    if not pred:
        return _result(correct=False, parsed=False)
    return _result(correct=verify(gold, pred, timeout_seconds=timeout_s), parsed=True)


def score(*, kind: str, completion: str, answer: str) -> Reward:
    """Score one completion with the reward of `kind` ("integer" or "math")."""
    if kind == "integer":
        return score_integer(completion=completion, answer=answer)
    if kind == "math":
        return score_math(completion=completion, answer=answer)
    raise ValueError(f"unknown reward kind {kind!r}; expected one of {REWARD_KINDS}")
