"""Held-out evaluation of a policy: greedy pass@1, sampled pass@k, entropy, length.

Takes a generation backend, the held-out problems and the reward kind; returns plain
numbers. Knows nothing about storage, checkpoints or trackers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from replayrl.generation import GenerationBackend
from replayrl.metrics import mean_pass_at_k
from replayrl.rewards import score
from replayrl.tasks import Problem


@dataclass(frozen=True)
class EvalResult:
    pass1: float  # greedy, fraction of held-out prompts solved
    pass_at_k: float  # unbiased estimator from num_samples sampled completions per prompt
    k: int
    mean_sample_correct: float  # sampled accuracy (pass@1 at temperature)
    entropy: float  # mean token entropy (nats) of the sampling distribution
    response_length: float  # mean sampled completion length, tokens
    greedy_length: float
    unparsed: float  # fraction of sampled completions whose answer could not be parsed
    num_prompts: int
    seconds: float = 0.0  # wall seconds the evaluation took (set by `steps.evaluate`)
    cpu_seconds: float = 0.0  # its process CPU seconds (replayrl.clock; set there too)

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


def evaluate_policy(
    *,
    backend: GenerationBackend,
    problems: Sequence[Problem],
    reward_kind: str,
    max_new_tokens: int,
    num_samples: int,
    k: int,
    temperature: float,
    seed: int,
    sampled: bool = True,
) -> EvalResult:
    prompts = [p.prompt for p in problems]
    greedy = backend.generate(
        prompts,
        num_samples=1,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        seed=seed,
        greedy=True,
    )
    greedy_correct = [
        score(kind=reward_kind, completion=c.text, answer=problems[c.prompt_index].answer).correct
        for c in greedy
    ]
    pass1 = float(np.mean(greedy_correct))
    greedy_length = float(np.mean([len(c.completion_token_ids) for c in greedy]))
    if not sampled:
        return EvalResult(
            pass1,
            float("nan"),
            k,
            float("nan"),
            float("nan"),
            float("nan"),
            greedy_length,
            float("nan"),
            len(problems),
        )
    samples = backend.generate(
        prompts,
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        seed=seed + 1,
        with_entropy=True,
    )
    correct = np.zeros(len(problems), dtype=np.int64)
    unparsed = 0
    for c in samples:
        r = score(kind=reward_kind, completion=c.text, answer=problems[c.prompt_index].answer)
        correct[c.prompt_index] += int(r.correct)
        unparsed += int(not r.parsed)
    lengths = [len(c.completion_token_ids) for c in samples]
    return EvalResult(
        pass1=pass1,
        pass_at_k=mean_pass_at_k(num_correct=correct.tolist(), num_samples=num_samples, k=k),
        k=k,
        mean_sample_correct=float(correct.sum() / len(samples)),
        entropy=float(np.average([c.entropy for c in samples], weights=np.maximum(lengths, 1))),
        response_length=float(np.mean(lengths)),
        greedy_length=greedy_length,
        unparsed=unparsed / len(samples),
        num_prompts=len(problems),
    )
