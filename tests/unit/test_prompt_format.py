"""task.prompt_format: "plain" keeps the task's prompts byte for byte; "chat" renders each with
the checkpoint tokenizer's own chat template (a small ChatML template given to the byte
tokenizer here, no download), and the rollout rows store that text and its token ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from chatml import CHATML, chat_tokenizer

from replayrl.config import load_config
from replayrl.config.load import config_from_dict
from replayrl.engine.steps import make_rollouts
from replayrl.errors import ReplayRLError
from replayrl.policy.generation import TransformersBackend
from replayrl.policy.problems import Problem, TaskSplits, prompt_id_for
from replayrl.policy.prompts import format_problems
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import build_byte_tokenizer, chat_template_hash

PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


def problems(*prompts: str) -> list[Problem]:
    return [
        Problem(
            prompt_id=prompt_id_for(task="chain_sum", prompt=p), prompt=p, answer="0", target=""
        )
        for p in prompts
    ]


def test_chat_renders_each_prompt_with_the_tokenizers_template() -> None:
    tokenizer = chat_tokenizer()
    given = problems("48 + 57 =", "12 - 3 =")
    rendered = format_problems(
        given,
        tokenizer=tokenizer,
        prompt_format="chat",
        system_prompt="Add.",
        template_args={"enable_thinking": False},
    )
    assert [p.prompt for p in rendered] == [
        "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n48 + 57 =<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n12 - 3 =<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    ]
    # The problem keeps its id and answer: the format changes only what the policy reads.
    assert [(p.prompt_id, p.answer) for p in rendered] == [(p.prompt_id, p.answer) for p in given]
    # The byte tokenizer: one id per byte of the rendered text, nothing added in front.
    ids = tokenizer(rendered[0].prompt, add_special_tokens=False)["input_ids"]
    assert ids == list(rendered[0].prompt.encode())


def test_without_a_system_prompt_or_arguments_the_template_writes_only_the_user_turn() -> None:
    [p] = format_problems(problems("1 + 1 ="), tokenizer=chat_tokenizer(), prompt_format="chat")
    assert p.prompt == "<|im_start|>user\n1 + 1 =<|im_end|>\n<|im_start|>assistant\n"


def test_plain_leaves_every_prompt_as_it_was_and_reads_no_tokenizer() -> None:
    given = problems("48 + 57 =", "Question: why?\nAnswer:")
    assert format_problems(given, tokenizer=None, prompt_format="plain") == given


def test_chat_without_a_template_is_one_clear_line() -> None:
    with pytest.raises(ReplayRLError, match="has no chat template") as e:
        format_problems(problems("1 + 1 ="), tokenizer=build_byte_tokenizer(), prompt_format="chat")
    assert "\n" not in str(e.value) and "prompt_format: plain" in str(e.value)


def test_a_template_that_refuses_the_conversation_is_a_replayrl_error() -> None:
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
        "supported') }}{% endif %}{{ messages[0]['content'] }}"
    )
    with pytest.raises(ReplayRLError, match="System role not supported"):
        format_problems(
            problems("1 + 1 ="), tokenizer=tokenizer, prompt_format="chat", system_prompt="Hi."
        )


def test_the_template_hash_names_the_template() -> None:
    tokenizer = build_byte_tokenizer()
    assert chat_template_hash(tokenizer) is None
    tokenizer.chat_template = CHATML
    first = chat_template_hash(tokenizer)
    tokenizer.chat_template = CHATML.replace("assistant", "model")
    assert first is not None and len(first) == 12 and chat_template_hash(tokenizer) != first


def chat_config(**task):
    cfg = load_config(PRESET).to_dict()
    cfg["model"]["source"] = "/models/a-chat-model"  # never loaded here
    cfg["task"].update(task)
    return config_from_dict(cfg)


def test_the_config_hash_covers_the_format_and_plain_keeps_the_old_hash() -> None:
    plain = load_config(PRESET)
    assert plain.task.prompt_format == "plain"
    assert plain.config_hash() == "52633a316496"  # as before prompt formats existed
    base = chat_config().config_hash()
    chat = chat_config(prompt_format="chat")
    assert chat.config_hash() != base
    assert chat_config(prompt_format="chat", system_prompt="Be brief.").config_hash() not in (
        base,
        chat.config_hash(),
    )
    thinking = chat_config(prompt_format="chat", chat_template_args={"enable_thinking": False})
    assert thinking.config_hash() != chat.config_hash()
    assert thinking.flat()["task.chat_template_args.enable_thinking"] is False


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["task.prompt_format=chat"], "the tiny model's byte tokenizer has none"),
        (["task.prompt_format=jinja"], "task.prompt_format must be one of plain, chat"),
        (["task.system_prompt=Be brief."], "apply to task.prompt_format: chat only"),
        (
            [
                "model.source=/models/m",
                "task.prompt_format=chat",
                "task.chat_template_args={tokenize: true}",
            ],
            "may not set ['tokenize']",
        ),
    ],
)
def test_a_prompt_format_the_run_cannot_use_is_refused_at_load(overrides, message) -> None:
    with pytest.raises(ReplayRLError) as e:
        load_config(PRESET, overrides=overrides)
    assert message in str(e.value)


def test_rollout_rows_store_the_rendered_prompt_and_its_token_ids() -> None:
    tokenizer = chat_tokenizer()
    model = build_tiny_model(
        vocab_size=264,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        seed=0,
    )
    backend = TransformersBackend(model, tokenizer, batch_size=64)
    cfg = chat_config(
        prompt_format="chat",
        system_prompt="Add.",
        chat_template_args={"enable_thinking": False},
    )
    splits = TaskSplits(
        train=tuple(problems("48 + 57 =", "12 - 3 =", "7 + 7 =")), eval=(), reward_kind="integer"
    )
    table = make_rollouts(cfg, splits, backend, iteration=1, policy_version=0).table
    assert table.num_rows == cfg.rollouts_per_iteration
    by_id = {p.prompt_id: p.prompt for p in splits.train}
    for row in table.select(["prompt_id", "prompt", "prompt_token_ids"]).to_pylist():
        user = by_id[row["prompt_id"]]
        expected = (
            f"<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
        assert row["prompt"] == expected
        assert row["prompt_token_ids"] == tokenizer(expected, add_special_tokens=False)["input_ids"]
