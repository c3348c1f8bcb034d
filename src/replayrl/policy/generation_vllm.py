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
- Stopping is on `generation.stop_token_ids`, the one list both backends use: the
  tokenizer's EOS and every EOS id of the checkpoint's generation_config.json (vLLM 0.33
  adds those itself even with `generation_config="vllm"`, which only keeps the file's
  sampling defaults out). The EOS token stays in `completion_token_ids`.
- Seeds: one seeded request per (prompt, sample), its seed drawn from (seed, prompt index,
  sample index), so a completion does not depend on which other requests share its batch,
  on how vLLM schedules them or on what its prefix cache holds (a resumed run samples what
  the uninterrupted one did). (Numerics on a GPU can still differ with batch composition,
  as in any batched engine.) On vLLM 0.33's GPU model runner (Model Runner V2, its default
  on CUDA, vllm/config/vllm.py `use_v2_model_runner`) seeds cost nothing: one Gumbel kernel
  samples every request of a step from its own seed and position, and an unseeded request
  gets a random seed anyway (vllm/v1/worker/gpu/sample/states.py lines 54-58, sampler.py
  `_sample_random`); the fused FlashInfer top-k/top-p sampler, which an explicit seed rules
  out, is already ruled out by processed log-probs: every request here asks for them
  (`logprobs=0` is not states.py's NO_LOGPROBS = -1, so sampler.py line 163 passes
  return_logprobs=True) and `fused_sampler_eligible` (sampler.py lines 304-312) is False for
  processed log-probs whatever the seeds; training rollouts (top_p 1, top_k off) would not use
  it anyway. (Read in the vLLM 0.33.0 source release.) Seeds cost something only on the V1
  runner (a fallback on CUDA, e.g. with `VLLM_USE_V2_MODEL_RUNNER=0`), which draws each
  seeded request's noise on its own at every step (vllm/v1/sample/ops/topk_topp_sampler.py,
  `random_sample` line 626; its CPU path, `forward_cpu` line 374, draws only one seed per
  request there): a price kept for the reproducibility above.
- `entropy` is NaN: vLLM returns the sampled token's log-prob, not the whole distribution.
- `generate` blocks the host until every request has finished: a `core.clock.DeviceTimer`
  around it reads its wall time (host-side scheduling, detokenisation and output processing
  included), not the device's busy time.

One engine for a whole run: the engine runs in this process (vLLM's engine core and its
worker in the caller's process, `VLLM_ENABLE_V1_MULTIPROCESSING=0` while it is built), so
`load_weights` hands the trainer's tensors (CPU or GPU) to the live model by reference, with
no new engine, no checkpoint on disk and no serialization. It goes through the worker's
`reload_weights` (vLLM's in-place reload: each layer is re-loaded and re-processed, e.g.
re-packed for the CPU kernels, then copied into the original storage, so CUDA graphs stay
valid), then resets the prefix cache, whose KV blocks were computed with the old weights.
`sleep`/`wake_up` free the GPU for a trainer in the same process (vLLM sleep mode, CUDA
only; no-ops elsewhere). `VLLMBackend.engines_built` counts the engines this process built.
With `tensor_parallel_size` > 1 the engine's workers run in processes of their own, so
`load_weights` refuses (a new policy then needs a new engine, from its checkpoint).

`reload_from` gives the live engine the weights of a checkpoint directory instead (a policy
that is not in this process's memory): read tensor by tensor on the CPU, no GPU copy.
`close` shuts the engine down so that another can start in this process (vLLM's
per-process state released, see its docstring); one engine is open per process at a time.

The engine's default share of GPU memory is `policy.engine_share.memory_share`. On a GPU,
engines start one at a time per GPU (`policy.start_lock`): vLLM sizes the KV cache from the
change in the device's free memory during the start, so a neighbour starting at the same
time would be charged to it. vLLM 0.33 could instead take the KV cache's size in bytes
(`kv_cache_memory_bytes`, vllm/v1/worker/gpu_worker.py line 656, which skips the
measurement), but then its weights, activation peak and CUDA graphs must be estimated here,
and the free-memory check at start (vllm/v1/worker/utils.py line 761) still applies.

This module is the backend: its requests and their outputs, and the engine's sleep, wake
and weight state. What building, reloading and closing an in-process engine does to this
process (the engine's options, the start lock, the in-process environment and restored
RNG states, the tensor stream of a reload, the release of vLLM's per-process state at
`close`) is `replayrl.policy.vllm_engine`.

vLLM is imported when a backend is made, never at module import; without it,
`import_vllm` raises a `ReplayRLError` naming the `gpu` extra.
This module knows nothing about rewards, buffers, storage or trackers.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from replayrl.errors import ReplayRLError
from replayrl.policy import checkpoint_files
from replayrl.policy.generation import Completion, stop_token_ids
from replayrl.policy.tokenizer import decode_ids
from replayrl.policy.vllm_engine import (
    _MULTIPROCESSING_ENV,
    _checkpoint_tensors,
    _engine_in_this_process,
    _engine_options,
    _quiet_rotary_reload_warnings,
    _release_process_state,
    _resolve_sleep_mode,
    _sleep_allocator_usage,
    _start_lock,
    collect_until_settled,
)

# vLLM reports these finish reasons; we derive ours from the tokens and cross-check.
_VLLM_FINISHED = ("stop", "length")


def import_vllm():
    """The `vllm` module, or a ReplayRLError that says how to get it."""
    try:
        import vllm

        if not hasattr(vllm, "LLM"):
            # e.g. a folder named vllm on sys.path, imported as a namespace package
            raise ImportError(f"'vllm' at {list(getattr(vllm, '__path__', []))} is not vLLM")
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
    """`vllm.LLM` on a checkpoint directory; `generate` matches `TransformersBackend`.

    One engine can serve a whole run: `load_weights` puts new policy weights into it in
    place, and `sleep`/`wake_up` hand the GPU to a trainer in between.
    """

    # Engines this process has built (tests check that weight updates build none).
    engines_built: ClassVar[int] = 0
    # The backends of this process not closed yet (at most one engine is open at a time).
    _open: ClassVar[weakref.WeakSet[VLLMBackend]] = weakref.WeakSet()

    def __init__(
        self,
        checkpoint_dir: str | Path,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        sleep_mode: bool | None = None,
        sleep_level: int = 1,
        engine_kwargs: Mapping[str, Any] | None = None,
    ):
        """Load the checkpoint into a vLLM engine that runs in this process.

        dtype: vLLM's dtype; "auto" downcasts a float32 checkpoint (ours are float32) to
            bfloat16/float16, so behaviour log-probs differ from the float32 trainer's by
            ~1e-2 (GRPO's clip absorbs it); "float32" matches the trainer to ~1e-6.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (weights + KV cache);
            the rest stays free for a trainer in the same process or pod.
        max_model_len: prompt + completion tokens per sequence; None = the model's maximum.
        enforce_eager: skip CUDA-graph capture (faster start, slower decoding).
        seed: the engine's seed; every request carries its own seed as well.
        tensor_parallel_size: GPUs the engine is split over; above 1 its workers run in
            processes of their own and `load_weights` is refused.
        sleep_mode: build the engine with vLLM's sleep mode (`enable_sleep_mode=True`), so
            `sleep` can free its GPU memory. None (auto) = on exactly when CUDA is available
            and vLLM's platform supports sleep mode; vLLM has no sleep mode on CPU (it
            refuses `enable_sleep_mode` there), so on CPU it is off and `sleep`/`wake_up`
            are no-ops. True where it is not supported is an error.
        sleep_level: what `sleep` does by default, 1 or 2 (see `sleep`); the run's choice
            is `replayrl.policy.memory_plan.vllm_sleep_level` (`rollout.vllm_sleep_level`).
        engine_kwargs: further `vllm.LLM` arguments, passed through unchanged.

        The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` while it is built):
        vLLM's V1 default puts the engine core in a child process, where the trainer's
        tensors could only arrive serialized. Building it here leaves the caller's process as
        it was: the Python, NumPy and torch random states (vLLM seeds them all) and torch's
        thread count (vLLM sets 1, and on CPU replaces `torch.set_num_threads`) are
        restored. vLLM does keep what it sets up for its worker: a one-process
        `torch.distributed` group, and vLLM's environment-variable cache.
        """
        directory = Path(checkpoint_dir)
        if not (directory / "config.json").exists():
            raise ReplayRLError(
                f"No model at '{directory}' (config.json missing); vLLM needs a Hugging Face "
                "checkpoint directory. Fetch it with storage.checkpoint_local_dir first."
            )
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {sleep_level}")
        vllm = import_vllm()
        self.tokenizer = checkpoint_files.checkpoint_tokenizer(directory)
        self.stop_ids = stop_token_ids(
            self.tokenizer, checkpoint_files.generation_eos_ids(directory)
        )
        options = _engine_options(
            directory,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            sleep_mode=_resolve_sleep_mode(sleep_mode),
            max_model_len=max_model_len,
            engine_kwargs=engine_kwargs,
        )
        self._vllm = vllm
        self._init_state(
            directory,
            tensor_parallel_size=tensor_parallel_size,
            sleep_mode=bool(options.get("enable_sleep_mode", False)),
            sleep_level=sleep_level,
        )
        # Checked last, so bad arguments are reported first.
        if any(b.llm is not None for b in VLLMBackend._open):
            raise ReplayRLError(
                "Another vLLM engine is open in this process; close it first. In-process "
                "engines share vLLM's per-process state (its torch.distributed groups and, "
                "with sleep mode, its memory pool), which shutting one down tears down for both."
            )
        self.llm = None
        # One engine start at a time per GPU (see `policy.start_lock`), then in this process.
        with _start_lock(tensor_parallel_size), _engine_in_this_process():
            self.llm = vllm.LLM(**options)
        VLLMBackend.engines_built += 1
        VLLMBackend._open.add(self)
        from vllm.v1.engine.core_client import InprocClient

        self.in_process = isinstance(self.llm.llm_engine.engine_core, InprocClient)
        text_config = self.llm.model_config.hf_text_config
        self._tied_embeddings = bool(getattr(text_config, "tie_word_embeddings", False))

    def _init_state(
        self, directory: Path, *, tensor_parallel_size: int, sleep_mode: bool, sleep_level: int
    ) -> None:
        """The backend's own state, before its engine is built (also what a test that puts a
        stand-in for `vllm.LLM` under a real backend sets up)."""
        self.checkpoint_dir = directory
        self.tensor_parallel_size = tensor_parallel_size
        self.sleep_mode = sleep_mode
        self.sleep_level = sleep_level
        self.weight_updates = 0  # load_weights calls so far
        self._sleep_level = 0  # 0 = awake, else the level it sleeps at
        self._weights_resident = True  # weights memory mapped (sleep unmaps it)
        self._weights_valid = True  # False after a level-2 sleep until load_weights
        # The checkpoint directory the engine's weights were last read from (None after
        # `load_weights` from tensors in memory): a level-2 wake reloads from it.
        self.weights_dir: Path | None = directory

    @property
    def weights_discarded(self) -> bool:
        """True after a level-2 sleep until the whole model is loaded again."""
        return not self._weights_valid

    @property
    def sleeping(self) -> bool:
        """True between a `sleep` that freed the GPU and the next `wake_up`."""
        return self._sleep_level != 0

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load new policy weights into the live engine, in place; returns how many tensors.

        named_tensors: `(name, tensor)` pairs with Hugging Face names, e.g. a
            `transformers` model's `named_parameters()` or `state_dict().items()`; float32
            or any dtype, on the CPU or a GPU (cast and copied into vLLM's own storage, so
            the caller may change them afterwards). Give the whole model: a parameter left
            out keeps its old value (or, after a level-2 sleep, no value). A tied model's
            `named_parameters()` names the embedding only; `lm_head.weight` is added from
            it, because vLLM's Qwen2 keeps the LM head as a layer of its own (sharing the
            embedding's storage) whose processed weights (repacked for the CPU kernels)
            must be rebuilt too.

        Goes through the worker's `reload_weights` (vLLM's in-place reload, which re-runs
        each layer's weight processing) and then `reset_prefix_cache`, so no KV block
        computed with the old weights is reused. No engine is built. While the engine
        sleeps, only its weights memory is woken for the copy; the KV cache wakes with
        `wake_up` (or the next `generate`), which keeps the peak GPU memory low.
        """
        count = self._load(named_tensors)
        self.weights_dir = None  # tensors from memory: no directory holds them for sure
        return count

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        if self.llm is None:
            raise ReplayRLError("load_weights on a closed vLLM backend.")
        if self.tensor_parallel_size > 1:
            raise ReplayRLError(
                f"load_weights needs the engine's one worker in this process, but "
                f"tensor_parallel_size={self.tensor_parallel_size} runs its workers in processes "
                "of their own; start a new engine from the new checkpoint instead."
            )
        if not self.in_process:
            raise ReplayRLError(
                "load_weights needs the vLLM engine in this process, but it runs in a child "
                f"process ({_MULTIPROCESSING_ENV} is cached as on); build the backend before "
                "anything else starts a vLLM engine in this process."
            )
        if self._sleep_level and not self._weights_resident:
            self.llm.wake_up(tags=["weights"])
            self._weights_resident = True
        _quiet_rotary_reload_warnings()
        count = [0]
        stream = _checkpoint_tensors(named_tensors, tied=self._tied_embeddings, count=count)
        self.llm.collective_rpc(
            "reload_weights", kwargs=dict(weights_iterator=stream, is_checkpoint_format=True)
        )
        if count[0] == 0:
            raise ReplayRLError("load_weights was given no tensors.")
        self._weights_valid = True
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update.")
        self.weight_updates += 1
        return count[0]

    def sleep(self, level: int | None = None) -> None:
        """Free the engine's GPU memory while a trainer uses the GPU (vLLM sleep mode).

        A no-op unless the engine was built with sleep mode (CUDA only; see `__init__`), so
        it is always safe to call; `sleeping` says whether it slept. `level` None = the
        backend's `sleep_level`.

        level 1: the weights are copied to CPU memory (pinned; the model's size in
            vLLM's dtype) and the KV cache is discarded. `wake_up` restores the weights as
            they were, so the engine is correct whether or not `load_weights` follows, in
            either order. The price: host memory for one copy of the weights, and a
            device-to-host copy on sleep plus a host-to-device copy on wake that the next
            `load_weights` overwrites anyway. The safe choice where the weights may not be
            replaced before the next generation: level 2's discarded weights have produced
            silently wrong outputs in vLLM (issues #29341, #16564: state outside the
            parameters, such as rotary caches, lost or not restored), which a CPU cannot
            check (vLLM has no sleep mode there).
        level 2: weights and KV cache are discarded (no host copy; vLLM restores the named
            buffers itself). The engine never generates with the discarded weights: the
            next `load_weights` or `reload_from` must give every parameter, and `wake_up`
            (which `generate` calls) without one first reloads the weights from
            `weights_dir`, the checkpoint they were last read from, or raises when they
            came from tensors in memory.
        """
        level = self.sleep_level if level is None else level
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level}")
        if not self.sleep_mode or self._sleep_level or self.llm is None:
            return
        self.llm.sleep(level=level)
        self._sleep_level = level
        self._weights_resident = False
        self._weights_valid = level == 1

    def wake_up(self, checkpoint_dir: str | Path | None = None) -> None:
        """Give the engine its GPU memory back after `sleep` (a no-op when awake, and always
        on CPU). `checkpoint_dir`: new weights to load first (`reload_from`), the weights
        memory woken for them before the KV cache, so both are never mapped beside an
        extra copy. After a level-2 sleep with no new weights loaded since, the weights are
        reloaded from `checkpoint_dir` or else from `weights_dir` (the last checkpoint they
        were read from) before anything else: the discarded ones are never used."""
        if not self._sleep_level or self.llm is None:
            return
        if checkpoint_dir is None and not self._weights_valid:
            checkpoint_dir = self.weights_dir
            if checkpoint_dir is None:
                raise ReplayRLError(
                    "The vLLM engine slept at level 2, which discarded its weights, and they "
                    "were last loaded from tensors in memory, not from a checkpoint it could "
                    "read again; call load_weights with the whole model before wake_up or "
                    "generate."
                )
        if checkpoint_dir is not None:
            self.reload_from(checkpoint_dir)
        # If load_weights already woke the weights, wake the KV cache only.
        awake = self.llm.wake_up(tags=["kv_cache"] if self._weights_resident else None)
        if awake is False:  # vLLM 0.33: not fully awake, and its scheduler stays paused
            raise RuntimeError(
                "vLLM's wake_up reported the engine not fully awake (its scheduler stays "
                "paused), so generating would hang; this is a vLLM fault: rerun the command."
            )
        self._sleep_level = 0
        self._weights_resident = True

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
        self.wake_up()  # generating needs the weights and the KV cache back
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
                stop_token_ids=list(self.stop_ids),
                logprobs=0,  # 0 = the sampled token's log-prob only
                # Flat lists per request instead of a {id: Logprob} dict per token: a constant
                # number of objects per request for the collector (`_sampled_logprobs`).
                flat_logprobs=True,
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
                    text=decode_ids(tok, ids),
                    finish_reason=_finish_reason(
                        ids,
                        stop_ids=self.stop_ids,
                        max_new_tokens=max_new_tokens,
                        vllm=sample.finish_reason,
                    ),
                    entropy=math.nan,
                )
            )
        return out

    def close(self) -> None:
        """Shut the engine down now, so that another can be built in this process.

        A run that trains several lineages in one process (`replayrl experiment`) builds one
        engine per lineage, and a new engine needs what the old one held: with sleep mode,
        vLLM's memory pool allocator (`CuMemAllocator`, one per process) must hold nothing,
        or the next engine fails "CuMem allocator can only be used for one instance per
        process"; and vLLM checks at start that the GPU has its whole share free. Dropping
        the last reference is not enough (vLLM's engine core is frozen out of the garbage
        collector and keeps a one-process `torch.distributed` group), so the sequence is:

        1. a sleeping engine is woken first (on CUDA, freeing memory that sleep already
           unmapped would unmap it twice);
        2. the engine core shuts down (`InprocClient.shutdown`: its worker drops the model,
           KV cache and workspace, then vLLM's `cleanup_dist_env_and_memory`);
        3. vLLM's model-parallel groups and distributed environment are destroyed again
           (idempotent; an older vLLM's shutdown may not do it). That includes this
           process's default `torch.distributed` group, which the engine built on: no
           training group may share a process with an engine (none does: DDP and the
           asynchronous trainer group train in processes of their own);
        4. the last references go, the garbage collector runs (unfrozen), and torch's
           allocator cache is emptied;
        5. with sleep mode, vLLM's allocator must now hold nothing: a RuntimeError if it
           does (the next engine would fail; better to say so here).

        Safe to call more than once; `load_weights` and `generate` refuse afterwards.
        """
        llm, self.llm = self.llm, None
        VLLMBackend._open.discard(self)
        if llm is None:
            return
        sleeping, self._sleep_level = self._sleep_level, 0
        if sleeping:
            llm.wake_up()  # all of it: nothing may be left unmapped when it is freed
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm, core, shutdown
        _release_process_state()
        if self.sleep_mode:
            # vLLM 0.33 frees the compiled model in a finaliser, so one collection may leave
            # memory that the next frees: collect until the usage stops falling.
            held = collect_until_settled(_sleep_allocator_usage)
            if held:
                raise RuntimeError(
                    f"The closed vLLM engine still holds {held / 2**20:.0f} MiB in vLLM's "
                    "sleep-mode allocator, so no other engine can start in this process; "
                    "something still references the old engine's tensors."
                )

    def reload_from(self, checkpoint_dir: str | Path) -> int:
        """Load the weights of a checkpoint directory into the live engine, in place; returns
        how many tensors. For a policy that is not in this process's memory (a trainer in
        processes of its own, an asynchronous worker following published versions): the
        weight files are read one tensor at a time on the CPU and copied into vLLM's own
        storage by `load_weights`, so no second copy of the model is ever on the GPU (the
        alternative, a transformers model of the new version loaded onto the GPU first,
        costs the model's size in the generation dtype: 15 GB at 7B). Only the files the
        checkpoint's weight index names are read (a full checkpoint's optimizer shards are
        safetensors files too)."""
        directory = Path(checkpoint_dir)
        files = checkpoint_files.weight_files(directory)
        count = self._load(checkpoint_files.stream_tensors(files))
        self.weights_dir = directory
        return count


def _sampled_logprobs(position_logprobs, ids: list[int]) -> list[float]:
    """The log-prob of each sampled token, from vLLM's `FlatLogprobs` (`flat_logprobs=True`)
    or its list of per-position {token id: Logprob}.

    `FlatLogprobs` (vllm/logprobs.py) keeps every position's entries in flat lists, position
    j at `start_indices[j]:end_indices[j]`, the sampled token first (vLLM 0.33
    vllm/v1/engine/logprobs.py, `_update_sample_logprobs`: "Sampler puts the sampled logprob
    in first"); with `logprobs=0` it is the only entry. Read from the lists directly, and
    checked against `ids`, without the dict per position that indexing would build."""
    if position_logprobs is None or len(position_logprobs) != len(ids):
        raise RuntimeError(
            f"vLLM returned {0 if position_logprobs is None else len(position_logprobs)} "
            f"log-prob entries for {len(ids)} tokens; was logprobs=0 dropped?"
        )
    starts = getattr(position_logprobs, "start_indices", None)
    if starts is None:
        return [float(position_logprobs[j][t].logprob) for j, t in enumerate(ids)]
    tokens, values = position_logprobs.token_ids, position_logprobs.logprobs
    if [tokens[k] for k in starts] != list(ids):
        raise RuntimeError("vLLM's flat log-probs do not start each position with its token.")
    return [float(values[k]) for k in starts]


def _finish_reason(
    ids: list[int], *, stop_ids: Sequence[int], max_new_tokens: int, vllm: str | None
) -> str:
    """Finish reason "stop" when the last token is one of the stop ids (any EOS id), else
    "length" (the transformers backend's rule); vLLM's own reason is only cross-checked."""
    if vllm not in _VLLM_FINISHED:
        raise RuntimeError(f"vLLM finished a request with reason {vllm!r}")
    if ids and ids[-1] in stop_ids:
        return "stop"
    if any(t in stop_ids for t in ids) or len(ids) != max_new_tokens:
        raise ReplayRLError(
            f"vLLM stopped after {len(ids)} of {max_new_tokens} tokens without a final EOS "
            f"(reason {vllm!r}); raise max_model_len or shorten the prompts."
        )
    return "length"
