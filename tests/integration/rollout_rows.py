"""Real rollout rows for training tests: completions the tiny model samples, with behaviour
log-probs perturbed (so GRPO's ratio is not exactly 1 and clipping binds on some tokens) and
random advantages and rewards."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from replayrl.policy.generation import TransformersBackend

PROMPTS = ["12 + 34 =", "5 + 67 =", "99 + 1 =", "40 + 2 =", "7 + 70 =", "31 + 13 =", "8 + 9 ="]


def sampled_rows(model, tokenizer, *, num_samples: int) -> pa.Table:
    """len(PROMPTS) x num_samples rows, prompt by prompt."""
    out = TransformersBackend(model, tokenizer, batch_size=64).generate(
        PROMPTS, num_samples=num_samples, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=3
    )
    rng = np.random.default_rng(0)
    return pa.table(
        {
            "prompt_token_ids": [c.prompt_token_ids for c in out],
            "completion_token_ids": [c.completion_token_ids for c in out],
            "behavior_logprobs": [
                [lp + float(rng.normal(0, 0.3)) for lp in c.logprobs] for c in out
            ],
            "advantage": rng.normal(0, 1, len(out)).astype(np.float32),
            "reward": rng.integers(0, 2, len(out)).astype(np.float32),
        }
    )
