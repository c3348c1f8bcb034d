"""Training throughput and memory: the replay trainer's `gradient_step` (collate from Arrow
rows, GRPO loss, clip, AdamW step) against a bare torch forward/backward/step loop on the
same model and the same batch (tensors built once, a plain policy-gradient loss).

Tokens/s counts every non-pad token of the batch. Peak RSS is measured in separate
processes, one running each loop, after the same imports and model build.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import interleaved, median, paired_ratio, parse_args, report  # noqa: E402
from bench._rows import rollout_rows  # noqa: E402
from replayrl.tiny_model import build_tiny_model  # noqa: E402
from replayrl.tokenizer import PAD_TOKEN_ID, VOCAB_SIZE  # noqa: E402
from replayrl.train import StepSettings, collate, gradient_step, make_optimizer  # noqa: E402

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


def setup(*, batch_rows: int):
    """The CPU demo's model (~0.6M parameters) and one batch of realistic rows."""
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=0)
    rows = rollout_rows(first_iteration=0, iterations=1, rows_per_iteration=batch_rows, seed=0)
    return model, rows


def replay_step(model, rows):
    optimizer = make_optimizer(
        model, lr=SETTINGS.lr, weight_decay=SETTINGS.weight_decay, betas=SETTINGS.betas
    )

    def step():
        gradient_step(
            model=model,
            optimizer=optimizer,
            rows=rows,
            pad_id=PAD_TOKEN_ID,
            settings=SETTINGS,
        )

    return step


def bare_step(model, rows):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    batch = collate(rows, pad_id=PAD_TOKEN_ID)  # tensors built once: the bare loop's best case
    input_ids, attention = batch["input_ids"], batch["attention_mask"]  # (B, L)
    mask, advantages = batch["completion_mask"], batch["advantages"]  # (B, L-1), (B,)

    def step():
        model.train()
        logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, L-1, V)
        logp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, L-1)
        loss = -(advantages[:, None] * logp * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


_CHILD = """
import json, sys
sys.path.insert(0, {repo!r})
from bench._common import peak_rss_mb
from bench.bench_train import setup, replay_step, bare_step
model, rows = setup(batch_rows={batch})
step = {fn}(model, rows)
for _ in range({steps}):
    step()
print(json.dumps({{"peak_rss_mb": peak_rss_mb()}}))
"""


def child_rss(fn: str, *, batch: int, steps: int) -> float:
    code = _CHILD.format(
        repo=str(Path(__file__).resolve().parents[1]), fn=fn, batch=batch, steps=steps
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])["peak_rss_mb"]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    batch = 8 if args.quick else 64
    repeats = args.repeats or (2 if args.quick else 15)
    model, rows = setup(batch_rows=batch)
    tokens = int(collate(rows, pad_id=PAD_TOKEN_ID)["attention_mask"].sum())
    # Two copies with the same weights: each loop owns its parameters and optimizer state.
    times = interleaved(
        {
            "bare": bare_step(copy.deepcopy(model), rows),
            "replay": replay_step(copy.deepcopy(model), rows),
        },
        repeats=repeats,
        warmup=1,
    )
    steps = 1 if args.quick else 5
    rss = {fn: [] for fn in ("bare_step", "replay_step")}
    for _ in range(1 if args.quick else 2):  # interleaved, medians
        for fn in rss:
            rss[fn].append(child_rss(fn, batch=batch, steps=steps))
    figures = {
        "batch_rows": batch,
        "batch_tokens": tokens,
        "parameters": sum(p.numel() for p in model.parameters()),
        "replay_tokens_per_s": tokens / median(times["replay"]),
        "bare_tokens_per_s": tokens / median(times["bare"]),
        "replay_step_ms": 1e3 * median(times["replay"]),
        "bare_step_ms": 1e3 * median(times["bare"]),
        "peak_rss_replay_mb": median(rss["replay_step"]),
        "peak_rss_bare_mb": median(rss["bare_step"]),
    }
    ratios = {
        "train_tokens_per_s_ratio": paired_ratio(times["bare"], times["replay"]),
        "train_peak_rss_ratio": figures["peak_rss_replay_mb"] / figures["peak_rss_bare_mb"],
    }
    targets = {"train_tokens_per_s_ratio": ">= 0.9", "train_peak_rss_ratio": "<= 1.2"}
    report("train", args=args, figures=figures, ratios=ratios, targets=targets)


if __name__ == "__main__":
    main()
