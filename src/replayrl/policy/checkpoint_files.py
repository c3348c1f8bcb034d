"""Reading a Hugging Face checkpoint directory for the vLLM engine: its tokenizer and its
safetensors weights, streamed one tensor at a time on the CPU."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from replayrl.errors import ReplayRLError


def checkpoint_tokenizer(directory: Path):
    """The checkpoint's own Hugging Face tokenizer; it must have an EOS token to stop on."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as e:
        raise ReplayRLError(f"Cannot load the tokenizer at '{directory}': {e}") from None
    if tokenizer.eos_token_id is None:
        raise ReplayRLError(
            f"The tokenizer at '{directory}' has no eos token; completions could not stop."
        )
    return tokenizer


def generation_eos_ids(directory: Path) -> int | list[int] | None:
    """The `eos_token_id` of the checkpoint's generation_config.json (an int, a list, or
    None without one), which vLLM stops on too (`generation.stop_token_ids`)."""
    path = Path(directory) / "generation_config.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise ReplayRLError(f"Cannot read '{path}': {e}. Fix or remove the file.") from None


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files holding a checkpoint's weights: those its
    model.safetensors.index.json names, else model.safetensors; a ReplayRLError if none."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / n for n in names]
    else:
        files = [directory / "model.safetensors"]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ReplayRLError(
            f"No weights to load at '{directory}': {', '.join(missing)} missing; vLLM needs a "
            "Hugging Face checkpoint directory with safetensors weights."
        )
    return files


def stream_tensors(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in `files`, read one at a time on the CPU."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
