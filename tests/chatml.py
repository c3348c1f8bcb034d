"""A small ChatML chat template (the format of Qwen's templates, with Qwen3's
`enable_thinking` switch) and the byte tokenizer carrying it: a chat tokenizer built in code,
so tests of `task.prompt_format: chat` download nothing."""

from __future__ import annotations

from replayrl.policy.tokenizer import build_byte_tokenizer

# Thinking off writes the empty think block after the generation prompt, as Qwen3's does.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def chat_tokenizer():
    """The byte tokenizer with `CHATML` as its chat template."""
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = CHATML
    return tokenizer
