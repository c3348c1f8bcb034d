"""Tasks: prompts with gold answers, split into disjoint train and held-out eval sets.

Two sources:

- procedurally generated arithmetic from `reasoning-gym` (`chain_sum`), reduced to the
  bare expression (`"48 + 57 ="`, answer `"105"`, target `" 105"`) because the full
  question text is too long for a tiny byte-level model. (`basic_arithmetic` is not
  offered: in reasoning-gym 0.1.25 its parenthesis-free items can show a different
  divisor than the one the answer used, e.g. `"77 / 0"` with answer `"11"`.)
- `chain_sum_steps`: the same expressions (3 terms by default), but the target writes each
  intermediate result left to right (`"48 + 57 + 12 ="` -> `" 105 + 12 = 117"`), so
  completions are several times longer and generation costs more per rollout; the reward
  checks only the final number (`"math"` reward: math-verify reads the last `= 117`).
- GSM8K-format word problems from a Parquet or JSONL file (`question`, and `answer`
  ending in `#### <number>`).
- `math`: competition problems in the OpenR1-Math-220k / MATH format from a Parquet or
  JSONL file: `problem`, `solution`, and optionally `answer` (OpenR1-Math has it, MATH does
  not). The gold answer is `answer` when the row has one, else the content of the last
  `\\boxed{...}` of `solution`; the prompt asks for the final answer in `\\boxed{}` and the
  `"boxed"` reward grades the completion's last box with math-verify.

Train and eval never share a prompt text; a seed fixes both splits. `target` is the
supervised completion for the warm start. This module knows nothing about tokenizers,
models or rewards beyond naming the reward kind (and reading a solution's last `\\boxed{}`
the way the `"boxed"` reward reads a completion's); it opens a file only through `open_file`
(the storage layer passes one for S3 URIs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import random
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from replayrl.core.rewards import last_boxed
from replayrl.errors import ReplayRLError

GENERATED_TASKS = ("chain_sum", "chain_sum_steps")
FILE_TASKS = ("gsm8k", "math")
SUPPORTED_TASKS = GENERATED_TASKS + FILE_TASKS

# The calibrated CPU demo: 2 terms of 2 digits (16,200 distinct expressions). reasoning-gym's
# own defaults (up to 6 terms of 4 digits) are far too hard for a 0.6M-parameter model.
DEFAULT_GENERATED_OPTIONS: dict[str, dict[str, Any]] = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
    # Three terms: one intermediate result, completions of up to 17 tokens with EOS.
    "chain_sum_steps": {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2},
}
# The reasoning-gym dataset each generated task draws its expressions from.
_GYM_DATASET = {"chain_sum": "chain_sum", "chain_sum_steps": "chain_sum"}
# Bare-integer targets are scored exactly; step-by-step targets by their final number.
_REWARD_KIND = {"chain_sum": "integer", "chain_sum_steps": "math"}
DEFAULT_PROMPT_TEMPLATE = "Question: {question}\nAnswer:"
# The math task's prompt: the problem and where to put the answer (str.format: the literal
# braces of \boxed{} are doubled). With task.prompt_format chat it is the user message that the
# model's chat template wraps (replayrl.policy.prompts; configs/qwen3-0.6b-math.yaml).
DEFAULT_MATH_PROMPT_TEMPLATE = "Problem: {problem}\nPut the final answer in \\boxed{{}}.\nSolution:"

# Rejection sampling gives up after this many draws per wanted prompt (plus a floor), so
# an option set with too few distinct prompts fails in well under a second.
_DRAWS_PER_PROMPT = 20
_MIN_DRAWS = 1000
_FINAL_ANSWER = re.compile(r"####\s*(.+?)\s*$")


@dataclass(frozen=True)
class Problem:
    """One prompt and its gold answer.

    `answer` is the canonical final answer (`"105"`); `target` is the supervised
    completion for the warm start (`" 105"`, or a GSM8K reference solution).
    """

    prompt_id: str
    prompt: str
    answer: str
    target: str


@dataclass(frozen=True)
class TaskSplits:
    """Disjoint train and held-out eval problems, and the reward kind that scores them."""

    train: tuple[Problem, ...]
    eval: tuple[Problem, ...]
    reward_kind: str


def splits_digest(splits: TaskSplits) -> dict[str, str]:
    """What the lineage records of its problems (`replayrl.engine.inputs`): the sha256 of
    the training problems and of the held-out ones (ids, prompts, answers and targets, in
    order) and the reward kind. Equal digests, the same problems: a task file rewritten with
    the same questions matches; one question changed anywhere does not."""

    def digest(problems: tuple[Problem, ...]) -> str:
        h = hashlib.sha256()
        for p in problems:
            for part in (p.prompt_id, p.prompt, p.answer, p.target):
                h.update(part.encode())
                h.update(b"\0")
        return h.hexdigest()

    return {
        "train_sha256": digest(splits.train),
        "eval_sha256": digest(splits.eval),
        "reward_kind": splits.reward_kind,
    }


def prompt_id_for(*, task: str, prompt: str) -> str:
    """A stable id from the prompt text: `"<task>-<12 hex digits of sha256>"`."""
    return f"{task}-{hashlib.sha256(prompt.encode()).hexdigest()[:12]}"


def _derived_seed(seed: int, stream: str) -> int:
    # reasoning-gym seeds item i with Random(seed + i), so seeds s and s+1 would give
    # shifted copies of one stream; hashing keeps the eval and train streams unrelated.
    return int.from_bytes(hashlib.sha256(f"{seed}/{stream}".encode()).digest()[:4], "big")


def load_task(
    *,
    name: str,
    num_train: int,
    num_eval: int,
    seed: int,
    path: str | None = None,
    options: Mapping[str, Any] | None = None,
    open_file: Callable[[str], BinaryIO] | None = None,
) -> TaskSplits:
    """Load task `name` as `num_eval` eval problems and (up to) `num_train` train problems.

    Generated tasks produce exactly `num_train` train problems; file tasks produce at most
    that many (fewer if the file is shorter). `options` are task settings: reasoning-gym
    config fields for generated tasks, `prompt_template` for gsm8k and math. `open_file` opens
    `path` for reading bytes; the default opens local paths and `file://` URIs.
    """
    if num_eval < 1 or num_train < 1:
        raise ReplayRLError(
            f"task {name!r}: num_train={num_train} and num_eval={num_eval} must both be >= 1"
        )
    options = dict(options or {})
    if name in GENERATED_TASKS:
        return _load_generated(
            name=name, num_train=num_train, num_eval=num_eval, seed=seed, options=options
        )
    if name == "gsm8k":
        if path is None:
            raise ReplayRLError("task 'gsm8k' needs a path: set task.path to a .parquet or .jsonl")
        return _load_gsm8k(
            path=path,
            num_train=num_train,
            num_eval=num_eval,
            seed=seed,
            options=options,
            open_file=open_file or _open_local,
        )
    if name == "math":
        if path is None:
            raise ReplayRLError("task 'math' needs a path: set task.path to a .parquet or .jsonl")
        return _load_math(
            path=path,
            num_train=num_train,
            num_eval=num_eval,
            seed=seed,
            options=options,
            open_file=open_file or _open_local,
        )
    raise ReplayRLError(f"unknown task {name!r}; supported tasks: {', '.join(SUPPORTED_TASKS)}")


# --- procedurally generated arithmetic ----------------------------------------------------


def _count_chain_sum_prompts(config: Any) -> int:
    """Exact number of distinct chain_sum expressions a config can produce."""
    total = 0
    for terms in range(config.min_terms, config.max_terms + 1):
        signs = 2 ** (terms - 1)
        if config.allow_negation:
            # Values span -(10^d - 1)..(10^d - 1); the widest digit count contains the rest.
            values = 2 * (10**config.max_digits - 1) + 1
            total += values**terms * signs
        else:
            for digits in range(config.min_digits, config.max_digits + 1):
                values = 10 if digits == 1 else 9 * 10 ** (digits - 1)
                total += values**terms * signs
    return total


def _make_dataset(*, name: str, seed: int, options: Mapping[str, Any]) -> Any:
    import reasoning_gym  # heavy (about 2 s): only generated tasks pay for it
    from reasoning_gym.factory import DATASETS

    gym_name = _GYM_DATASET[name]
    config_cls = DATASETS[gym_name][1]
    fields = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ReplayRLError(
            f"task {name!r}: unknown option(s) {unknown}; valid options: {sorted(fields)}"
        )
    types = {f.name: f.type for f in dataclasses.fields(config_cls)}
    for key, value in options.items():
        # reasoning-gym compares them without checking (a str or a NaN digit count raises
        # TypeError or loops): plain int, bool and float options must be of their type.
        expected = types[key]
        if expected in (int, bool, float) and not _of_type(value, expected):
            raise ReplayRLError(
                f"task {name!r}: option {key}={value!r} must be {expected.__name__}, like its "
                f"default; set task.options.{key} to one"
            )
    try:
        # size only bounds iteration; items are generated by index, so make it huge.
        return reasoning_gym.create_dataset(gym_name, seed=seed, size=2**31, **options)
    except AssertionError as e:  # reasoning-gym validates configs with assert
        raise ReplayRLError(f"task {name!r}: invalid options {dict(options)}: {e}") from e


def _of_type(value: Any, expected: type) -> bool:
    """`value` is an `expected` (int, bool or float; finite for a float); a bool is not an
    int, an int is a float."""
    if isinstance(value, bool) or expected is bool:
        return isinstance(value, bool) and expected is bool
    if expected is float:
        return isinstance(value, int | float) and math.isfinite(value)
    return isinstance(value, expected)


def _generated_problems(dataset: Any, *, name: str) -> Iterator[Problem]:
    for index in range(dataset.size):
        item = dataset[index]
        answer = item["answer"]
        if not re.fullmatch(r"-?\d+", answer):
            raise ReplayRLError(
                f"task {name!r} produced a non-integer answer {answer!r} for "
                f"{item['metadata']['expression']!r}; choose options with integer answers"
            )
        expression = item["metadata"]["expression"]
        prompt = f"{expression} ="
        target = steps_target(expression) if name == "chain_sum_steps" else f" {answer}"
        if not target.endswith(f" {answer}"):
            raise ReplayRLError(
                f"task {name!r}: step-by-step target {target!r} for {expression!r} does not "
                f"end in the answer {answer!r}; this is a bug in the task, please report it"
            )
        yield Problem(
            prompt_id=prompt_id_for(task=name, prompt=prompt),
            prompt=prompt,
            answer=answer,
            target=target,
        )


def steps_target(expression: str) -> str:
    """The step-by-step completion of a chain sum, evaluated left to right.

    Each step replaces the first two terms by their result and writes the rest out again,
    so the final number is the answer::

        steps_target("48 + 57 + 12")       == " 105 + 12 = 117"
        steps_target("42 - 25 - 73")       == " 17 - 73 = -56"
        steps_target("96 + -33 + -90")     == " 63 + -90 = -27"
        steps_target("48 + 57")            == " 105"   # two terms: no intermediate step
    """
    tokens = expression.split()
    if (
        len(tokens) % 2 == 0
        or any(op not in ("+", "-") for op in tokens[1::2])
        or not all(re.fullmatch(r"-?\d+", term) for term in tokens[::2])
    ):
        raise ReplayRLError(f"cannot read {expression!r} as a chain of + and - terms")
    total = int(tokens[0])
    rest = tokens[1:]
    steps = []
    while rest:
        op, term, rest = rest[0], int(rest[1]), rest[2:]
        total = total + term if op == "+" else total - term
        steps.append(" ".join([str(total), *rest]))
    return " " + " = ".join(steps or [str(total)])


def _draw_distinct(
    problems: Iterator[Problem], *, count: int, exclude: set[str], name: str, options: Mapping
) -> list[Problem]:
    chosen: list[Problem] = []
    seen = set(exclude)
    max_draws = _MIN_DRAWS + _DRAWS_PER_PROMPT * count
    for draws, problem in enumerate(problems, start=1):
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            chosen.append(problem)
            if len(chosen) == count:
                return chosen
        if draws >= max_draws:
            break
    raise ReplayRLError(
        f"task {name!r} with options {dict(options)}: found only {len(chosen)} new distinct "
        f"prompts in {max_draws} draws but need {count}; lower num_train/num_eval or widen "
        "the options (more digits or terms)"
    )


def _load_generated(
    *, name: str, num_train: int, num_eval: int, seed: int, options: dict[str, Any]
) -> TaskSplits:
    options = {**DEFAULT_GENERATED_OPTIONS[name], **options}
    eval_set = _make_dataset(name=name, seed=_derived_seed(seed, "eval"), options=options)
    if _GYM_DATASET[name] == "chain_sum":
        available = _count_chain_sum_prompts(eval_set.config)
        if available < num_train + num_eval:
            raise ReplayRLError(
                f"task {name!r} with options {options} has only {available} distinct "
                f"prompts, fewer than num_train + num_eval = {num_train + num_eval}; use "
                "more digits or terms (e.g. min_digits=max_digits=2 gives 16200) or "
                "lower num_train/num_eval"
            )
    train_set = _make_dataset(name=name, seed=_derived_seed(seed, "train"), options=options)
    eval_problems = _draw_distinct(
        _generated_problems(eval_set, name=name),
        count=num_eval,
        exclude=set(),
        name=name,
        options=options,
    )
    train_problems = _draw_distinct(
        _generated_problems(train_set, name=name),
        count=num_train,
        exclude={p.prompt for p in eval_problems},
        name=name,
        options=options,
    )
    return TaskSplits(
        train=tuple(train_problems), eval=tuple(eval_problems), reward_kind=_REWARD_KIND[name]
    )


# --- Parquet / JSONL files (GSM8K, math) -------------------------------------------------------------------


def _open_local(path: str) -> BinaryIO:
    local = path.removeprefix("file://")
    if "://" in local:
        raise ReplayRLError(
            f"cannot open {path!r}: only local paths and file:// URIs are readable here; "
            "read other URIs through the storage layer"
        )
    return open(local, "rb")


def _read_rows(
    *,
    path: str,
    open_file: Callable[[str], BinaryIO],
    columns: tuple[str, ...],
    optional: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Rows as dicts with `_where` (e.g. "line 3") for error messages.

    A Parquet file must have `columns` and is read for those and the `optional` ones it has
    only (OpenR1-Math's files also carry long generations); JSONL rows are checked later.
    """
    lowered = path.lower()
    if not lowered.endswith((".jsonl", ".parquet")):
        raise ReplayRLError(f"task file {path!r} must end in .jsonl or .parquet")
    try:
        with open_file(path) as handle:
            data = handle.read()
    except FileNotFoundError as e:
        raise ReplayRLError(f"task file {path!r} does not exist; check task.path") from e
    except OSError as e:
        raise ReplayRLError(f"cannot read task file {path!r}: {e}") from e
    if not data.strip():
        raise ReplayRLError(f"task file {path!r} is empty")
    rows: list[dict[str, Any]] = []
    if lowered.endswith(".jsonl"):
        for line_number, line in enumerate(_utf8_text(data, path=path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ReplayRLError(f"{path} line {line_number}: not valid JSON ({e})") from e
            if not isinstance(row, dict):
                raise ReplayRLError(f"{path} line {line_number}: expected a JSON object")
            rows.append({**row, "_where": f"line {line_number}"})
        if not rows:
            raise ReplayRLError(f"task file {path!r} has no rows (only blank lines)")
        return rows
    import pyarrow as pa  # only Parquet files pay for it
    import pyarrow.parquet as pq

    try:
        found = pq.read_schema(io.BytesIO(data)).names
    except pa.ArrowException as e:
        raise ReplayRLError(f"{path}: not a readable Parquet file ({e})") from e
    for column in columns:
        if column not in found:
            raise ReplayRLError(f"{path}: missing column {column!r}; found columns {found}")
    wanted = [*columns, *(column for column in optional if column in found)]
    try:
        table = pq.read_table(io.BytesIO(data), columns=wanted)
    except pa.ArrowException as e:  # a damaged page, or text that is not UTF-8
        raise ReplayRLError(f"{path}: columns {wanted} are not readable ({e})") from e
    if table.num_rows == 0:
        raise ReplayRLError(f"task file {path!r} has no rows")
    for row_number, row in enumerate(table.to_pylist()):
        rows.append({**row, "_where": f"row {row_number}"})
    return rows


def _utf8_text(data: bytes, *, path: str) -> str:
    """A JSONL file's text (a leading byte-order mark dropped); bytes that are not UTF-8 are
    refused with the line and column of the first one."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raw = e.object  # the bytes after a byte-order mark, which e.start counts in
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ReplayRLError(
            f"task file {path!r} is not UTF-8 text: byte 0x{raw[e.start]:02x} at line {line}, "
            f"column {column}; save it as UTF-8"
        ) from None


def _gsm8k_problem(row: Mapping[str, Any], *, path: str, template: str) -> Problem:
    where = row["_where"]
    for column in ("question", "answer"):
        if not isinstance(row.get(column), str):
            raise ReplayRLError(f"{path} {where}: missing or non-text column {column!r}")
    solution = row["answer"]
    match = _FINAL_ANSWER.search(solution)
    if match is None:
        raise ReplayRLError(
            f"{path} {where}: answer has no final '#### <number>' line: {solution[-80:]!r}"
        )
    try:
        prompt = template.format(question=row["question"])
    except (KeyError, IndexError) as e:
        raise ReplayRLError(
            f"prompt_template {template!r} may only use the field {{question}}: {e!r}"
        ) from e
    return Problem(
        prompt_id=prompt_id_for(task="gsm8k", prompt=prompt),
        prompt=prompt,
        answer=match.group(1).replace(",", ""),
        target=f" {solution}",
    )


def _load_gsm8k(
    *,
    path: str,
    num_train: int,
    num_eval: int,
    seed: int,
    options: dict[str, Any],
    open_file: Callable[[str], BinaryIO],
) -> TaskSplits:
    unknown = sorted(set(options) - {"prompt_template"})
    if unknown:
        raise ReplayRLError(
            f"task 'gsm8k': unknown option(s) {unknown}; valid: ['prompt_template']"
        )
    template = options.get("prompt_template", DEFAULT_PROMPT_TEMPLATE)
    rows = _read_rows(path=path, open_file=open_file, columns=("question", "answer"))
    problems = [_gsm8k_problem(row, path=path, template=template) for row in rows]
    return _split_file_problems(
        problems, path=path, num_train=num_train, num_eval=num_eval, seed=seed, reward_kind="math"
    )


def _split_file_problems(
    problems: list[Problem],
    *,
    path: str,
    num_train: int,
    num_eval: int,
    seed: int,
    reward_kind: str,
) -> TaskSplits:
    """A seeded shuffle of the distinct prompts: the first `num_eval` are held out."""
    distinct: dict[str, Problem] = {}
    for problem in problems:
        # Repeated questions would let eval leak into train; keep the first.
        distinct.setdefault(problem.prompt, problem)
    if len(distinct) < num_eval + 1:
        raise ReplayRLError(
            f"{path} has {len(distinct)} distinct questions, fewer than num_eval + 1 = "
            f"{num_eval + 1}; lower num_eval or use a larger file"
        )
    ordered = list(distinct.values())
    random.Random(seed).shuffle(ordered)
    return TaskSplits(
        train=tuple(ordered[num_eval : num_eval + num_train]),
        eval=tuple(ordered[:num_eval]),
        reward_kind=reward_kind,
    )


# --- OpenR1-Math / MATH-format files ---------------------------------------------------------


def _math_problem(row: Mapping[str, Any], *, path: str, template: str) -> Problem:
    where = row["_where"]
    for column in ("problem", "solution"):
        if not isinstance(row.get(column), str) or not row[column].strip():
            raise ReplayRLError(f"{path} {where}: missing, empty or non-text column {column!r}")
    solution = row["solution"]
    given = row.get("answer")
    if isinstance(given, str) and given.strip():
        answer = given.strip()
    else:
        answer = last_boxed(solution)
        if not answer:
            raise ReplayRLError(
                f"{path} {where}: no gold answer: no 'answer' column value and the solution "
                f"has no \\boxed{{...}} (it ends {solution[-80:]!r}); fix or drop the row"
            )
    try:
        prompt = template.format(problem=row["problem"])
    except (KeyError, IndexError) as e:
        raise ReplayRLError(
            f"prompt_template {template!r} may only use the field {{problem}}: {e!r}"
        ) from e
    return Problem(
        prompt_id=prompt_id_for(task="math", prompt=prompt),
        prompt=prompt,
        answer=answer,
        target=f" {solution}",
    )


def _load_math(
    *,
    path: str,
    num_train: int,
    num_eval: int,
    seed: int,
    options: dict[str, Any],
    open_file: Callable[[str], BinaryIO],
) -> TaskSplits:
    unknown = sorted(set(options) - {"prompt_template"})
    if unknown:
        raise ReplayRLError(f"task 'math': unknown option(s) {unknown}; valid: ['prompt_template']")
    template = options.get("prompt_template", DEFAULT_MATH_PROMPT_TEMPLATE)
    rows = _read_rows(
        path=path, open_file=open_file, columns=("problem", "solution"), optional=("answer",)
    )
    problems = [_math_problem(row, path=path, template=template) for row in rows]
    return _split_file_problems(
        problems, path=path, num_train=num_train, num_eval=num_eval, seed=seed, reward_kind="boxed"
    )
