"""The vLLM generation backend (GPU; the `gpu` extra): same interface and output as
`generation.TransformersBackend`.

`VLLMBackend` loads a checkpoint directory (Hugging Face layout, as `models.save_policy`
writes it) into a `vllm.LLM` engine and samples `num_samples` completions per prompt. It
returns the same `Completion`s as the transformers backend, in the same order (prompt-major),
with the same token ids, log-probs and finish reasons:

- Tokenization and detokenization are ours, with the checkpoint's own Hugging Face
  tokenizer: prompts go to vLLM as token ids (`skip_tokenizer_init=True`), so any tokenizer
  `AutoTokenizer` loads works — the tiny model's byte-level one included — and the prompt
  ids stored in the buffer are exactly the ones the trainer will feed back.
- Log-probs are of the *sampled* token under the sampling distribution (logits /
  temperature, after top-p), i.e. `logprobs_mode="processed_logprobs"` with
  `SamplingParams(logprobs=0)`. vLLM's default ("raw_logprobs") would be the distribution
  before temperature and top-p, which is not the behaviour policy GRPO's ratio divides by.
  Greedy requests get log-probs of the unscaled logits, as in the transformers backend.
- Stopping is on the tokenizer's EOS id only (`stop_token_ids`), and the EOS token stays in
  `completion_token_ids`; `generation_config="vllm"` keeps a model's generation_config.json
  from adding other stop ids or default sampling settings behind our back.
- Seeds: one seeded request per (prompt, sample), its seed drawn from (seed, prompt index,
  sample index), so a completion does not depend on which other requests share its batch.
  (Numerics on a GPU can still differ with batch composition, as in any batched engine.)
- `entropy` is NaN: vLLM returns the sampled token's log-prob, not the whole distribution.

vLLM is imported when a backend is made, never at module import; without it,
`import_vllm` raises a `ReplayRLError` naming the `gpu` extra.
This module knows nothing about rewards, buffers, storage or trackers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from replayrl.errors import ReplayRLError
from replayrl.generation import Completion

# vLLM reports these finish reasons; we derive ours from the tokens and cross-check.
_VLLM_FINISHED = ("stop", "length")


def import_vllm():
    """The `vllm` module, or a ReplayRLError that says how to get it."""
    try:
        import vllm
    except ImportError as e:
        raise ReplayRLError(
            "rollout.backend is 'vllm' but vLLM cannot be imported "
            f"({e}). Install the GPU extra on a machine with a CUDA GPU "
            "(pip install 'replayrl[gpu]'), or set rollout.backend=transformers."
        ) from None
    return vllm


def request_seed(*, seed: int, prompt_index: int, sample_index: int) -> int:
    """A 31-bit seed for one (prompt, sample) request, a pure function of its arguments."""
    state = np.random.SeedSequence([seed, prompt_index, sample_index]).generate_state(1)
    return int(state[0]) & 0x7FFFFFFF


class VLLMBackend:
    """`vllm.LLM` on a checkpoint directory; `generate` matches `TransformersBackend`."""

    def __init__(
        self,
        checkpoint_dir: str | Path,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        seed: int = 0,
        engine_kwargs: Mapping[str, Any] | None = None,
    ):
        """Load the checkpoint into a vLLM engine.

        dtype: vLLM's dtype; "auto" downcasts a float32 checkpoint (ours are float32) to
            bfloat16/float16, so behaviour log-probs differ from the float32 trainer's by
            ~1e-2 (GRPO's clip absorbs it); "float32" matches the trainer to ~1e-6.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (weights + KV cache);
            the rest stays free for a trainer in the same process or pod.
        max_model_len: prompt + completion tokens per sequence; None = the model's maximum.
        enforce_eager: skip CUDA-graph capture (faster start, slower decoding).
        seed: the engine's seed; every request carries its own seed as well.
        engine_kwargs: further `vllm.LLM` arguments, passed through unchanged.
        """
        from transformers import AutoTokenizer

        directory = Path(checkpoint_dir)
        if not (directory / "config.json").exists():
            raise ReplayRLError(
                f"No model at '{directory}' (config.json missing); vLLM needs a Hugging Face "
                "checkpoint directory. Fetch it with storage.checkpoint_local_dir first."
            )
        vllm = import_vllm()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
        except (OSError, ValueError) as e:
            raise ReplayRLError(f"Cannot load the tokenizer at '{directory}': {e}") from None
        if self.tokenizer.eos_token_id is None:
            raise ReplayRLError(
                f"The tokenizer at '{directory}' has no eos token; completions could not stop."
            )
        options: dict[str, Any] = dict(
            model=str(directory),
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
        )
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        options.update(engine_kwargs or {})
        self._vllm = vllm
        self.checkpoint_dir = directory
        self.llm = vllm.LLM(**options)

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
        with_entropy: bool = False,  # not available: vLLM returns no full distribution (NaN)
    ) -> list[Completion]:
        if not prompts:
            return []
        tok = self.tokenizer
        encoded = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        if any(len(ids) == 0 for ids in encoded):
            raise ReplayRLError("An empty prompt cannot be completed; check the dataset.")
        eos_id = tok.eos_token_id
        jobs = [(i, s) for i in range(len(prompts)) for s in range(num_samples)]
        params = [
            self._vllm.SamplingParams(
                n=1,
                max_tokens=max_new_tokens,
                # temperature 0 is vLLM's greedy; top_k 0 = off (the full softmax).
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                top_k=0,
                seed=None if greedy else request_seed(seed=seed, prompt_index=i, sample_index=s),
                stop_token_ids=[eos_id],
                logprobs=0,  # 0 = the sampled token's log-prob only
                detokenize=False,
            )
            for i, s in jobs
        ]
        requests = [{"prompt_token_ids": list(encoded[i])} for i, _ in jobs]
        results = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        out = []
        for (i, s), result in zip(jobs, results, strict=True):
            sample = result.outputs[0]
            ids = list(sample.token_ids)
            out.append(
                Completion(
                    prompt_index=i,
                    sample_index=s,
                    prompt_token_ids=list(encoded[i]),
                    completion_token_ids=ids,
                    logprobs=_sampled_logprobs(sample.logprobs, ids),
                    text=tok.decode(ids, skip_special_tokens=True),
                    finish_reason=_finish_reason(
                        ids, eos_id=eos_id, max_new_tokens=max_new_tokens, vllm=sample.finish_reason
                    ),
                    entropy=math.nan,
                )
            )
        return out

    def close(self) -> None:
        """Free the engine (and its GPU memory) now rather than at garbage collection."""
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm


def _sampled_logprobs(position_logprobs, ids: list[int]) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position {token id: Logprob}."""
    if position_logprobs is None or len(position_logprobs) != len(ids):
        raise RuntimeError(
            f"vLLM returned {0 if position_logprobs is None else len(position_logprobs)} "
            f"log-prob entries for {len(ids)} tokens; was logprobs=0 dropped?"
        )
    return [float(position_logprobs[j][t].logprob) for j, t in enumerate(ids)]


def _finish_reason(ids: list[int], *, eos_id: int, max_new_tokens: int, vllm: str | None) -> str:
    """Finish reason "stop" when the last token is EOS, else "length" (the transformers
    backend's rule); vLLM's own reason is only cross-checked."""
    if vllm not in _VLLM_FINISHED:
        raise RuntimeError(f"vLLM finished a request with reason {vllm!r}")
    if ids and ids[-1] == eos_id:
        return "stop"
    if eos_id in ids or len(ids) != max_new_tokens:
        raise ReplayRLError(
            f"vLLM stopped after {len(ids)} of {max_new_tokens} tokens without a final EOS "
            f"(reason {vllm!r}); raise max_model_len or shorten the prompts."
        )
    return "length"
