"""The step-by-step chain sum: targets that write each intermediate result, scored on the
final number, with the same disjoint, deterministic splits as `chain_sum`."""

from __future__ import annotations

import re

import pytest

from replayrl.core.rewards import score
from replayrl.errors import ReplayRLError
from replayrl.policy.problems import load_task, prompt_id_for, steps_target

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("expression", "target"),
    [
        ("48 + 57 + 12", " 105 + 12 = 117"),
        ("42 - 25 - 73", " 17 - 73 = -56"),
        ("16 - 32 - 36", " -16 - 36 = -52"),
        ("96 + -33 + -90", " 63 + -90 = -27"),
        ("77 + 90 - 67 + 36", " 167 - 67 + 36 = 100 + 36 = 136"),
        ("48 + 57", " 105"),
        ("7", " 7"),
    ],
)
def test_steps_target_writes_each_intermediate_result(expression: str, target: str) -> None:
    assert steps_target(expression) == target


@pytest.mark.parametrize("expression", ["48 * 57 + 12", "48 + 57 +", "", "48 57", "48 + x"])
def test_steps_target_rejects_what_is_not_a_chain_of_sums(expression: str) -> None:
    with pytest.raises(ReplayRLError, match="chain of \\+ and - terms"):
        steps_target(expression)


def test_default_options_give_three_term_prompts_with_step_targets() -> None:
    splits = load_task(name="chain_sum_steps", num_train=300, num_eval=60, seed=1)
    assert splits.reward_kind == "math"
    assert (len(splits.train), len(splits.eval)) == (300, 60)
    for problem in splits.train + splits.eval:
        match = re.fullmatch(r"(\d{2}) ([+-]) (\d{2}) ([+-]) (\d{2}) =", problem.prompt)
        assert match is not None, problem.prompt
        a, op1, b, op2, c = match.groups()
        partial = int(a) + int(b) if op1 == "+" else int(a) - int(b)
        final = partial + int(c) if op2 == "+" else partial - int(c)
        assert problem.answer == str(final)
        assert problem.target == f" {partial} {op2} {c} = {final}"
        assert problem.prompt_id == prompt_id_for(task="chain_sum_steps", prompt=problem.prompt)
        assert problem.prompt_id.startswith("chain_sum_steps-")


def test_splits_are_disjoint_and_deterministic() -> None:
    first = load_task(name="chain_sum_steps", num_train=500, num_eval=100, seed=4)
    again = load_task(name="chain_sum_steps", num_train=500, num_eval=100, seed=4)
    other = load_task(name="chain_sum_steps", num_train=500, num_eval=100, seed=5)
    assert first == again
    assert first.eval != other.eval
    train = {p.prompt for p in first.train}
    held_out = {p.prompt for p in first.eval}
    assert (len(train), len(held_out)) == (500, 100)
    assert not train & held_out


def test_same_expressions_as_chain_sum_with_the_same_options() -> None:
    options = {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2}
    plain = load_task(name="chain_sum", num_train=50, num_eval=20, seed=2, options=options)
    steps = load_task(name="chain_sum_steps", num_train=50, num_eval=20, seed=2)
    assert [p.prompt for p in steps.eval] == [p.prompt for p in plain.eval]
    assert [p.answer for p in steps.train] == [p.answer for p in plain.train]
    assert all(p.target == f" {p.answer}" for p in plain.eval)


def test_two_terms_give_the_bare_answer_and_four_terms_two_steps() -> None:
    two = load_task(
        name="chain_sum_steps",
        num_train=20,
        num_eval=10,
        seed=0,
        options={"max_terms": 2, "min_terms": 2},
    )
    assert all(p.target == f" {p.answer}" for p in two.train)
    four = load_task(
        name="chain_sum_steps",
        num_train=20,
        num_eval=10,
        seed=0,
        options={"min_terms": 4, "max_terms": 4},
    )
    assert all(p.target.count(" = ") == 2 for p in four.train)
    assert all(p.target.endswith(f" = {p.answer}") for p in four.train)


def test_reward_checks_the_final_number_of_a_step_by_step_completion() -> None:
    problem = load_task(name="chain_sum_steps", num_train=20, num_eval=5, seed=0).eval[0]
    kind = "math"
    assert score(kind=kind, completion=problem.target, answer=problem.answer).correct
    wrong_final = problem.target.rsplit(" ", 1)[0] + f" {int(problem.answer) + 1}"
    assert not score(kind=kind, completion=wrong_final, answer=problem.answer).correct
    # Only the final result counts: a wrong intermediate with the right final number passes.
    lucky = f" 0 + 0 = {problem.answer}"
    assert score(kind=kind, completion=lucky, answer=problem.answer).correct


def test_unknown_option_names_the_valid_ones() -> None:
    with pytest.raises(ReplayRLError, match=r"unknown option.*max_terms"):
        load_task(name="chain_sum_steps", num_train=10, num_eval=5, seed=0, options={"max_term": 3})


def test_too_few_distinct_prompts_fails_with_the_count() -> None:
    with pytest.raises(ReplayRLError, match="task 'chain_sum_steps'.*has only 200 distinct"):
        load_task(
            name="chain_sum_steps",
            num_train=300,
            num_eval=10,
            seed=0,
            options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        )
