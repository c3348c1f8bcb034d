"""Prompt formats: the text the policy reads for a problem (`task.prompt_format`).

- `plain`: the task's prompt as it is (`Problem.prompt`: the demo's `"48 + 57 ="`, or a file
  task's `prompt_template` filled in), byte for byte.
- `chat`: that text is the user message of a conversation, after an optional system message,
  rendered by the checkpoint tokenizer's own chat template with a generation prompt, so a chat
  model reads the format it was tuned on and a new model needs no template written by hand.
  Template arguments (Qwen3's `enable_thinking`) reach the template as variables.

A ChatML template (Qwen) with a system prompt turns the problem `"1 + 1 ="` into::

    "<|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\n1 + 1 =<|im_end|>\\n"
    "<|im_start|>assistant\\n"

The rendered text replaces `Problem.prompt`: generation tokenizes it without special tokens
(the template writes any it wants), and the rollout rows store that text and those ids, so a
template that changes between versions of a tokenizer shows in the rows. A problem keeps its
`prompt_id`: it names the problem, whatever the format.

This module knows nothing about models or storage: it takes the tokenizer and the settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from replayrl.config.schema import PROMPT_FORMATS
from replayrl.errors import ReplayRLError
from replayrl.policy.problems import Problem


def format_problems(
    problems: Sequence[Problem],
    *,
    tokenizer: PreTrainedTokenizerBase | None,
    prompt_format: str,
    system_prompt: str | None = None,
    template_args: Mapping[str, Any] | None = None,
) -> list[Problem]:
    """`problems` with their prompts in `prompt_format`; "plain" returns them unchanged and
    never reads `tokenizer`. "chat" raises ReplayRLError when `tokenizer` has no chat template
    or the template refuses the conversation."""
    if prompt_format == "plain":
        return list(problems)
    if prompt_format != "chat":
        raise ReplayRLError(
            f"unknown prompt format {prompt_format!r}; use one of {', '.join(PROMPT_FORMATS)}"
        )
    if tokenizer is None or not tokenizer.chat_template:
        name = getattr(tokenizer, "name_or_path", None) or "the checkpoint's tokenizer"
        raise ReplayRLError(
            f"task.prompt_format is chat but {name} has no chat template; use a checkpoint "
            "whose tokenizer has one, or task.prompt_format: plain"
        )
    return [
        dataclasses.replace(
            p,
            prompt=chat_prompt(
                p.prompt,
                tokenizer=tokenizer,
                system_prompt=system_prompt,
                template_args=template_args,
            ),
        )
        for p in problems
    ]


def chat_prompt(
    user: str,
    *,
    tokenizer: PreTrainedTokenizerBase,
    system_prompt: str | None = None,
    template_args: Mapping[str, Any] | None = None,
) -> str:
    """The chat template's text for one user message (after `system_prompt` if given), ending
    with the generation prompt, i.e. where the assistant's answer begins."""
    import jinja2  # transformers renders chat templates with it

    messages = [{"role": "user", "content": user}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **dict(template_args or {})
        )
    except jinja2.TemplateError as e:
        # A template's own raise_exception (e.g. "System role not supported") lands here.
        raise ReplayRLError(
            f"the chat template of {tokenizer.name_or_path or 'the tokenizer'} refused the "
            f"prompt: {e}; check task.system_prompt and task.chat_template_args"
        ) from None
    if not isinstance(text, str) or not text:
        raise ReplayRLError(
            f"the chat template of {tokenizer.name_or_path or 'the tokenizer'} rendered "
            f"{text!r} for a prompt; it must write text"
        )
    return text
