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


@dataclass(frozen=True)
class Completion:
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]  # includes the EOS token when the model emitted it
    logprobs: list[float]  # one per completion token
    text: str  # special tokens stripped
    finish_reason: str  # "stop" (EOS emitted) or "length" (max_new_tokens reached)
    entropy: float = 0.0  # mean entropy (nats) of the sampling distribution over its tokens


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
                    )
                )
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, chunk, encoded, *, max_new_tokens, temperature, top_p, seed, greedy):
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
        probs = logp_all.exp()
        entropy = -(probs * logp_all.nan_to_num(neginf=0.0)).sum(-1)  # (N, T)
        out = []
        for row, (i, s) in enumerate(chunk):
            ids = new_tokens[row].tolist()
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
                    logprobs=logp[row, :n].tolist(),
                    text=tok.decode(ids, skip_special_tokens=True),
                    finish_reason=finish,
                    entropy=float(entropy[row, :n].mean()) if n else 0.0,
                )
            )
        return out


def make_backend(name: str, model, tokenizer, *, batch_size: int) -> GenerationBackend:
    if name == "transformers":
        return TransformersBackend(model, tokenizer, batch_size=batch_size)
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise ReplayRLError(
                "rollout.backend is 'vllm' but vLLM is not installed: install the GPU extra "
                "(pip install 'replayrl[gpu]') on a machine with a GPU, or set rollout.backend=transformers."
            ) from None
        raise ReplayRLError(
            "The vLLM backend is not available in this build; set rollout.backend=transformers."
        )
    raise ReplayRLError(f"Unknown generation backend '{name}'; use 'transformers' or 'vllm'.")
