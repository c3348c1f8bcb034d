"""A byte-level tokenizer built in code, in the Hugging Face layout, and the one decode
every completion goes through.

The CPU demo model reads and writes raw bytes: id `b` is byte `b` (0..255), plus two
special tokens, `<|endoftext|>` (end of sequence, id 256) and `<|pad|>` (id 257), and one
placeholder, `<|unused|>` (id 258). There are no merges, so a string of n UTF-8 bytes is
always n tokens, and the encoding of a concatenation is the concatenation of the encodings
(the warm start and the rollout code rely on this when they tokenize prompt and completion
separately).

The model's embedding matrix may have more rows than the tokenizer has tokens: 264 for
the demo model (aligned matmuls), 151,936 for the `shapes-cpu` preset (Qwen2.5's
vocabulary size), and a real Qwen2.5 checkpoint itself has 151,936 rows for 151,665
tokens. A sampled id past the tokenizer's tokens has no text: Hugging Face's `decode`
drops it without a word (a slow tokenizer may raise). `decode_ids` writes `<|unused|>` in
its place instead, so a completion that contains one never reads as a clean answer. The
placeholder is one token, not one per padded id: 151,678 tokens in `tokenizer.json` would
cost 0.9 s and ~94 MB per load as vocabulary entries (14 s and ~460 MB as added tokens)
against ~0 for one, measured on this project's 2-core CPU machine.

There is no beginning-of-sequence token: prompts are plain text and never empty, and
nothing prepends one. `save_pretrained` writes an ordinary `tokenizer.json`, so
`AutoTokenizer.from_pretrained(directory)` (and vLLM) load it with no custom code.
Padding is on the left, the side generation needs; it is stored in the saved config.

`chat_template_hash` names the chat template a tokenizer carries (a lineage records it beside
its params; `replayrl.policy.prompts` renders prompts with it).

This module knows nothing about models, tasks or storage.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from replayrl.errors import ReplayRLError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
NUM_BYTE_TOKENS = 256
EOS_TOKEN_ID = 256
PAD_TOKEN_ID = 257
# What an id with no token of its own decodes to (see `decode_ids`). Not a special token:
# `skip_special_tokens` keeps it, so it shows in a completion's text.
UNUSED_TOKEN = "<|unused|>"
UNUSED_TOKEN_ID = 258
NUM_TOKENS = 259  # 256 bytes, eos, pad, the placeholder
# Rows in the demo model's embedding matrix: the tokens rounded up to a multiple of 8
# (aligned matmuls). Encoding ordinary text never produces ids 258..263; the warm start
# teaches the model to give them negligible probability.
VOCAB_SIZE = 264


def _byte_to_symbol() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode map, which `pre_tokenizers.ByteLevel` emits.

    The ByteLevel pre-tokenizer rewrites each byte as one printable character; the BPE
    vocabulary must be keyed by those characters for byte b to map to id b.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codepoints = printable[:]
    extra = 0
    for byte in range(NUM_BYTE_TOKENS):
        if byte not in printable:
            printable.append(byte)
            codepoints.append(NUM_BYTE_TOKENS + extra)
            extra += 1
    return {byte: chr(cp) for byte, cp in zip(printable, codepoints, strict=True)}


def build_byte_tokenizer(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Build the byte-level tokenizer for a model with `vocab_size` embedding rows: byte
    b -> id b, eos 256, pad 257, placeholder 258, left padding.

    The tokenizer is the same for every `vocab_size`: encoding never produces an id past
    258, and `decode_ids` turns every id from 258 to `vocab_size - 1` into `<|unused|>`.
    `vocab_size` must leave a row for each of the 259 tokens.

    Example:
        >>> tok = build_byte_tokenizer(vocab_size=151_936)
        >>> tok.encode("48 + 57 =")
        [52, 56, 32, 43, 32, 53, 55, 32, 61]
        >>> decode_ids(tok, [32, 49, 151_000, 53, 256])
        ' 1<|unused|>5'
    """
    if vocab_size < NUM_TOKENS:
        raise ReplayRLError(
            f"vocab_size={vocab_size} leaves no room for the byte tokenizer's {NUM_TOKENS} "
            f"tokens; use at least {VOCAB_SIZE} (replayrl.policy.tokenizer.VOCAB_SIZE)."
        )
    vocab = {symbol: byte for byte, symbol in _byte_to_symbol().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no GPT-2 word splitting; with no merges it would not change the
    # ids, but it keeps the pre-tokenizer a pure byte -> symbol rewrite.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    # normalized=False: matched in the raw text, like the special tokens; its characters are
    # printable ASCII, which the byte-level decoder passes through unchanged.
    core.add_tokens([AddedToken(UNUSED_TOKEN, special=False, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
    )
    ids = (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.convert_tokens_to_ids(UNUSED_TOKEN),
    )
    if ids != (EOS_TOKEN_ID, PAD_TOKEN_ID, UNUSED_TOKEN_ID) or len(tokenizer) != NUM_TOKENS:
        raise AssertionError(
            f"token ids drifted: eos, pad, unused = {ids}, {len(tokenizer)} tokens"
        )
    return tokenizer


def decode_ids(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], *, skip_special_tokens: bool = True
) -> str:
    """`tokenizer.decode(ids)`, except that every id with no token (negative, or at least
    `len(tokenizer)`: a padded embedding row) reads `<|unused|>` instead of vanishing or
    raising. Works with any Hugging Face tokenizer, not only the byte tokenizer.

    Example (byte tokenizer, a model with 151,936 rows):
        [32, 49, 151000, 53, 256] -> " 1<|unused|>5"   (eos 256 skipped as special)
    """
    size = len(tokenizer)
    if all(0 <= i < size for i in ids):  # the common case: one plain decode
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    placeholder = tokenizer.convert_tokens_to_ids(UNUSED_TOKEN)
    if isinstance(placeholder, int) and placeholder != tokenizer.unk_token_id:
        # The tokenizer has the placeholder (the byte tokenizer): one decode, which keeps
        # a multi-byte character on either side whole.
        fixed = [i if 0 <= i < size else placeholder for i in ids]
        return tokenizer.decode(fixed, skip_special_tokens=skip_special_tokens)
    # Any other tokenizer: decode the runs of known ids and join them with the placeholder.
    parts, run = [], []
    for i in ids:
        if 0 <= i < size:
            run.append(i)
        else:
            parts.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
            run = []
    parts.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
    return UNUSED_TOKEN.join(parts)


def chat_template_hash(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The first 12 hex digits of the sha256 of `tokenizer`'s chat template, or None when it
    has none (the byte tokenizer). A tokenizer with several named templates (a dict) hashes
    them all, in name order, so any change to any of them changes the hash.

    Example:
        >>> tok = build_byte_tokenizer()
        >>> chat_template_hash(tok) is None
        True
        >>> tok.chat_template = "{{ messages[0]['content'] }}"
        >>> chat_template_hash(tok)
        'e2ce372d1e09'
    """
    template = tokenizer.chat_template
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]
