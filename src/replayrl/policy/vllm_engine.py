"""What an in-process vLLM engine needs from this process and leaves in it: the parts of
`generation_vllm.VLLMBackend` that are about the engine's lifetime, not its requests.

- Building: `_engine_options` (the `vllm.LLM` arguments: our tokenization, log-probs of the
  sampling distribution, no generation_config.json defaults), `_resolve_sleep_mode` (vLLM's
  sleep mode where it exists: CUDA only), `_start_lock` (one engine start at a time per GPU,
  `policy.start_lock`) and `_engine_in_this_process` (the engine core in this process,
  `VLLM_ENABLE_V1_MULTIPROCESSING=0` while it is built, and the process's RNG states and
  torch thread count put back after).
- Weight updates: `_checkpoint_tensors` (the stream vLLM's in-place reload takes, a tied
  model's `lm_head.weight` added) and `_quiet_rotary_reload_warnings` (drops the reload's
  false warning about rotary embeddings).
- Closing: `_release_process_state` (vLLM's distributed groups, the garbage it froze,
  torch's CUDA allocator cache), and `collect_until_settled` over `_sleep_allocator_usage`
  (what vLLM's sleep-mode allocator still holds).

vLLM is imported inside the functions that need it, never at module import. This module
knows nothing about prompts, sampling, log-probs or tokenizers (`generation_vllm`), nor
about rewards, buffers, storage or trackers.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replayrl.errors import ReplayRLError
from replayrl.policy import start_lock

# 0 = vLLM's engine core and worker in this process (V1 defaults to a separate process).
_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# A tied checkpoint (Hugging Face saves one tensor for both) names only the embedding.
_EMBED_NAME, _LM_HEAD_NAME = "model.embed_tokens.weight", "lm_head.weight"
# vLLM's in-place reload logs from here.
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _start_lock(tensor_parallel_size: int) -> contextlib.AbstractContextManager:
    """The start lock of the GPUs the engine is built on (`policy.start_lock`): the first
    `tensor_parallel_size` visible ones; nothing without CUDA (vLLM's CPU build sizes its KV
    cache from `VLLM_CPU_KVCACHE_SPACE` or a share of host memory, not from a measurement)."""
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    gpus = min(tensor_parallel_size, torch.cuda.device_count())
    return start_lock.hold(start_lock.cuda_device_keys(gpus), what="a vLLM engine start")


def _resolve_sleep_mode(sleep_mode: bool | None) -> bool:
    """`VLLMBackend`'s `sleep_mode`: None = where vLLM supports it; True where it does not
    is a ReplayRLError."""
    supported = _sleep_mode_supported()
    if sleep_mode is None:
        return supported
    if sleep_mode and not supported:
        raise ReplayRLError(
            "sleep_mode=True needs a CUDA GPU: vLLM's sleep mode is not available on this "
            "platform. Leave sleep_mode unset (auto) to use it only where it exists."
        )
    return sleep_mode


def _engine_options(
    directory: Path,
    *,
    dtype: str,
    seed: int,
    gpu_memory_utilization: float,
    enforce_eager: bool,
    tensor_parallel_size: int,
    sleep_mode: bool,
    max_model_len: int | None,
    engine_kwargs: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The `vllm.LLM` arguments of a `VLLMBackend` (see its `__init__`): our tokenization,
    log-probs of the sampling distribution, no generation_config.json defaults, then
    `engine_kwargs` over them."""
    options: dict[str, Any] = dict(
        model=str(directory),
        skip_tokenizer_init=True,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        dtype=dtype,
        seed=seed,
        gpu_memory_utilization=gpu_memory_utilization,
        enforce_eager=enforce_eager,
        tensor_parallel_size=tensor_parallel_size,
    )
    if sleep_mode:
        options["enable_sleep_mode"] = True
    if max_model_len is not None:
        options["max_model_len"] = max_model_len
    options.update(engine_kwargs or {})
    return options


def _sleep_mode_supported() -> bool:
    """Whether vLLM's sleep mode exists here: a CUDA (or ROCm) GPU and a vLLM platform that
    has it. vLLM's CPU platform has none (it raises on `enable_sleep_mode=True`)."""
    if not torch.cuda.is_available():
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


@contextmanager
def _engine_in_this_process() -> Iterator[None]:
    """Build a vLLM engine in this process and leave the process's own state as it was.

    vLLM's V1 engine core runs in a child process unless `VLLM_ENABLE_V1_MULTIPROCESSING`
    is 0 (read while the engine is built; vLLM then caches its environment). An in-process
    engine also seeds the global RNGs and lowers torch's thread count to 1 (its CPU worker
    even replaces `torch.set_num_threads`); the trainer sharing the process keeps its own.
    """
    saved_env = os.environ.get(_MULTIPROCESSING_ENV)
    os.environ[_MULTIPROCESSING_ENV] = "0"
    python_rng, numpy_rng = random.getstate(), np.random.get_state()
    torch_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop(_MULTIPROCESSING_ENV, None)
        else:
            os.environ[_MULTIPROCESSING_ENV] = saved_env
        torch.set_num_threads = set_num_threads
        set_num_threads(threads)
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
        torch.random.set_rng_state(torch_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


class _RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for rotary embeddings. The in-place
    reload says it of every layer that got no tensor, and a rotary embedding never gets one:
    its cos/sin cache is computed, not in any checkpoint, and is put back unchanged. Without
    this, every weight update would log a false warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Rotary" in message and message.endswith("Failed to load weights"))


def _quiet_rotary_reload_warnings() -> None:
    reload_logger = logging.getLogger(_RELOAD_LOGGER)
    if not any(isinstance(f, _RotaryReloadFilter) for f in reload_logger.filters):
        reload_logger.addFilter(_RotaryReloadFilter())


def _checkpoint_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, tied: bool, count: list[int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The pairs as vLLM's `load_weights` takes them: detached, one at a time (nothing is
    gathered), `count[0]` counting them, and for a tied model `lm_head.weight` after them
    (from the embedding) when they did not name it."""
    embedding, has_lm_head = None, False
    for name, tensor in named_tensors:
        count[0] += 1
        if name == _EMBED_NAME:
            embedding = tensor
        has_lm_head = has_lm_head or name == _LM_HEAD_NAME
        yield name, tensor.detach()
    if tied and embedding is not None and not has_lm_head:
        yield _LM_HEAD_NAME, embedding.detach()


def _release_process_state() -> None:
    """What a shut-down vLLM engine leaves in this process, released (see `close`): vLLM's
    model-parallel groups and distributed environment, unreachable objects (vLLM freezes
    its startup objects out of the collector), and torch's CUDA allocator cache. Each step
    is skipped where this vLLM lacks it."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:  # pragma: no cover - a vLLM without it
        parallel_state = None
    for name in ("destroy_model_parallel", "destroy_distributed_environment"):
        step = getattr(parallel_state, name, None)
        if callable(step):
            step()
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def collect_until_settled(usage, *, max_rounds: int = 10) -> int:
    """Run the garbage collector until `usage()` (bytes still held) is 0 or stops falling,
    at most `max_rounds` times; the last usage."""
    held = usage()
    for _ in range(max_rounds):
        if not held:
            break
        gc.collect()
        now = usage()
        if now >= held:
            break
        held = now
    return held


def _sleep_allocator_usage() -> int:
    """Bytes vLLM's sleep-mode allocator still holds in this process (0 without one)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return 0
    instance = getattr(CuMemAllocator, "instance", None)
    return int(instance.get_current_usage()) if instance is not None else 0
