"""Generation throughput: the transformers backend (`TransformersBackend.generate`: token
ids, per-token log-probs and entropies of every completion) against a bare
`model.generate` with the same settings (sampling at temperature 1, no top-k/top-p, the
same prompts, samples and max_new_tokens), on the CPU demo's model.

Tokens/s counts generated tokens up to and including EOS; the inputs of the bare call are
built once, outside the timing (its best case).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import interleaved, median, parse_args, report  # noqa: E402
from replayrl.policy.generation import TransformersBackend  # noqa: E402
from replayrl.policy.tiny_model import build_tiny_model  # noqa: E402
from replayrl.policy.tokenizer import EOS_TOKEN_ID, PAD_TOKEN_ID, VOCAB_SIZE, build_byte_tokenizer  # noqa: E402


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    num_prompts, num_samples = (4, 4) if args.quick else (32, 8)
    max_new_tokens = 8 if args.quick else 32
    repeats = args.repeats or (2 if args.quick else 9)
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=0)
    tokenizer = build_byte_tokenizer()
    prompts = [f"{10 + 3 * i} + {20 + 7 * i} =" for i in range(num_prompts)]
    backend = TransformersBackend(model, tokenizer, batch_size=512)

    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    rows = [ids for ids in encoded for _ in range(num_samples)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), PAD_TOKEN_ID, dtype=torch.long)  # (N, P)
    attention = torch.zeros((len(rows), width), dtype=torch.long)  # (N, P)
    for i, ids in enumerate(rows):  # left padding, as the backend does
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        attention[i, width - len(ids) :] = 1
    tokens = {"backend": [], "bare": []}
    seed = [0]

    def subject():
        seed[0] += 1
        out = backend.generate(
            prompts,
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            seed=seed[0],
        )
        tokens["backend"].append(sum(len(c.completion_token_ids) for c in out))

    @torch.no_grad()
    def bare():
        model.eval()
        torch.manual_seed(seed[0])
        new = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
            pad_token_id=PAD_TOKEN_ID,
            eos_token_id=EOS_TOKEN_ID,
        )[:, width:]  # (N, T)
        # Tokens up to and including the first EOS; after it generate pads.
        is_eos = (new == EOS_TOKEN_ID).int()  # (N, T)
        before_eos = (is_eos.cumsum(1) - is_eos) == 0  # (N, T)
        tokens["bare"].append(int(before_eos.sum()))

    times = interleaved({"bare": bare, "backend": subject}, repeats=repeats, warmup=1)
    # The warm-up round's token counts are not timed: drop them.
    rates = {k: [n / t for n, t in zip(tokens[k][1:], times[k], strict=True)] for k in times}
    figures = {
        "sequences": len(rows),
        "max_new_tokens": max_new_tokens,
        "backend_tokens_per_s": median(rates["backend"]),
        "bare_tokens_per_s": median(rates["bare"]),
        "backend_call_ms": 1e3 * median(times["backend"]),
        "bare_call_ms": 1e3 * median(times["bare"]),
    }
    ratios = {
        "generation_tokens_per_s_ratio": median(
            [a / b for a, b in zip(rates["backend"], rates["bare"], strict=True)]
        )
    }
    targets = {"generation_tokens_per_s_ratio": ">= 0.9"}
    report("generation", args=args, figures=figures, ratios=ratios, targets=targets)


if __name__ == "__main__":
    main()
