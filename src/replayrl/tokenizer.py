"""A byte-level tokenizer built in code, in the Hugging Face layout.

The CPU demo model reads and writes raw bytes: id `b` is byte `b` (0..255), plus two
special tokens, `<|endoftext|>` (end of sequence, id 256) and `<|pad|>` (id 257). There
are no merges, so a string of n UTF-8 bytes is always n tokens, and the encoding of a
concatenation is the concatenation of the encodings (the warm start and the rollout code
rely on this when they tokenize prompt and completion separately).

There is no beginning-of-sequence token: prompts are plain text and never empty, and
nothing prepends one. `save_pretrained` writes an ordinary `tokenizer.json`, so
`AutoTokenizer.from_pretrained(directory)` (and vLLM) load it with no custom code.
Padding is on the left, the side generation needs; it is stored in the saved config.

This module knows nothing about models, tasks or storage.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
NUM_BYTE_TOKENS = 256
EOS_TOKEN_ID = 256
PAD_TOKEN_ID = 257
# Rows in the model's embedding matrix: 258 real tokens rounded up to a multiple of 8
# (aligned matmuls). Ids 258..263 are never produced by the tokenizer; the warm start
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


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Build the byte-level tokenizer: byte b -> id b, eos 256, pad 257, left padding.

    Example:
        >>> tok = build_byte_tokenizer()
        >>> tok.encode("48 + 57 =")
        [52, 56, 32, 43, 32, 53, 55, 32, 61]
    """
    vocab = {symbol: byte for byte, symbol in _byte_to_symbol().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no GPT-2 word splitting; with no merges it would not change the
    # ids, but it keeps the pre-tokenizer a pure byte -> symbol rewrite.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
    )
    if tokenizer.eos_token_id != EOS_TOKEN_ID or tokenizer.pad_token_id != PAD_TOKEN_ID:
        raise AssertionError(
            f"special token ids drifted: eos={tokenizer.eos_token_id} pad={tokenizer.pad_token_id}"
        )
    return tokenizer
