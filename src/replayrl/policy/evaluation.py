"""Held-out evaluation of a policy: greedy pass@1, sampled pass@k, entropy, length, and
optionally pass@1 sampled at a low temperature (the paper's setting: 0.1, top-p 0.95, §5.1).

Takes a generation backend, the held-out problems and the reward kind; returns plain
numbers. Knows nothing about storage, checkpoints or trackers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from replayrl.core.metrics import mean_pass_at_k
from replayrl.core.rewards import score
from replayrl.policy.generation import Completion, GenerationBackend
from replayrl.policy.problems import Problem


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
    # pass@1 at a low sampling temperature (the paper's 0.1, top-p 0.95, §5.1): the mean accuracy of
    # `num_samples` completions per prompt; nan when not evaluated.
    pass1_sampled: float = float("nan")
    seconds: float = 0.0  # wall seconds the evaluation took (set by `steps.evaluate`)
    cpu_seconds: float = 0.0  # its process CPU seconds (replayrl.core.clock; set there too)
    # Its device seconds on a GPU (replayrl.core.clock.DeviceTimer; set there too); None on the CPU.
    device_seconds: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items() if v is not None}


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
    top_p: float = 1.0,
    pass1_temperature: float | None = None,
    pass1_top_p: float = 0.95,
) -> EvalResult:
    """Greedy pass@1 on `problems`; with `sampled`, `num_samples` completions per prompt at
    `temperature` and `top_p` for pass@k, sample accuracy, entropy and length; with
    `pass1_temperature`, another `num_samples` per prompt at that temperature and
    `pass1_top_p` for the sampled pass@1 (the paper's evaluation setting, §5.1)."""
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
    pass1 = float(np.mean(_correct(greedy, problems, reward_kind)))
    greedy_length = float(np.mean([len(c.completion_token_ids) for c in greedy]))
    pass1_sampled = float("nan")
    if pass1_temperature is not None:
        low = backend.generate(
            prompts,
            num_samples=num_samples,
            max_new_tokens=max_new_tokens,
            temperature=pass1_temperature,
            top_p=pass1_top_p,
            seed=seed + 2,
        )
        pass1_sampled = float(np.mean(_correct(low, problems, reward_kind)))
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
            pass1_sampled,
        )
    samples = backend.generate(
        prompts,
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed + 1,
        with_entropy=True,
    )
    return _sampled_result(
        samples,
        problems,
        reward_kind,
        num_samples=num_samples,
        k=k,
        pass1=pass1,
        greedy_length=greedy_length,
        pass1_sampled=pass1_sampled,
    )


def _correct(
    completions: Sequence[Completion], problems: Sequence[Problem], reward_kind: str
) -> list[bool]:
    """Whether each completion's answer is correct, in order."""
    return [
        score(kind=reward_kind, completion=c.text, answer=problems[c.prompt_index].answer).correct
        for c in completions
    ]


def _sampled_result(
    samples: Sequence[Completion],
    problems: Sequence[Problem],
    reward_kind: str,
    *,
    num_samples: int,
    k: int,
    pass1: float,
    greedy_length: float,
    pass1_sampled: float,
) -> EvalResult:
    """The result with the sampled completions' pass@k, accuracy, entropy (weighted by
    length), length and unparsed fraction, beside the greedy numbers given."""
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
        pass1_sampled=pass1_sampled,
    )
