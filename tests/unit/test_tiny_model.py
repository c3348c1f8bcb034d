"""The byte-level tokenizer and the tiny Qwen2: round trips, padded vocabularies, HF
save/load, warm-start loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from replayrl.errors import ReplayRLError
from replayrl.policy.tiny_model import build_tiny_model, load_model, save_model, supervised_loss
from replayrl.policy.tokenizer import (
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    UNUSED_TOKEN,
    UNUSED_TOKEN_ID,
    VOCAB_SIZE,
    build_byte_tokenizer,
    decode_ids,
)

pytestmark = pytest.mark.unit

TEXTS = ["48 + 57 =", " -11", "", "tab\tnew\nline  ", "héllo wörld ✓ 😀", "\x00\x7f"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def test_one_token_per_byte_and_exact_round_trip(tokenizer) -> None:
    assert tokenizer.encode("48 + 57 =") == [52, 56, 32, 43, 32, 53, 55, 32, 61]
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.decode(ids) == text


def test_special_tokens(tokenizer) -> None:
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (EOS_TOKEN_ID, PAD_TOKEN_ID)
    assert tokenizer.bos_token_id is None
    assert len(tokenizer) == 259 <= VOCAB_SIZE and VOCAB_SIZE % 8 == 0
    ids = [PAD_TOKEN_ID, *tokenizer.encode(" 105"), EOS_TOKEN_ID]
    assert tokenizer.decode(ids, skip_special_tokens=True) == " 105"
    assert tokenizer.decode(ids) == "<|pad|> 105<|endoftext|>"
    # Special-token text in a prompt is a special token, not bytes.
    assert tokenizer.encode("1<|endoftext|>") == [49, EOS_TOKEN_ID]


def test_left_padding_survives_save_and_load(tokenizer, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.padding_side == "left"
    batch = loaded(["1 + 2 =", "10 + 20 ="], padding=True)
    assert batch["input_ids"][0] == [PAD_TOKEN_ID, PAD_TOKEN_ID, 49, 32, 43, 32, 50, 32, 61]
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1, 1, 1, 1]
    for text in TEXTS:
        assert loaded.encode(text) == tokenizer.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    assert (loaded.eos_token_id, loaded.pad_token_id) == (EOS_TOKEN_ID, PAD_TOKEN_ID)


QWEN_VOCAB = 151_936


def test_padded_tokenizer_encodes_like_the_plain_one(tokenizer) -> None:
    padded = build_byte_tokenizer(vocab_size=QWEN_VOCAB)
    for text in [*TEXTS, "1<|endoftext|>", "Compute 48 + 57 + 12 - 3."]:
        assert padded.encode(text) == tokenizer.encode(text)
        assert decode_ids(padded, padded.encode(text), skip_special_tokens=False) == text
    assert len(padded) == len(tokenizer) == UNUSED_TOKEN_ID + 1
    with pytest.raises(ReplayRLError, match="at least 264"):
        build_byte_tokenizer(vocab_size=258)


def test_ids_past_the_tokenizer_decode_to_the_placeholder(tokenizer, tmp_path: Path) -> None:
    padded = build_byte_tokenizer(vocab_size=QWEN_VOCAB)
    # Hugging Face's own decode drops an id it has no token for; ours shows the placeholder.
    assert padded.decode([49, 151_000, 53]) == "15"
    ids = [32, 49, UNUSED_TOKEN_ID, 259, 151_000, QWEN_VOCAB - 1, 53, EOS_TOKEN_ID]
    expected = f" 1{UNUSED_TOKEN * 4}5"
    assert decode_ids(padded, ids) == expected
    assert decode_ids(padded, ids, skip_special_tokens=False) == expected + "<|endoftext|>"
    assert decode_ids(padded, [-1, 10**9]) == UNUSED_TOKEN * 2  # nonsense ids never raise
    # A multi-byte character on either side of a placeholder keeps its bytes together.
    assert decode_ids(padded, [*"é".encode(), 200_000, *"✓".encode()]) == f"é{UNUSED_TOKEN}✓"
    padded.save_pretrained(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert (len(loaded), loaded.padding_side) == (len(padded), "left")
    assert decode_ids(loaded, ids) == expected
    for text in TEXTS:
        assert loaded.encode(text) == padded.encode(text)


def test_decode_ids_with_a_tokenizer_that_has_no_placeholder(tmp_path: Path) -> None:
    """A checkpoint's own tokenizer (a real model's, or a byte tokenizer saved before the
    placeholder existed) gets the placeholder text between its decoded runs."""
    from tokenizers import Tokenizer, models

    core = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    assert decode_ids(tok, [0, 1]) == tok.decode([0, 1]) == "a b"
    assert decode_ids(tok, [0, 7, 1]) == f"a{UNUSED_TOKEN}b"
    assert decode_ids(tok, [9]) == UNUSED_TOKEN


def test_model_size_config_and_seeded_init() -> None:
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=0)
    same = build_tiny_model(vocab_size=VOCAB_SIZE, seed=0)
    other = build_tiny_model(vocab_size=VOCAB_SIZE, seed=1)
    num_params = sum(p.numel() for p in model.parameters())
    assert 550_000 < num_params < 700_000
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    assert (model.config.eos_token_id, model.config.pad_token_id) == (EOS_TOKEN_ID, PAD_TOKEN_ID)
    assert model.generation_config.eos_token_id == EOS_TOKEN_ID
    assert model.generation_config.pad_token_id == PAD_TOKEN_ID
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, same.state_dict()[name]), name
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


def test_building_a_model_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(vocab_size=VOCAB_SIZE, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_vocab_without_special_rows_is_rejected() -> None:
    with pytest.raises(ReplayRLError, match="VOCAB_SIZE"):
        build_tiny_model(vocab_size=256, seed=0)


def test_save_then_auto_load_gives_identical_logits(tokenizer, tmp_path: Path) -> None:
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=0).eval()
    save_model(model, tokenizer, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    loaded, loaded_tokenizer = load_model(tmp_path / "ckpt")
    loaded.eval()
    batch = loaded_tokenizer(["48 + 57 =", "1 + 2 ="], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = model(**batch).logits  # (B, T, V)
        assert expected.shape == (2, 9, VOCAB_SIZE)
        assert torch.equal(auto(**batch).logits, expected)
        assert torch.equal(loaded(**batch).logits, expected)
    assert type(auto).__name__ == "Qwen2ForCausalLM"
    assert loaded_tokenizer.padding_side == "left"


def test_load_model_from_an_empty_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(ReplayRLError, match="no config.json"):
        load_model(tmp_path)


def test_supervised_loss_masks_prompt_and_padding(tokenizer) -> None:
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=0)
    # The loss of a batch is the token-weighted mean of its rows: padding adds nothing.
    short = supervised_loss(model=model, tokenizer=tokenizer, prompts=["1 + 1 ="], targets=[" 2"])
    long = supervised_loss(
        model=model, tokenizer=tokenizer, prompts=["48 + 57 ="], targets=[" 105"]
    )
    both = supervised_loss(
        model=model, tokenizer=tokenizer, prompts=["1 + 1 =", "48 + 57 ="], targets=[" 2", " 105"]
    )
    # 3 target tokens (" ", "2", eos) and 5 (" ", "1", "0", "5", eos).
    assert torch.allclose(both, (3 * short + 5 * long) / 8, atol=1e-5)
    # Only target and eos positions are scored: recompute the long row by hand.
    ids = torch.tensor([tokenizer.encode("48 + 57 = 105") + [EOS_TOKEN_ID]])  # (1, 14)
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # (1, 14, V)
    logp = torch.log_softmax(logits[0, 8:-1], dim=-1)  # (5, V): positions predicting 9..13
    by_hand = -logp.gather(1, ids[0, 9:, None]).mean()
    assert torch.allclose(long, by_hand, atol=1e-5)
    with pytest.raises(ValueError):
        supervised_loss(model=model, tokenizer=tokenizer, prompts=["1 ="], targets=[])


def test_supervised_loss_decreases_with_adamw(tokenizer) -> None:
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    prompts = ["48 + 57 =", "12 + 30 =", "90 - 15 =", "70 - 81 =", "25 + 25 =", "64 - 16 ="]
    targets = [" 105", " 42", " 75", " -11", " 50", " 48"]
    losses = []
    for _ in range(30):
        loss = supervised_loss(model=model, tokenizer=tokenizer, prompts=prompts, targets=targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 4.0  # about ln(264) = 5.6 at init
    assert losses[-1] < 0.5 * losses[0]
