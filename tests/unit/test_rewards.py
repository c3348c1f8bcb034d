"""Rewards: integer answers for the bare-expression task, math-verify for free-form text."""

from __future__ import annotations

import threading

import pytest

from replayrl.core.rewards import Reward, score, score_integer, score_math
from replayrl.errors import ReplayRLError

pytestmark = pytest.mark.unit

RIGHT = Reward(reward=1.0, correct=True, parsed=True)
WRONG = Reward(reward=0.0, correct=False, parsed=True)
UNPARSED = Reward(reward=0.0, correct=False, parsed=False)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        (" 105", "105", RIGHT),
        ("105", "105", RIGHT),
        ("  -11\n", "-11", RIGHT),
        (" 11", "-11", WRONG),
        (" 104", "105", WRONG),
        ("0", "0", RIGHT),
        ("", "105", UNPARSED),
        ("   ", "105", UNPARSED),
        (" 105 apples", "105", UNPARSED),
        (" 10 5", "105", UNPARSED),
        (" 105.0", "105", UNPARSED),
        ("--105", "105", UNPARSED),
        ("\x00\xff", "105", UNPARSED),
    ],
)
def test_score_integer(completion: str, answer: str, expected: Reward) -> None:
    assert score_integer(completion=completion, answer=answer) == expected


def test_score_integer_rejects_a_non_integer_gold_answer() -> None:
    with pytest.raises(ValueError):
        score_integer(completion="1", answer="one")


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so the total is \\boxed{42}", "42", RIGHT),
        ("The answer is 42", "42", RIGHT),
        ("42.0", "42", RIGHT),
        ("She has 100 - 55 = 45 dollars left.\n#### 45", "45", RIGHT),
        ("The answer is 41", "42", WRONG),
        ("\\boxed{-7}", "-7", RIGHT),
        ("\\boxed{7}", "-7", WRONG),
        ("\\frac{1}{2}", "0.5", RIGHT),
        ("I do not know.", "42", UNPARSED),
        ("", "42", UNPARSED),
    ],
)
def test_score_math(completion: str, answer: str, expected: Reward) -> None:
    assert score_math(completion=completion, answer=answer) == expected


def test_score_math_rejects_an_unparseable_gold_answer() -> None:
    with pytest.raises(ReplayRLError, match="gold answer"):
        score_math(completion="42", answer="")


def test_score_math_works_off_the_main_thread() -> None:
    # math-verify's default timeout uses signal.alarm, which raises in any other thread.
    results: list[Reward] = []
    worker = threading.Thread(
        target=lambda: results.append(score_math(completion="\\boxed{42}", answer="42"))
    )
    worker.start()
    worker.join()
    assert results == [RIGHT]


def test_score_dispatches_by_kind() -> None:
    assert score(kind="integer", completion=" 7", answer="7") == RIGHT
    assert score(kind="integer", completion="The answer is 7", answer="7") == UNPARSED
    assert score(kind="math", completion="The answer is 7", answer="7") == RIGHT
    with pytest.raises(ValueError, match="unknown reward kind"):
        score(kind="regex", completion="7", answer="7")
