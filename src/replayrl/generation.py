"""Sampling completions with per-token log-probs, behind one small interface.

A backend takes prompt strings and returns, for each prompt, `num_samples` completions with
their token ids and the log-prob of each sampled token under the sampling distribution
(logits / temperature, after top-p). Those log-probs are the behaviour policy that GRPO's
ratio divides by. Two backends share the interface: `TransformersBackend` here (CPU, tests,
small models) and the vLLM backend (GPU, the `gpu` extra), imported lazily.

This module knows nothing about rewards, buffers or storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from replayrl.errors import ReplayRLError
from replayrl.tokenizer import decode_ids


@dataclass(frozen=True)
class Completion:
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]  # includes the EOS token when the model emitted it
    logprobs: list[float]  # one per completion token
    # Special tokens stripped; an id the tokenizer has no token for (a padded embedding
    # row) reads "<|unused|>" (`replayrl.tokenizer.decode_ids`).
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
        pad_id, eos_id = tok.pad_token_id, tok.eos_token_id
        max_len = max(len(encoded[i]) for i, _ in chunk)
        # Left padding so every row's next token is at the same position.
        input_ids = torch.full((len(chunk), max_len), pad_id, dtype=torch.long)  # (N, P)
        attention = torch.zeros((len(chunk), max_len), dtype=torch.long)  # (N, P)
        for row, (i, _) in enumerate(chunk):
            ids = encoded[i]
            input_ids[row, max_len - len(ids) :] = torch.tensor(ids)
            attention[row, max_len - len(ids) :] = 1
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=temperature if not greedy else None,
            top_p=top_p if not greedy and top_p < 1.0 else None,
            # 0 turns top-k off; None would fall back to transformers' default of 50, so the
            # sampled distribution would differ from the full softmax the trainer computes.
            top_k=None if greedy else 0,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
            bos_token_id=tok.bos_token_id,
            return_dict_in_generate=True,
            output_scores=True,
        )
        torch.manual_seed(seed)
        result = self.model.generate(
            input_ids=input_ids.to(self.model.device),
            attention_mask=attention.to(self.model.device),
            generation_config=config,
        )
        new_tokens = result.sequences[:, max_len:].cpu()  # (N, T)
        # Scores are the processed logits the sampler drew from (temperature, top-p applied).
        scores = torch.stack(result.scores, dim=1).float().cpu()  # (N, T, V)
        logp_all = torch.log_softmax(scores, dim=-1)  # (N, T, V)
        logp = logp_all.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # (N, T)
        # One conversion to Python lists for the whole chunk, not one per row.
        all_ids, all_logp = new_tokens.tolist(), logp.tolist()
        all_entropy = None
        if with_entropy:  # only evaluation reads it; it costs ~3% of a rollout batch
            # entr(p) = -p log p, and 0 where top-p masked a token out (p = 0).
            all_entropy = torch.special.entr(logp_all.exp()).sum(-1).tolist()  # (N, T)
        out = []
        for row, (i, s) in enumerate(chunk):
            ids = all_ids[row]
            n = len(ids)
            finish = "length"
            for j, t in enumerate(ids):
                if t == eos_id:
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
        from replayrl.generation_vllm import VLLMBackend, import_vllm

        import_vllm()
        if checkpoint_dir is None:
            raise ValueError("make_backend('vllm', ...) needs checkpoint_dir (a local directory)")
        return VLLMBackend(checkpoint_dir, **(vllm_options or {}))
    raise ReplayRLError(f"Unknown generation backend '{name}'; use 'transformers' or 'vllm'.")
