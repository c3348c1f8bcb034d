"""The math task (OpenR1-Math-220k / MATH rows): Parquet and JSONL files load into disjoint
splits with boxed-answer prompts, the gold answer comes from `answer` or the solution's last
`\\boxed{}`, the `"boxed"` reward grades equivalent forms with math-verify, and bad rows fail
with one line naming the file and row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replayrl.core.rewards import Reward, last_boxed, score
from replayrl.errors import ReplayRLError
from replayrl.policy.problems import DEFAULT_MATH_PROMPT_TEMPLATE, load_task

pytestmark = pytest.mark.unit

# OpenR1-Math-220k rows carry `answer`; MATH rows only a boxed solution.
OPENR1_ROWS = [
    {
        "problem": "Compute $\\frac{3}{6}$.",
        "solution": "Divide: the fraction reduces to $\\boxed{\\frac{1}{2}}$.",
        "answer": "\\frac{1}{2}",
    },
    {
        "problem": "Simplify $\\sqrt{8}$.",
        "solution": "$\\sqrt{8} = \\sqrt{4 \\cdot 2} = \\boxed{2\\sqrt{2}}$",
        "answer": "2\\sqrt{2}",
    },
]
MATH_ROWS = [
    {
        "problem": f"What is ${i} + {i}$?",
        # An earlier box in the working must not be taken for the answer.
        "solution": f"First $\\boxed{{{i}}}$ doubled is $\\boxed{{{2 * i}}}$.",
    }
    for i in range(1, 7)
]
ROWS = OPENR1_ROWS + MATH_ROWS


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict]) -> str:
    # OpenR1-Math-220k has more columns than the task reads, and nulls where MATH-style rows
    # have no `answer`.
    columns = {
        "problem": [r["problem"] for r in rows],
        "solution": [r["solution"] for r in rows],
        "answer": [r.get("answer") for r in rows],
        "generations": [["a long trace"] for _ in rows],
    }
    pq.write_table(pa.table(columns), path)
    return str(path)


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
def test_a_math_file_loads_into_disjoint_splits_with_boxed_prompts(tmp_path, writer) -> None:
    suffix = ".jsonl" if writer is write_jsonl else ".parquet"
    path = writer(tmp_path / f"math{suffix}", ROWS)
    splits = load_task(name="math", num_train=100, num_eval=3, seed=0, path=path)
    assert splits.reward_kind == "boxed"
    assert (len(splits.eval), len(splits.train)) == (3, len(ROWS) - 3)
    assert not {p.prompt for p in splits.eval} & {p.prompt for p in splits.train}
    by_problem = {p.prompt: p for p in splits.train + splits.eval}
    for row in ROWS:
        prompt = DEFAULT_MATH_PROMPT_TEMPLATE.format(problem=row["problem"])
        problem = by_problem[prompt]
        assert prompt.startswith(f"Problem: {row['problem']}\n")
        assert "\\boxed{}" in prompt and prompt.endswith("Solution:")
        # Gold: the `answer` column, else the solution's last box (not its first).
        assert problem.answer == row.get("answer", last_boxed(row["solution"]))
        assert problem.target == f" {row['solution']}"
        assert problem.prompt_id.startswith("math-")
    assert by_problem[DEFAULT_MATH_PROMPT_TEMPLATE.format(problem="What is $3 + 3$?")].answer == "6"
    # A seed fixes the splits; another seed draws others.
    assert splits == load_task(name="math", num_train=100, num_eval=3, seed=0, path=path)
    assert splits.eval != load_task(name="math", num_train=100, num_eval=3, seed=1, path=path).eval


def test_the_prompt_template_is_an_option(tmp_path) -> None:
    path = write_jsonl(tmp_path / "math.jsonl", ROWS)
    template = "<|im_start|>user\n{problem} Answer in \\boxed{{}}.<|im_end|>\n"
    splits = load_task(
        name="math",
        num_train=10,
        num_eval=1,
        seed=0,
        path=path,
        options={"prompt_template": template},
    )
    assert all(p.prompt.startswith("<|im_start|>user\n") for p in splits.train)
    with pytest.raises(ReplayRLError, match=r"may only use the field \{problem\}"):
        load_task(
            name="math",
            num_train=10,
            num_eval=1,
            seed=0,
            path=path,
            options={"prompt_template": "{question}"},
        )
    with pytest.raises(ReplayRLError, match=r"unknown option\(s\) \['template'\]"):
        load_task(
            name="math", num_train=10, num_eval=1, seed=0, path=path, options={"template": "x"}
        )


RIGHT = Reward(reward=1.0, correct=True, parsed=True)
WRONG = Reward(reward=0.0, correct=False, parsed=True)
UNPARSED = Reward(reward=0.0, correct=False, parsed=False)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("So it is \\boxed{0.5}.", "\\frac{1}{2}", RIGHT),  # equivalent form
        ("Hence \\boxed{\\sqrt{8}}", "2\\sqrt{2}", RIGHT),
        ("Try \\boxed{3}; no, it is \\boxed{\\frac{2}{4}}", "\\frac{1}{2}", RIGHT),  # last box
        ("It is \\boxed{\\frac{1}{2}}; no, \\boxed{3}", "\\frac{1}{2}", WRONG),
        ("So it is \\boxed{0.6}.", "\\frac{1}{2}", WRONG),
        ("The answer is 1/2.", "\\frac{1}{2}", UNPARSED),  # no box: not read at all
        ("So it is \\boxed{0.5", "\\frac{1}{2}", UNPARSED),  # cut off before the box closed
        ("\\boxed{}", "\\frac{1}{2}", UNPARSED),
    ],
)
def test_the_boxed_reward_grades_the_last_box(completion, answer, expected) -> None:
    assert score(kind="boxed", completion=completion, answer=answer) == expected


def test_the_loaded_gold_answers_grade_completions(tmp_path) -> None:
    path = write_parquet(tmp_path / "math.parquet", ROWS)
    splits = load_task(name="math", num_train=100, num_eval=2, seed=0, path=path)
    graded = {p.answer: p for p in splits.train + splits.eval}
    half, root = graded["\\frac{1}{2}"], graded["2\\sqrt{2}"]
    kind = splits.reward_kind
    assert score(kind=kind, completion="\\boxed{0.5}", answer=half.answer) == RIGHT
    assert score(kind=kind, completion="\\boxed{\\sqrt{8}}", answer=root.answer) == RIGHT
    assert score(kind=kind, completion="\\boxed{\\sqrt{2}}", answer=root.answer) == WRONG
    assert score(kind=kind, completion="0.5", answer=half.answer) == UNPARSED


GOOD = OPENR1_ROWS[0]


@pytest.mark.parametrize(
    ("name", "rows", "message"),
    [
        ("a.jsonl", [GOOD, {"problem": "P?"}], r"a.jsonl line 2: missing.*'solution'"),
        ("a.jsonl", [GOOD, {"solution": "\\boxed{1}"}], r"a.jsonl line 2: missing.*'problem'"),
        (
            "a.jsonl",
            [GOOD, {"problem": "P?", "solution": "It is 4."}],
            r"a.jsonl line 2: no gold answer: no 'answer' column value and the solution has no",
        ),
        (
            "a.parquet",
            [GOOD, {"problem": "P?", "solution": "It is \\boxed{4", "answer": ""}],
            r"a.parquet row 1: no gold answer",
        ),
        ("a.jsonl", [GOOD, GOOD], r"1 distinct questions, fewer than num_eval \+ 1"),
    ],
)
def test_bad_math_rows_raise_one_line_naming_file_and_row(tmp_path, name, rows, message) -> None:
    writer = write_jsonl if name.endswith(".jsonl") else write_parquet
    path = writer(tmp_path / name, rows)
    with pytest.raises(ReplayRLError, match=message) as error:
        load_task(name="math", num_train=10, num_eval=1, seed=0, path=path)
    assert "\n" not in str(error.value)


def test_empty_files_missing_columns_and_no_path_raise(tmp_path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ReplayRLError, match=r"empty.jsonl' is empty"):
        load_task(name="math", num_train=10, num_eval=1, seed=0, path=str(empty))
    no_rows = tmp_path / "none.parquet"
    pq.write_table(pa.table({"problem": pa.array([], pa.string()), "solution": []}), no_rows)
    with pytest.raises(ReplayRLError, match=r"none.parquet' has no rows"):
        load_task(name="math", num_train=10, num_eval=1, seed=0, path=str(no_rows))
    gsm8k_like = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.table({"question": ["Q?"], "answer": ["#### 1"]}), gsm8k_like)
    with pytest.raises(ReplayRLError, match=r"gsm8k.parquet: missing column 'problem'"):
        load_task(name="math", num_train=10, num_eval=1, seed=0, path=str(gsm8k_like))
    with pytest.raises(ReplayRLError, match=r"task 'math' needs a path"):
        load_task(name="math", num_train=10, num_eval=1, seed=0)
