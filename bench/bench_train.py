"""Training throughput and memory: the replay trainer's `gradient_step` (collate from Arrow
rows, micro-batches, chunked log-probs, GRPO loss, clip, AdamW step) against a bare torch
forward/backward/step loop on the same model and the same rows, in two shapes:

- "demo": the CPU demo's model (vocabulary 264) on one batch of 64 short rows;
- "shapes": the `configs/shapes-cpu.yaml` shapes: the demo's depth and width with Qwen2.5's
  151,936-token vocabulary, rows of ~15 prompt + 512 completion tokens, micro-batches of 8
  rows. The bare loop cuts the same micro-batches and accumulates gradients, but computes
  full (rows, tokens, vocabulary) float32 logits and log-softmax for each, as a plain
  training loop does; the replay trainer never materialises them.

Tokens/s counts every non-pad token of the batch. Peak RSS is measured in separate
processes, one running each loop on the whole batch, after the same imports and model build.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

from bench._common import interleaved, median, paired_ratio, parse_args, report  # noqa: E402
from bench._rows import rollout_rows  # noqa: E402
from replayrl.policy.batching import collate, micro_batches, row_lengths  # noqa: E402
from replayrl.policy.tiny_model import build_tiny_model  # noqa: E402
from replayrl.policy.tokenizer import PAD_TOKEN_ID, VOCAB_SIZE  # noqa: E402
from replayrl.policy.training import (  # noqa: E402
    StepSettings,
    gradient_step,
    make_optimizer,
)

QWEN25_VOCAB = 151_936
SETTINGS = StepSettings(
    loss_name="grpo",
    clip_eps=0.2,
    is_cap=None,
    temperature=1.0,
    grad_clip=1.0,
    lr=1e-4,
    weight_decay=0.0,
    betas=(0.9, 0.999),
)
# (vocabulary, completion tokens, micro-batch rows, log-prob chunk) of each shape; the
# shapes-cpu values are the preset's.
SHAPES = {
    "demo": dict(vocab=VOCAB_SIZE, completion=None, micro_rows=0, chunk=1024),
    "shapes": dict(vocab=QWEN25_VOCAB, completion=512, micro_rows=8, chunk=512),
}


def long_rows(*, rows: int, completion: int, vocab: int, seed: int = 0) -> pa.Table:
    """Rows of 8-24 prompt tokens and `completion` completion tokens (a random policy at
    this vocabulary rarely stops early), ids anywhere in the vocabulary."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, rng.integers(8, 25)).tolist() for _ in range(rows)]
    completions = [rng.integers(0, vocab, completion).tolist() for _ in range(rows)]
    return pa.table(
        {
            "prompt_token_ids": prompts,
            "completion_token_ids": completions,
            "behavior_logprobs": [(-12.0 + rng.normal(0, 0.3, completion)).tolist()] * rows,
            "advantage": rng.normal(0, 1, rows).astype(np.float32),
            "reward": rng.integers(0, 2, rows).astype(np.float32),
        }
    )


def setup(*, shape: str, batch_rows: int, completion: int | None = None):
    """The demo-sized model at the shape's vocabulary, one batch of rows, the settings."""
    spec = SHAPES[shape]
    model = build_tiny_model(vocab_size=spec["vocab"], max_position_embeddings=1024, seed=0)
    if spec["completion"] is None:
        rows = rollout_rows(first_iteration=0, iterations=1, rows_per_iteration=batch_rows, seed=0)
    else:
        rows = long_rows(
            rows=batch_rows, completion=completion or spec["completion"], vocab=spec["vocab"]
        )
    settings = StepSettings(
        **{
            **SETTINGS.__dict__,
            "micro_batch_size": spec["micro_rows"],
            "micro_batch_tokens": 0,
            "logprob_chunk_tokens": spec["chunk"],
        }
    )
    return model, rows, settings


def replay_step(model, rows, settings):
    optimizer = make_optimizer(
        model, lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas
    )

    def step():
        gradient_step(
            model=model, optimizer=optimizer, rows=rows, pad_id=PAD_TOKEN_ID, settings=settings
        )

    return step


def bare_step(model, rows, settings):
    """Plain micro-batched training: the same micro-batches (tensors built once: the bare
    loop's best case), full logits and log-softmax per micro-batch, gradients accumulated."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    total = float(collate(rows, pad_id=PAD_TOKEN_ID)["completion_mask"].sum())
    batches = [
        collate(rows.take(pa.array(idx)), pad_id=PAD_TOKEN_ID)
        for idx in micro_batches(row_lengths(rows), max_rows=settings.micro_batch_size)
    ]

    def step():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            input_ids, attention = batch["input_ids"], batch["attention_mask"]  # (b, L)
            mask, advantages = batch["completion_mask"], batch["advantages"]  # (b, L-1), (b,)
            logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (b, L-1, V)
            logp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (b, L-1)
            loss = -(advantages[:, None] * logp * mask).sum() / total
            loss.backward()
            del logits, logp, loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


_CHILD = """
import json, sys
sys.path.insert(0, {repo!r})
from bench._common import peak_rss_mb
from bench.bench_train import setup, replay_step, bare_step
model, rows, settings = setup(shape={shape!r}, batch_rows={batch}, completion={completion})
step = {fn}(model, rows, settings)
for _ in range({steps}):
    step()
print(json.dumps({{"peak_rss_mb": peak_rss_mb()}}))
"""


def child_rss(fn: str, *, shape: str, batch: int, steps: int, completion: int | None) -> float:
    code = _CHILD.format(
        repo=str(Path(__file__).resolve().parents[1]),
        fn=fn,
        shape=shape,
        batch=batch,
        steps=steps,
        completion=completion,
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])["peak_rss_mb"]


def measure(
    shape: str,
    *,
    timed_rows: int,
    rss_rows: int,
    repeats: int,
    rss_runs: int,
    steps: int,
    completion: int | None = None,
) -> dict:
    """Interleaved step times on `timed_rows` rows, peak RSS of a child on `rss_rows`."""
    model, rows, settings = setup(shape=shape, batch_rows=timed_rows, completion=completion)
    tokens = int(collate(rows, pad_id=PAD_TOKEN_ID)["attention_mask"].sum())
    # Two copies with the same weights: each loop owns its parameters and optimizer state.
    times = interleaved(
        {
            "bare": bare_step(copy.deepcopy(model), rows, settings),
            "replay": replay_step(copy.deepcopy(model), rows, settings),
        },
        repeats=repeats,
        warmup=1,
    )
    rss = {fn: [] for fn in ("bare_step", "replay_step")}
    for _ in range(rss_runs):  # interleaved, medians
        for fn in rss:
            rss[fn].append(
                child_rss(fn, shape=shape, batch=rss_rows, steps=steps, completion=completion)
            )
    return {
        "figures": {
            "vocab_size": SHAPES[shape]["vocab"],
            "timed_batch_rows": timed_rows,
            "timed_batch_tokens": tokens,
            "rss_batch_rows": rss_rows,
            "micro_batch_rows": settings.micro_batch_size,
            "logprob_chunk_tokens": settings.logprob_chunk_tokens,
            "parameters": sum(p.numel() for p in model.parameters()),
            "replay_tokens_per_s": tokens / median(times["replay"]),
            "bare_tokens_per_s": tokens / median(times["bare"]),
            "replay_step_ms": 1e3 * median(times["replay"]),
            "bare_step_ms": 1e3 * median(times["bare"]),
            "peak_rss_replay_mb": median(rss["replay_step"]),
            "peak_rss_bare_mb": median(rss["bare_step"]),
        },
        "tokens_per_s_ratio": paired_ratio(times["bare"], times["replay"]),
        "peak_rss_ratio": median(rss["replay_step"]) / median(rss["bare_step"]),
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    quick = args.quick
    demo = measure(
        "demo",
        timed_rows=8 if quick else 64,
        rss_rows=8 if quick else 64,
        repeats=args.repeats or (2 if quick else 15),
        rss_runs=1 if quick else 2,
        steps=1 if quick else 5,
    )
    # At shapes-cpu shapes one 64-row step takes minutes on one core: time 2 micro-batches
    # (the ratio is per token), and measure memory on the whole 64-row batch, which is what
    # shows that memory follows the micro-batch and not the batch.
    shapes = measure(
        "shapes",
        timed_rows=4 if quick else 16,
        rss_rows=4 if quick else 64,
        repeats=args.repeats or (1 if quick else 3),
        rss_runs=1,
        steps=1,
        completion=16 if quick else None,
    )
    figures = {
        **demo["figures"],
        "shapes": shapes["figures"],
    }
    ratios = {
        "train_tokens_per_s_ratio": demo["tokens_per_s_ratio"],
        "train_peak_rss_ratio": demo["peak_rss_ratio"],
        "shapes_train_tokens_per_s_ratio": shapes["tokens_per_s_ratio"],
        "shapes_train_peak_rss_ratio": shapes["peak_rss_ratio"],
    }
    targets = {
        "train_tokens_per_s_ratio": ">= 0.9",
        "train_peak_rss_ratio": "<= 1.2",
        "shapes_train_tokens_per_s_ratio": ">= 0.9",
        "shapes_train_peak_rss_ratio": "<= 1.2",
    }
    report("train", args=args, figures=figures, ratios=ratios, targets=targets)


if __name__ == "__main__":
    main()
