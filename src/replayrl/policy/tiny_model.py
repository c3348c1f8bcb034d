"""The CPU demo model: a tiny Qwen2 built in code, saved in the plain Hugging Face layout.

`build_tiny_model` makes a ~0.6M-parameter `Qwen2ForCausalLM` (hidden 128, 4 layers,
4 query / 2 key-value heads, tied embeddings, float32) whose weights depend only on the
seed. `save_model`/`load_model` write and read `save_pretrained` directories (safetensors),
so `AutoModelForCausalLM`, `AutoTokenizer` and vLLM load them with no custom code.
`supervised_loss` is the warm-start objective that gives RL a policy with some signal.

This module knows nothing about tasks, rewards, RL losses or remote storage: `directory`
is always a local path (the storage layer copies checkpoints to and from S3).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from replayrl.errors import ReplayRLError
from replayrl.policy.tokenizer import EOS_TOKEN_ID, PAD_TOKEN_ID, VOCAB_SIZE

IGNORE_INDEX = -100  # label value torch's cross_entropy skips


def build_tiny_model(
    *,
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 256,
    seed: int,
) -> Qwen2ForCausalLM:
    """A freshly initialised tiny Qwen2; the same seed gives bit-identical weights.

    Special-token ids are those of `replayrl.policy.tokenizer` (eos 256, pad 257; no bos, since
    prompts are plain text and nothing prepends one). The global torch RNG is untouched.
    """
    eos_token_id, pad_token_id = EOS_TOKEN_ID, PAD_TOKEN_ID
    if vocab_size <= max(eos_token_id, pad_token_id):
        raise ReplayRLError(
            f"vocab_size={vocab_size} has no row for eos={eos_token_id}/pad={pad_token_id}; "
            f"use replayrl.policy.tokenizer.VOCAB_SIZE ({VOCAB_SIZE})"
        )
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    # fork_rng: seeding must not change the random stream of whoever called us.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None
    )
    return model


def save_model(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, directory: str | Path
) -> None:
    """Write model (safetensors) and tokenizer into `directory` in the HF layout.

    Files are overwritten in place; a crash mid-write leaves a partial directory, which is
    why callers write checkpoints to a fresh directory and mark it complete afterwards.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def load_model(directory: str | Path) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load `(model, tokenizer)` saved by `save_model` (or any HF causal LM), in float32."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ReplayRLError(
            f"{directory} holds no model (no config.json); point at a save_pretrained directory"
        )
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model, tokenizer


def supervised_loss(
    *,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    targets: Sequence[str],
) -> torch.Tensor:
    """Mean next-token cross-entropy over the target tokens and the eos after them.

    Each row is `prompt + target + eos`, right-padded; prompt and pad positions are masked
    out, so the model learns only to complete. Example: prompt `"48 + 57 ="`, target
    `" 105"` trains the 5 predictions `" ", "1", "0", "5", eos`.
    Returns a scalar tensor (token mean over the whole batch) with a graph for backward.
    """
    if len(prompts) != len(targets) or not prompts:
        raise ValueError(f"need equal, non-empty prompts/targets: {len(prompts)}/{len(targets)}")
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    target_ids = tokenizer(list(targets), add_special_tokens=False)["input_ids"]
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = [p + t + [eos_id] for p, t in zip(prompt_ids, target_ids, strict=True)]
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, (row, prompt) in enumerate(zip(rows, prompt_ids, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, len(prompt) : len(row)] = torch.tensor(row[len(prompt) :])
        attention_mask[i, : len(row)] = 1
    device = next(model.parameters()).device
    logits = model(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
    ).logits  # (B, T, V)
    # Position t predicts token t+1.
    shifted_logits = logits[:, :-1, :].float()  # (B, T-1, V)
    shifted_labels = labels[:, 1:].to(device)  # (B, T-1)
    return torch.nn.functional.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.shape[-1]),
        shifted_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
    )
