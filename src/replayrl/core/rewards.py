"""Rewards: one scalar per completion, from the completion text and the gold answer.

Three kinds, chosen by the task (`TaskSplits.reward_kind`):

- `"integer"`: the bare-expression arithmetic task. The completion must be exactly an
  integer, with optional surrounding whitespace (`" 105"`); anything else is unparsed.
- `"math"`: free-form solutions (GSM8K) checked with `math-verify`, which extracts
  the final answer (LaTeX, `\\boxed{}`, or a plain number) and compares it symbolically.
- `"boxed"`: competition-math solutions (OpenR1-Math, MATH). The answer is the content of
  the completion's last `\\boxed{...}` only (none: unparsed), compared with math-verify, so
  `\\boxed{0.5}` matches a gold `\\frac{1}{2}` and `\\boxed{2\\sqrt{2}}` a gold `\\sqrt{8}`.

A completion that cannot be parsed scores 0 and says so (`parsed=False`) so the caller
can count it as a metric; a bug raises. This module knows nothing about tokens (special
tokens are stripped by the caller), advantages, or where rollouts are stored.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from replayrl.errors import ReplayRLError

REWARD_KINDS = ("integer", "math", "boxed")

# math-verify's own timeout uses signal.alarm, which only works on the main thread; there
# it guards against pathological inputs (sympy can hang on huge expressions). Elsewhere
# (e.g. a thread pool scoring rollouts) the timeout is off: completions are capped at
# max_new_tokens, so no single parse is unbounded in size.
MATH_VERIFY_TIMEOUT_S = 5

_INTEGER = re.compile(r"\s*(-?\d+)\s*")
_BOXED = re.compile(r"\\boxed\s*\{")


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


def _math_verify():
    """math-verify's `parse` and `verify`, imported on first use: it pulls in sympy (about a
    second), which the tasks that only need `last_boxed` and the CLI need not pay for."""
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ReplayRLError(
            "the math rewards need math-verify: pip install 'math-verify>=0.7' (a dependency "
            "of replayrl; reinstall replayrl if it is missing)"
        ) from e
    return parse, verify


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
    parse, verify = _math_verify()
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


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` in `text` (braces balanced), or None::

    last_boxed(r"so \boxed{\frac{1}{2}}.")      == r"\frac{1}{2}"
    last_boxed(r"\boxed{3}, then \boxed{5}")    == "5"
    last_boxed("no box") is None; last_boxed(r"\boxed{1") is None  # unclosed
    """
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth = 1
    for index in range(starts[-1], len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[starts[-1] : index].strip()
    return None


def score_boxed(*, completion: str, answer: str) -> Reward:
    """Score the last `\\boxed{...}` of a completion with math-verify against `answer`
    (a bare LaTeX answer, `"\\frac{1}{2}"`). No box, or a box math-verify cannot read, is
    unparsed. Raises ReplayRLError if the gold answer cannot be parsed, like `score_math`.
    """
    boxed = last_boxed(completion)
    if boxed is None:
        return _result(correct=False, parsed=False)
    return score_math(completion=f"\\boxed{{{boxed}}}", answer=answer)


def score(*, kind: str, completion: str, answer: str) -> Reward:
    """Score one completion with the reward of `kind` ("integer", "math" or "boxed")."""
    if kind == "integer":
        return score_integer(completion=completion, answer=answer)
    if kind == "math":
        return score_math(completion=completion, answer=answer)
    if kind == "boxed":
        return score_boxed(completion=completion, answer=answer)
    raise ValueError(f"unknown reward kind {kind!r}; expected one of {REWARD_KINDS}")
