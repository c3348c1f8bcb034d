"""What the vLLM tests compare against: a warm-started tiny model (transformers) and the
teacher-forced log-probs of completions under the sampling distribution."""

from __future__ import annotations

import pyarrow as pa
import torch

from replayrl.core.losses import token_logprobs
from replayrl.policy.batching import collate
from replayrl.policy.tiny_model import build_tiny_model, load_model, supervised_loss
from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer

# vLLM's CPU kernels and transformers' eager attention sum in different orders; on this
# float32 model the log-probs agree to ~1e-6, far inside this bound.
LOGPROB_ATOL = 1e-4
PROMPTS = ["12 + 34 =", "5 + 67 =", "99 + 1 =", "40 + 2 =", "7 + 70 ="]
MAX_NEW_TOKENS = 6
SUM_PAIRS = [(a, b) for a in range(10, 40, 3) for b in range(11, 50, 7)]


def train_sums(model, tokenizer, optimizer, *, steps: int, offset: int = 0) -> None:
    """`steps` AdamW steps of `supervised_loss` on "a + b =" -> " {a + b + offset}"."""
    prompts = [f"{a} + {b} =" for a, b in SUM_PAIRS]
    targets = [f" {a + b + offset}" for a, b in SUM_PAIRS]
    for _ in range(steps):
        loss = supervised_loss(model=model, tokenizer=tokenizer, prompts=prompts, targets=targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def warm_started_model():
    """(model, tokenizer): a tiny model given 60 supervised steps, so greedy completions are
    answers with an EOS, not near-ties. In eval mode; the global torch RNG is reseeded."""
    torch.manual_seed(0)
    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_sums(model, tokenizer, optimizer, steps=60)
    model.eval()
    return model, tokenizer


def load_warm_model(directory):
    """(model, tokenizer) from a `warm_checkpoint` directory: a copy of its own, in eval
    mode (bit-identical to the model that was saved: float32 safetensors)."""
    model, _ = load_model(directory)
    model.eval()
    return model, build_byte_tokenizer()


def forward_logprobs(model, completions, *, temperature: float, top_p: float) -> list[list[float]]:
    """Teacher-forced log-probs of each completion token under softmax(logits / T) restricted
    to the top-p nucleus, i.e. the distribution the sampler drew from."""
    rows = pa.table(
        {
            "prompt_token_ids": [c.prompt_token_ids for c in completions],
            "completion_token_ids": [c.completion_token_ids for c in completions],
            "behavior_logprobs": [c.logprobs for c in completions],
            "advantage": [0.0] * len(completions),
        }
    )
    batch = collate(rows, pad_id=257)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    scaled = logits[:, :-1].float() / temperature  # (B, L-1, V)
    if top_p < 1.0:
        probs = scaled.softmax(-1)
        sorted_p, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    logp = token_logprobs(logits=scaled, target_ids=batch["input_ids"][:, 1:])  # (B, L-1)
    mask = batch["completion_mask"].bool()
    return [logp[i][mask[i]].tolist() for i in range(len(completions))]
