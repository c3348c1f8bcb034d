"""Tasks: disjoint, deterministic splits; bare-expression prompts; GSM8K-format files."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replayrl.errors import ReplayRLError
from replayrl.policy.problems import Problem, load_task, prompt_id_for

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "gsm8k_tiny.jsonl"


def _prompts(problems: tuple[Problem, ...]) -> set[str]:
    return {p.prompt for p in problems}


def test_chain_sum_splits_are_disjoint_sized_and_distinct() -> None:
    splits = load_task(name="chain_sum", num_train=3000, num_eval=300, seed=0)
    assert splits.reward_kind == "integer"
    assert (len(splits.train), len(splits.eval)) == (3000, 300)
    assert len(_prompts(splits.train)) == 3000
    assert len(_prompts(splits.eval)) == 300
    assert not _prompts(splits.train) & _prompts(splits.eval)


def test_chain_sum_problems_are_bare_expressions_with_correct_answers() -> None:
    splits = load_task(name="chain_sum", num_train=200, num_eval=50, seed=3)
    for problem in splits.train + splits.eval:
        match = re.fullmatch(r"(\d{2}) ([+-]) (\d{2}) =", problem.prompt)
        assert match is not None, problem.prompt
        left, op, right = int(match.group(1)), match.group(2), int(match.group(3))
        assert int(problem.answer) == (left + right if op == "+" else left - right)
        assert problem.target == f" {problem.answer}"
        assert problem.prompt_id == prompt_id_for(task="chain_sum", prompt=problem.prompt)
        assert re.fullmatch(r"chain_sum-[0-9a-f]{12}", problem.prompt_id)


def test_chain_sum_is_deterministic_and_eval_does_not_depend_on_num_train() -> None:
    first = load_task(name="chain_sum", num_train=100, num_eval=40, seed=7)
    again = load_task(name="chain_sum", num_train=100, num_eval=40, seed=7)
    more_train = load_task(name="chain_sum", num_train=500, num_eval=40, seed=7)
    other_seed = load_task(name="chain_sum", num_train=100, num_eval=40, seed=8)
    assert first == again
    assert more_train.eval == first.eval
    assert more_train.train[:100] == first.train
    assert other_seed.eval != first.eval


def test_chain_sum_can_use_nearly_every_distinct_prompt() -> None:
    # 2 terms of 2 digits: 90 * 90 * 2 = 16,200 distinct expressions.
    splits = load_task(name="chain_sum", num_train=15_000, num_eval=1_000, seed=0)
    assert len(_prompts(splits.train) | _prompts(splits.eval)) == 16_000


def test_one_digit_chain_sum_has_too_few_prompts() -> None:
    with pytest.raises(ReplayRLError, match=r"only 200 distinct prompts.*more digits"):
        load_task(
            name="chain_sum",
            num_train=500,
            num_eval=64,
            seed=0,
            options={"min_digits": 1, "max_digits": 1},
        )


def test_one_digit_chain_sum_within_its_size_works() -> None:
    splits = load_task(
        name="chain_sum",
        num_train=150,
        num_eval=40,
        seed=0,
        options={"max_digits": 1, "min_digits": 1},
    )
    assert not _prompts(splits.train) & _prompts(splits.eval)
    assert all(re.fullmatch(r"\d [+-] \d =", p.prompt) for p in splits.train)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"name": "sudoku"},
            r"unknown task 'sudoku'; supported tasks: chain_sum, chain_sum_steps, gsm8k, math",
        ),
        ({"name": "basic_arithmetic"}, r"supported tasks: chain_sum, chain_sum_steps, gsm8k, math"),
        ({"name": "chain_sum", "options": {"min_digit": 2}}, r"unknown option.*min_digits"),
        ({"name": "chain_sum", "options": {"min_terms": 3, "max_terms": 2}}, "max_terms"),
        ({"name": "chain_sum", "num_eval": 0}, "must both be >= 1"),
        ({"name": "gsm8k"}, "needs a path"),
    ],
)
def test_bad_task_arguments_raise(kwargs: dict, message: str) -> None:
    arguments = {"num_train": 10, "num_eval": 5, "seed": 0, **kwargs}
    with pytest.raises(ReplayRLError, match=message):
        load_task(**arguments)


def test_gsm8k_fixture_loads() -> None:
    splits = load_task(name="gsm8k", num_train=100, num_eval=5, seed=0, path=str(FIXTURE))
    assert splits.reward_kind == "math"
    assert (len(splits.eval), len(splits.train)) == (5, 25)
    assert not _prompts(splits.train) & _prompts(splits.eval)
    by_answer = {p.answer: p for p in splits.train + splits.eval}
    assert "1550" in by_answer  # "#### 1,550": commas removed
    assert "-7" in by_answer
    library = by_answer["1550"]
    assert library.prompt == (
        "Question: A library has 1,200 books and gets 350 more. "
        "How many books does it have now?\nAnswer:"
    )
    assert library.target.startswith(" 1200 + 350")
    assert library.target.endswith("#### 1,550")


def test_gsm8k_is_deterministic_and_honours_the_template() -> None:
    path = f"file://{FIXTURE}"
    first = load_task(name="gsm8k", num_train=10, num_eval=4, seed=1, path=path)
    assert first == load_task(name="gsm8k", num_train=10, num_eval=4, seed=1, path=path)
    assert first != load_task(name="gsm8k", num_train=10, num_eval=4, seed=2, path=path)
    templated = load_task(
        name="gsm8k",
        num_train=10,
        num_eval=4,
        seed=1,
        path=path,
        options={"prompt_template": "Q: {question}\nA:"},
    )
    assert [p.answer for p in templated.eval] == [p.answer for p in first.eval]
    assert all(p.prompt.startswith("Q: ") and p.prompt.endswith("\nA:") for p in templated.eval)


def _parquet_bytes(columns: dict[str, list[str]]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table(columns), sink)
    return sink.getvalue()


def _jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _opener(data: bytes):
    return lambda uri: io.BytesIO(data)


def test_gsm8k_parquet_through_open_file() -> None:
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    data = _parquet_bytes(
        {"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]}
    )
    from_parquet = load_task(
        name="gsm8k",
        num_train=100,
        num_eval=5,
        seed=0,
        path="s3://bucket/gsm8k/train.parquet",
        open_file=_opener(data),
    )
    from_jsonl = load_task(name="gsm8k", num_train=100, num_eval=5, seed=0, path=str(FIXTURE))
    assert from_parquet == from_jsonl


GOOD = {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}


@pytest.mark.parametrize(
    ("path", "data", "message"),
    [
        ("s3://b/empty.jsonl", b"", r"s3://b/empty.jsonl' is empty"),
        ("s3://b/x.jsonl", _jsonl_bytes([GOOD, {"question": "Q?"}]), r"line 2: missing.*'answer'"),
        ("s3://b/x.jsonl", _jsonl_bytes([GOOD, {**GOOD, "answer": "4"}]), r"line 2: answer has no"),
        ("s3://b/x.jsonl", _jsonl_bytes([GOOD]) + b"{oops\n", r"line 2: not valid JSON"),
        ("s3://b/x.jsonl", _jsonl_bytes([GOOD, GOOD, GOOD]), r"1 distinct questions.*num_eval"),
        ("s3://b/x.parquet", _parquet_bytes({"question": ["Q?"]}), r"missing column 'answer'"),
        (
            "s3://b/x.parquet",
            _parquet_bytes({"question": ["a", "b"], "answer": ["#### 1", "2"]}),
            r"x.parquet row 1: answer has no",
        ),
        ("s3://b/x.csv", b"question,answer\n", r"must end in .jsonl or .parquet"),
        ("s3://b/x.parquet", _jsonl_bytes([GOOD]), r"x.parquet: not a readable Parquet file"),
    ],
)
def test_bad_gsm8k_files_raise(path: str, data: bytes, message: str) -> None:
    with pytest.raises(ReplayRLError, match=message):
        load_task(
            name="gsm8k", num_train=10, num_eval=1, seed=0, path=path, open_file=_opener(data)
        )


def test_gsm8k_missing_file_and_remote_uri_without_opener_raise(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ReplayRLError, match=r"nope.jsonl' does not exist"):
        load_task(name="gsm8k", num_train=10, num_eval=1, seed=0, path=str(missing))
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(ReplayRLError, match="cannot read task file"):
        load_task(
            name="gsm8k", num_train=10, num_eval=1, seed=0, path=str(tmp_path / "folder.jsonl")
        )
    with pytest.raises(ReplayRLError, match="storage layer"):
        load_task(name="gsm8k", num_train=10, num_eval=1, seed=0, path="s3://bucket/x.jsonl")
