"""Sampling completions with per-token log-probs, behind one small interface.

A backend takes prompt strings and returns, for each prompt, `num_samples` completions with
their token ids and the log-prob of each sampled token under the sampling distribution
(logits / temperature, after top-p). Those log-probs are the behaviour policy that GRPO's
ratio divides by. Two backends share the interface: `TransformersBackend` here (CPU, tests,
small models) and the vLLM backend (GPU, the `gpu` extra), imported lazily.
`TransformersBackend` records each sampled token's log-prob as it is drawn, holding one
step's (rows x vocabulary) scores at a time, never rows x tokens x vocabulary of them
(20 GB for 64 rollouts of 512 tokens at Qwen2.5's 151,936 ids).

This module knows nothing about rewards, buffers or storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from replayrl.errors import ReplayRLError
from replayrl.policy.tokenizer import decode_ids


@dataclass(frozen=True)
class Completion:
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]  # includes the EOS token when the model emitted it
    logprobs: list[float]  # one per completion token
    # Special tokens stripped; an id the tokenizer has no token for (a padded embedding
    # row) reads "<|unused|>" (`replayrl.policy.tokenizer.decode_ids`).
    text: str
    finish_reason: str  # "stop" (EOS emitted) or "length" (max_new_tokens reached)
    # Mean entropy (nats) of the sampling distribution over its tokens; NaN unless the
    # backend was asked for it (`with_entropy=True`).
    entropy: float = float("nan")


class GenerationBackend(Protocol):
    def generate(
        self,
        prompts: Sequence[str],
        *,
        num_samples: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        greedy: bool = False,
        with_entropy: bool = False,
    ) -> list[Completion]: ...


def stop_token_ids(tokenizer, generation_eos: int | Sequence[int] | None) -> tuple[int, ...]:
    """Every token id that ends a completion, in both backends: the tokenizer's EOS, then
    each EOS id of the model's generation config (`generation_config.json`'s
    `eos_token_id`, an int or a list). Chat checkpoints name two: Qwen2.5-Instruct and Qwen3
    stop on `<|im_end|>` (151645) and `<|endoftext|>` (151643), and vLLM 0.33 adds that list
    to its stop ids even with `generation_config="vllm"`. A completion that ends on any of
    them finished "stop", with the EOS token kept as its last id.

    Example: a byte tokenizer (EOS 256) and `"eos_token_id": [256, 3]` -> (256, 3)."""
    found = [] if generation_eos is None else generation_eos
    extra = [found] if isinstance(found, int) else list(found)
    ids = [int(tokenizer.eos_token_id)]
    for t in extra:
        if t is not None and int(t) not in ids:
            ids.append(int(t))
    return tuple(ids)


class TransformersBackend:
    """`model.generate` on CPU (or one GPU): deterministic for a seed and batch layout."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, batch_size: int = 512
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ReplayRLError("The tokenizer needs a pad and an eos token to batch completions.")
        generation = getattr(model, "generation_config", None)
        self.stop_ids = stop_token_ids(tokenizer, getattr(generation, "eos_token_id", None))

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str],
        *,
        num_samples: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        greedy: bool = False,
        with_entropy: bool = False,
    ) -> list[Completion]:
        if not prompts:
            return []
        tok = self.tokenizer
        encoded = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        if any(len(ids) == 0 for ids in encoded):
            raise ReplayRLError("An empty prompt cannot be completed; check the dataset.")
        jobs = [(i, s) for i in range(len(prompts)) for s in range(num_samples)]
        gen = torch.Generator().manual_seed(seed)
        out: list[Completion] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(jobs), self.batch_size):
                chunk = jobs[start : start + self.batch_size]
                # One seed per chunk, drawn from the run seed: results do not depend on
                # anything but (seed, prompts, batch_size).
                chunk_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
                out.extend(
                    self._generate_chunk(
                        chunk,
                        encoded,
                        max_new_tokens=max_new_tokens,
                        temperature=temperature,
                        top_p=top_p,
                        seed=chunk_seed,
                        greedy=greedy,
                        with_entropy=with_entropy,
                    )
                )
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(
        self, chunk, encoded, *, max_new_tokens, temperature, top_p, seed, greedy, with_entropy
    ):
        tok = self.tokenizer
        pad_id, stops = tok.pad_token_id, set(self.stop_ids)
        max_len = max(len(encoded[i]) for i, _ in chunk)
        # Left padding so every row's next token is at the same position.
        input_ids = torch.full((len(chunk), max_len), pad_id, dtype=torch.long)  # (N, P)
        attention = torch.zeros((len(chunk), max_len), dtype=torch.long)  # (N, P)
        for row, (i, _) in enumerate(chunk):
            ids = encoded[i]
            input_ids[row, max_len - len(ids) :] = torch.tensor(ids)
            attention[row, max_len - len(ids) :] = 1
        # Temperature and top-p are our own processors, placed before `recorder`, so that it
        # sees exactly the distribution the sampler draws from; transformers' own warpers,
        # which would run after it, are turned off with explicit values (None would be
        # filled in from the model's generation_config.json). top_k 0 is off as well: its
        # default, 50, would make the sampled distribution differ from the full softmax the
        # trainer computes.
        processors = LogitsProcessorList()
        if not greedy and temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if not greedy and top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
        recorder = _SampledLogprobs(max_steps=max_new_tokens, with_entropy=with_entropy)
        processors.append(recorder)
        # Greedy decoding uses no warper; sampling turns each of transformers' own off.
        warpers_off = {} if greedy else {
            "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
        }  # fmt: skip
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            **warpers_off,
            pad_token_id=pad_id,
            eos_token_id=list(self.stop_ids),
            bos_token_id=tok.bos_token_id,
            # Only the token ids come back: the per-step scores, (N, V) each, would add up to
            # N x T x V floats (20 GB for 64 rows of 512 tokens over 151,936 ids).
            return_dict_in_generate=False,
        )
        torch.manual_seed(seed)
        sequences = self.model.generate(
            input_ids=input_ids.to(self.model.device),
            attention_mask=attention.to(self.model.device),
            generation_config=config,
            logits_processor=processors,
        )
        new_tokens = sequences[:, max_len:].cpu()  # (N, T)
        logp, entropy = recorder.finish(new_tokens)  # (N, T) each
        # One conversion to Python lists for the whole chunk, not one per row.
        all_ids, all_logp = new_tokens.tolist(), logp.tolist()
        all_entropy = entropy.tolist() if with_entropy else None
        out = []
        for row, (i, s) in enumerate(chunk):
            ids = all_ids[row]
            n = len(ids)
            finish = "length"
            for j, t in enumerate(ids):
                if t in stops:
                    n, finish = j + 1, "stop"
                    break
            ids = ids[:n]
            out.append(
                Completion(
                    prompt_index=i,
                    sample_index=s,
                    prompt_token_ids=list(encoded[i]),
                    completion_token_ids=ids,
                    logprobs=all_logp[row][:n],
                    text=decode_ids(tok, ids),
                    finish_reason=finish,
                    entropy=_mean(all_entropy[row][:n]) if all_entropy else float("nan"),
                )
            )
        return out


class _SampledLogprobs(LogitsProcessor):
    """The last logits processor: records, step by step, the log-prob of the token sampled
    from each step's scores (and the distribution's entropy), keeping one step's
    log-softmax, (N, V), instead of every step's.

    Step t's token is known only at step t + 1 (the last column of `input_ids`) or, for the
    last step, from the returned sequences (`finish`). Scores pass through unchanged. The
    results go into (N, max_steps) tensors allocated once: a small tensor kept per step
    would sit between the large per-step blocks on the heap and keep them from being
    reused (measured: a peak that grew with the number of steps).
    """

    def __init__(self, *, max_steps: int, with_entropy: bool):
        self.max_steps = max_steps
        self.with_entropy = with_entropy
        self.step = 0  # steps whose scores were seen
        self.previous: torch.Tensor | None = None  # (N, V) log-softmax of step - 1
        self.logp: torch.Tensor | None = None  # (N, max_steps)
        self.entropy: torch.Tensor | None = None  # (N, max_steps), when asked for

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.logp is None:
            # Kept on the model's device: one copy at the end, no synchronisation per step.
            shape = (scores.shape[0], self.max_steps)
            self.logp = torch.zeros(shape, dtype=torch.float32, device=scores.device)
            self.entropy = torch.zeros_like(self.logp) if self.with_entropy else None
        # A step past max_steps (a deferred stop check may run one) is dropped by generate.
        if self.previous is not None and self.step <= self.max_steps:
            taken = self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1)  # (N,)
            self.logp[:, self.step - 1] = taken
        self.previous = torch.log_softmax(scores.float(), dim=-1)  # (N, V)
        if self.entropy is not None and self.step < self.max_steps:  # only evaluation asks
            # entr(p) = -p log p, and 0 where top-p masked a token out (p = 0).
            self.entropy[:, self.step] = torch.special.entr(self.previous.exp()).sum(-1)
        self.step += 1
        return scores

    def finish(self, new_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropies) of `new_tokens`, (N, T) each on the CPU (entropies
        all zero unless recorded). Generation may have run steps past T that it dropped."""
        n, steps = new_tokens.shape
        if steps == 0 or self.logp is None:
            return torch.zeros((n, steps)), torch.zeros((n, steps))
        if steps == self.step:  # the last step's token is only in the sequences
            last = new_tokens[:, steps - 1 :].to(self.previous.device)  # (N, 1)
            self.logp[:, steps - 1] = self.previous.gather(-1, last).squeeze(-1)
        self.previous = None
        logp = self.logp[:, :steps].cpu()
        entropy = (
            self.entropy[:, :steps].cpu() if self.entropy is not None else torch.zeros_like(logp)
        )
        return logp, entropy


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def make_backend(
    name: str,
    model,
    tokenizer,
    *,
    batch_size: int,
    checkpoint_dir=None,
    vllm_options: dict | None = None,
) -> GenerationBackend:
    """Backend `name`: "transformers" wraps the loaded (model, tokenizer); "vllm" loads
    `checkpoint_dir` (a local HF directory) into a vLLM engine and ignores model/tokenizer
    (they may be None); `vllm_options` are `VLLMBackend` keyword arguments."""
    if name == "transformers":
        return TransformersBackend(model, tokenizer, batch_size=batch_size)
    if name == "vllm":
        # Lazy: vLLM (the `gpu` extra) is imported only when asked for, with a clear error.
        from replayrl.policy.generation_vllm import VLLMBackend, import_vllm

        import_vllm()
        if checkpoint_dir is None:
            raise ValueError("make_backend('vllm', ...) needs checkpoint_dir (a local directory)")
        return VLLMBackend(checkpoint_dir, **(vllm_options or {}))
    raise ReplayRLError(f"Unknown generation backend '{name}'; use 'transformers' or 'vllm'.")
