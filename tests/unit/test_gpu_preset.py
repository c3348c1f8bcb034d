"""The GPU preset (configs/qwen2.5-0.5b-gsm8k.yaml) loads and validates with replayrl's own
config loader, carries the paper-like settings it documents, derives a valid on-policy arm,
and formats GSM8K prompts that the math reward scores, in Qwen2.5's chat format from the
tokenizer (a ChatML template built in code stands in for Qwen's): all without touching the network (the
model and data it names live in a bucket and are not read here).
"""

from __future__ import annotations

import io
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chatml import chat_tokenizer

from replayrl.config import load_config
from replayrl.core.rewards import score
from replayrl.policy.problems import load_task
from replayrl.policy.prompts import format_problems

pytestmark = pytest.mark.unit

PRESET = Path(__file__).resolve().parents[2] / "configs" / "qwen2.5-0.5b-gsm8k.yaml"


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection (a hub download, an S3 read) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"the preset test tried to reach the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_the_preset_loads_with_the_paper_like_settings(no_network):
    cfg = load_config(PRESET)
    assert cfg.arm == "replay"
    assert cfg.model.source.endswith("Qwen2.5-0.5B-Instruct") and cfg.model.source != "tiny"
    assert (cfg.task.name, cfg.task.path.endswith(".parquet")) == ("gsm8k", True)
    assert cfg.rollout.backend == "vllm"
    assert cfg.rollout.samples_per_prompt == 16  # G, the paper's group size
    assert (cfg.train.loss, cfg.train.clip_eps) == ("grpo", 0.2)  # clipped ratio, no KL term
    assert cfg.buffer.sample_with_replacement is False and cfg.buffer.max_staleness is None
    # The replay design the header comment derives: R = 1024, N/R = 4 iterations, so
    # x = S·N/R = 16 gradient steps, y = S·B/R = 2.
    assert cfg.rollouts_per_iteration == 1024
    assert cfg.staleness_horizon == 16.0
    assert cfg.replay_ratio == 2.0
    # The held-out set fits in GSM8K's train split (7,473 problems) beside the train prompts.
    assert cfg.task.num_train + cfg.task.num_eval <= 7473
    assert cfg.eval.num_prompts <= cfg.task.num_eval


def test_the_on_policy_arm_of_the_preset_is_valid(no_network):
    cfg = load_config(PRESET, arm="on-policy")
    steps_x_batch = cfg.train.steps_per_iteration * cfg.train.batch_size
    assert cfg.rollouts_per_iteration == cfg.buffer.capacity == steps_x_batch == 2048
    assert cfg.replay_ratio == 1.0
    assert cfg.rollout.samples_per_prompt == 16


def test_the_header_cites_the_paper_and_says_where_the_numbers_come_from():
    header = PRESET.read_text().split("\narm:")[0]
    assert "Efficient RL Training for LLMs with Experience Replay" in header
    assert "arXiv:2604.08706" in header
    # The values are derived from the theory, not quoted, and the header says so.
    assert "not from the paper" in header and "Theorem 4.5 (§4)" in header and "mu" in header


def gsm8k_parquet(rows: int) -> bytes:
    table = pa.table(
        {
            "question": [f"Tom has {i} apples and buys 3 more. How many now?" for i in range(rows)],
            "answer": [f"{i} + 3 = {i + 3}\n#### {i + 3}" for i in range(rows)],
        }
    )
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def test_the_prompt_template_makes_chat_prompts_the_reward_scores(no_network):
    cfg = load_config(PRESET)
    data = gsm8k_parquet(cfg.task.num_eval + 20)
    opened: list[str] = []

    def open_file(path: str):
        opened.append(path)
        return io.BytesIO(data)

    splits = load_task(
        name=cfg.task.name,
        num_train=cfg.task.num_train,
        num_eval=cfg.task.num_eval,
        seed=cfg.seed,
        path=cfg.task.path,
        options=cfg.task.options,
        open_file=open_file,
    )
    assert opened == [cfg.task.path]
    assert (len(splits.eval), len(splits.train)) == (cfg.task.num_eval, 20)
    question = splits.eval[0].prompt
    assert "Tom has" in question and "<|im_start|>" not in question
    [problem] = format_problems(
        splits.eval[:1],
        tokenizer=chat_tokenizer(),
        prompt_format=cfg.task.prompt_format,
        system_prompt=cfg.task.system_prompt,
        template_args=cfg.task.chat_template_args,
    )
    # What the preset wrote out by hand before it read the template from the tokenizer.
    assert problem.prompt == (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within "
        f"\\boxed{{}}.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    right = f"3 more apples. The answer is \\boxed{{{problem.answer}}}."
    wrong = f"The answer is \\boxed{{{int(problem.answer) + 1}}}."
    assert score(kind=splits.reward_kind, completion=right, answer=problem.answer).correct
    assert not score(kind=splits.reward_kind, completion=wrong, answer=problem.answer).correct
