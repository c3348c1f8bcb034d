"""The long-lived resources of one run or one Kubeflow task.

What is expensive to start lives here for the whole task instead of for one step:

- the `Trainer`: the policy and its AdamW state in memory (on the GPU when there is one),
  trained in place iteration after iteration and written to storage only when a full
  checkpoint is due;
- the generation backend, which evaluation uses too: with transformers it wraps the
  trainer's own model (always the current policy, nothing to copy); with vLLM one engine is
  started once and given the new weights in place after each training phase (the trainer's
  tensors when it is in this process, else read from the checkpoint's files by the engine,
  `VLLMBackend.reload_from`), sleeping (GPU) while the trainer runs; its default share of GPU memory leaves room for the trainer's
  resident state (`engine_share.memory_share`);
- the buffer and its in-memory mirror (`BufferMirror`), synced version by version, so a
  draw costs O(sample) instead of a read of the whole table;
- the task's data splits.

The steps (`replayrl.engine.steps`) take a `TaskResources` or None: with None (one Kubeflow pod per
step) each step loads what it needs from storage and lets it go (through resources of its own,
`for_one_step=True`: no trainer shares their GPU). On the CPU results are the same either
way: the trainer's in-memory policy equals the checkpoint it would have written. On a GPU a
weights-only copy runs in the generation dtype (`weights_only_dtype`, bfloat16) while the
trainer's own model is float32, so generation there matches to bfloat16 precision, not bit
for bit.

This module knows nothing about the loop, lineages' state, trackers or Kubeflow.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from replayrl import storage
from replayrl.buffer.mirror import BufferMirror
from replayrl.buffer.table import ReplayBuffer
from replayrl.config import RunConfig, default_cache_dir, temp_root
from replayrl.core import clock
from replayrl.core.clock import Clocks
from replayrl.engine.trainer_group import TrainerGroup, close_trainers, load_trainer
from replayrl.errors import ReplayRLError
from replayrl.policy.models import load_policy, save_policy
from replayrl.policy.training import (
    NonFiniteStepError,
    StepSettings,
    StepStats,
    gradient_step,
    make_optimizer,
    prepare_model,
)
from replayrl.policy.training_state import load_training_state
from replayrl.storage import LineagePaths

log = logging.getLogger(__name__)


def device() -> str:
    """Where the policy trains and the transformers backend generates: the GPU when CUDA is
    usable, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# vllm_dtype names vLLM accepts for the float types we can mirror ("auto" runs our float32
# checkpoints in bfloat16).
_VLLM_DTYPES = {
    "auto": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
}


def weights_only_dtype(cfg: RunConfig, on: str) -> torch.dtype:
    """The dtype a weights-only copy (generation, evaluation) is loaded in on device `on`.

    On CUDA it is the generation dtype: bfloat16 for the transformers backend, and for
    vLLM what `rollout.vllm_dtype` makes the engine run (bfloat16 for "auto"), so weights
    handed to the engine are what it would have loaded itself. On the CPU it is float32,
    like the trainer's master weights (bfloat16 matmuls there are slow and inexact). The
    trainer itself always loads float32.

    Example: backend "transformers" -> bfloat16 on "cuda", float32 on "cpu"; backend
    "vllm" with vllm_dtype "float32" -> float32 on "cuda".
    """
    if on != "cuda":
        return torch.float32
    r = cfg.rollout
    if r.backend == "vllm":
        return _VLLM_DTYPES.get(r.vllm_dtype, torch.bfloat16)
    return torch.bfloat16


def load_weights_only(cfg: RunConfig, paths: LineagePaths, version: int, *, uri: str | None = None):
    """(model, tokenizer) of checkpoint v{version} (or of the checkpoint at `uri`) on
    `device()` in `weights_only_dtype`, from a copy without the optimizer and RNG state
    (generation and evaluation never download it)."""
    local = storage.checkpoint_local_dir(
        uri or paths.checkpoint(version), default_cache_dir(cfg), weights_only=True
    )
    on = device()
    model, tokenizer = load_policy(local, dtype=weights_only_dtype(cfg, on))
    return model.to(on), tokenizer


def checkpoint_num_params(directory: Path) -> int:
    """Parameters in a local checkpoint's weight files, read from their headers (no tensor
    is loaded; the optimizer's safetensors shards are training state, not parameters)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(directory).glob("*.safetensors")):
        if storage.is_training_state(path.name):
            continue
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                total += int(np.prod(f.get_slice(key).get_shape()))
    return total


def gpu_total_bytes() -> int | None:
    """Total memory of this process's GPU; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


class Trainer:
    """The policy being trained and its optimizer, in memory. `version` is the policy
    version the weights are at (v_t after iteration t)."""

    def __init__(
        self,
        model,
        tokenizer,
        optimizer,
        *,
        settings: StepSettings,
        version: int,
        copy_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.optimizer = optimizer
        self.settings = settings
        self.version = version
        # The dtype weights-only copies are written in (`save`): the generation dtype
        # (`weights_only_dtype`); None: bfloat16 when the model is on a GPU, else float32.
        self.copy_dtype = copy_dtype
        self._publication: storage.Publication | None = None  # the last background save
        self._pinned: dict[str, torch.Tensor] = {}  # host buffers reused by snapshots

    @classmethod
    def load(
        cls, cfg: RunConfig, paths: LineagePaths, *, version: int, settings: StepSettings
    ) -> Trainer:
        """Checkpoint v{version} in float32 (the master weights) with its optimizer (and
        RNG) state; a checkpoint without one (v0) starts a fresh optimizer."""
        local = storage.checkpoint_local_dir(paths.checkpoint(version), default_cache_dir(cfg))
        model, tokenizer = load_policy(local, dtype=torch.float32)
        model = model.to(device())
        prepare_model(model, activation_checkpointing=cfg.train.activation_checkpointing)
        optimizer = make_optimizer(
            model, lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas
        )
        load_training_state(optimizer, model, local)
        return cls(
            model,
            tokenizer,
            optimizer,
            settings=settings,
            version=version,
            copy_dtype=weights_only_dtype(cfg, device()),
        )

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def full_model(self):
        """The whole policy in this process, to generate with (`TrainerGroup`: None when
        sharded)."""
        return self.model

    def named_weights(self):
        """(name, tensor) of every weight of the whole policy, for a generation engine."""
        return self.model.named_parameters()

    def train(self, batches, *, seed: int, iteration: int | None = None) -> list[StepStats]:
        """One gradient step per batch, in place; the policy becomes v{version + 1}.

        A step whose loss or gradient norm is not finite raises `NonFiniteStepError` naming
        `iteration` (default version + 1, the synchronous engine's) and the step (1-based),
        before that step changes anything. Steps before it in this call have moved the
        weights: the trainer then holds no policy version (`version` -1), so nothing reuses
        it as v{version}; the caller commits nothing and a resume reloads a checkpoint."""
        torch.manual_seed(seed)
        stats = []
        for step, rows in enumerate(batches, start=1):
            try:
                stats.append(
                    gradient_step(
                        model=self.model,
                        optimizer=self.optimizer,
                        rows=rows,
                        pad_id=self.tokenizer.pad_token_id,
                        settings=self.settings,
                        step=step,
                    )
                )
            except NonFiniteStepError as e:
                at = self.version + 1 if iteration is None else iteration
                if step > 1:
                    self.version = -1
                raise e.at(iteration=at, step=step) from None
        self.version += 1
        return stats

    def save(
        self,
        uri: str,
        *,
        before_write=None,
        weights_only: bool = False,
        background: bool = False,
        dtype: torch.dtype | None = None,
    ) -> storage.Publication:
        """Publish a full checkpoint (float32 master weights, tokenizer, optimizer and RNG
        state: what a resume needs) at `uri`: its own sub-folder, fsynced and hashed, then
        the COMPLETE marker naming it (`storage.checkpoints`). `before_write()` runs just
        before the first byte is written (the caller's last chance to find the lineage taken
        by another run). For S3 the files are staged first under `config.temp_root()` (a
        pod's scratch volume) and uploaded in parallel multipart streams, hashed as they go.

        `weights_only`: the weights and tokenizer only (what the asynchronous trainer
        publishes for workers and the evaluator), in `dtype` (default `copy_dtype`, the
        generation dtype: bfloat16 on a GPU, half a float32 copy's bytes).

        `background` (weights only): return as soon as the weights are copied to the host
        (`host_snapshot`; pinned buffers on a GPU, reused from one publication to the next),
        and write, upload and mark the copy complete in a thread while training goes on.
        At most one is in flight: a second waits for the first to finish first. The
        returned `Publication`'s `wait()` raises what failed (one line); a failed one left
        no COMPLETE marker. Without `background` the publication has finished on return."""
        if background and not weights_only:
            raise ValueError("background saves are for weights-only copies")
        state_dict = None
        if weights_only:
            dtype = dtype or self.copy_dtype or default_copy_dtype(self.model)
            if background or dtype != next(self.model.parameters()).dtype:
                if self._publication is not None:
                    self._publication.join()  # its buffers are about to be reused
                state_dict = host_snapshot(self.model, dtype, reuse=self._pinned)
        publication = publish_policy(
            self.model,
            self.tokenizer,
            uri,
            optimizer=None if weights_only else self.optimizer,
            state_dict=state_dict,
            before_write=before_write,
            background=background,
        )
        if background:
            self._publication = publication
        return publication


def publish_policy(
    model,
    tokenizer,
    uri: str,
    *,
    optimizer=None,
    state_dict: dict[str, torch.Tensor] | None = None,
    before_write=None,
    background: bool = False,
) -> storage.Publication:
    """Write `model`'s checkpoint files (`save_policy`: `state_dict` in place of its own
    weights, the optimizer's state with `optimizer`) and publish them as checkpoint `uri`,
    its COMPLETE marker last: in place locally, staged under `config.temp_root()` for S3 and
    removed once uploaded. `background`: all of it in a thread (`state_dict` must then be a
    snapshot nothing changes meanwhile); see `Trainer.save`."""
    tmp = None
    if storage.is_s3(uri):
        tmp = Path(tempfile.mkdtemp(prefix="replayrl-ckpt-", dir=temp_root()))

    def write() -> None:
        if tmp is not None:
            save_policy(model, tokenizer, tmp, optimizer=optimizer, state_dict=state_dict)
            if before_write is not None:
                before_write()
            storage.write_checkpoint(tmp, uri)
            return
        if before_write is not None:
            before_write()
        # Locally, write in place (no copy) into a fresh sub-folder of the version; the
        # COMPLETE marker naming it goes last (`storage.checkpoints`).
        with storage.writing_in_place(uri) as out:
            save_policy(model, tokenizer, out, optimizer=optimizer, state_dict=state_dict)

    def cleanup() -> None:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    if background:
        return storage.publish_in_background(uri, write, cleanup=cleanup)
    try:
        write()
    finally:
        cleanup()
    return storage.Publication.finished(uri)


def default_copy_dtype(model) -> torch.dtype:
    """A weights-only copy's dtype when no config says (`weights_only_dtype`'s rule for the
    transformers backend): bfloat16 for a model on a GPU, else float32."""
    on_gpu = next(model.parameters()).device.type == "cuda"
    return torch.bfloat16 if on_gpu else torch.float32


def host_snapshot(
    model, dtype: torch.dtype, *, reuse: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """A copy of `model`'s weights on the host in `dtype`, taken now (the model may train on
    while the copy is written): the names a checkpoint has (a tied weight once, under the
    name one process's checkpoint keeps). From a GPU into pinned buffers (a fast copy;
    `reuse` keeps them for the next snapshot of the same shapes), then one synchronize."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tied = names - {n for n, _ in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    on_gpu = False
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in tied:
                continue
            if tensor.device.type != "cuda":
                out[name] = tensor.detach().to(dtype=dtype, copy=True)
                continue
            on_gpu = True
            buf = (reuse or {}).get(name)
            if buf is None or buf.shape != tensor.shape or buf.dtype != dtype:
                buf = torch.empty(tensor.shape, dtype=dtype, pin_memory=True)
                if reuse is not None:
                    reuse[name] = buf
            buf.copy_(tensor.detach(), non_blocking=True)
            out[name] = buf
    if on_gpu:
        torch.cuda.synchronize()
    return out


@dataclass
class StartupTimes:
    """Seconds spent starting the task's resources, by part (logged, spread over the task's
    iterations, as `ledger/startup_seconds`)."""

    trainer_load: float = 0.0
    engine_start: float = 0.0


@dataclass
class TaskResources:
    """Everything one run or task keeps between iterations; see the module docstring."""

    cfg: RunConfig
    paths: LineagePaths
    splits: object | None = None  # TaskSplits, loaded on first use
    # True for the resources one step makes for itself and closes after it (no `TaskResources` given,
    # as in kubernetes.layout "step"): no trainer shares the engine's GPU, and the engine is
    # never given new weights in place.
    for_one_step: bool = False
    trainer: Trainer | TrainerGroup | None = None
    # Where the weights of policy version v are read from (default: the full checkpoint
    # v). The asynchronous engine's resources and evaluator read published weights-only copies.
    weights_uri: Callable[[int], str] | None = None
    startup: StartupTimes = field(default_factory=StartupTimes)
    _buffer: ReplayBuffer | None = None
    _mirror: BufferMirror | None = None
    _backend: object | None = None
    _backend_version: int | None = None
    _backend_sleeping: bool = False
    _weights: tuple | None = None  # (version, model, tokenizer) of a weights-only load
    _engine_sync: Clocks = Clocks(0.0, 0.0)  # wall and CPU seconds since the last pop

    def __post_init__(self) -> None:
        r = self.cfg.rollout
        if r.backend == "vllm" and r.tensor_parallel_size > 1 and not self.for_one_step:
            raise ReplayRLError(
                f"rollout.tensor_parallel_size={r.tensor_parallel_size}: a run or task keeps one "
                "vLLM engine and gives it the trainer's new weights in place, which needs the "
                "engine's one worker in this process. Set rollout.tensor_parallel_size: 1, or "
                "run on Kubeflow with kubernetes.layout: step (each generate and evaluate pod "
                "starts its own engine from the checkpoint)."
            )

    # ---- buffer

    @property
    def buffer(self) -> ReplayBuffer:
        if self._buffer is None:
            self._buffer = ReplayBuffer(
                self.paths.buffer, storage_options=storage.delta_storage_options(self.paths.buffer)
            )
        return self._buffer

    def mirror(self, columns: list[str]):
        """The buffer's in-memory mirror (created on first use, synced by its `sample`)."""
        if self._mirror is None:
            self._mirror = BufferMirror(self.buffer, columns=columns)
        return self._mirror

    def forget_buffer(self) -> None:
        """Drop the mirror (after the tables were restored to an older version, a fresh
        mirror is simpler than walking back)."""
        self._mirror = None
        self._buffer = None

    # ---- trainer

    def trainer_at(self, version: int, settings: StepSettings) -> Trainer:
        """The trainer holding policy v{version}: the one in memory, or loaded from the
        full checkpoint v{version}."""
        if self.trainer is not None and self.trainer.version == version:
            return self.trainer
        start = time.perf_counter()
        # Let the old one go first: two models may not fit at once.
        old, self.trainer = self.trainer, None
        close_trainers(old)
        self.trainer = load_trainer(self.cfg, self.paths, version=version, settings=settings)
        self._weights = None  # a weights-only copy is of no more use
        self.startup.trainer_load += time.perf_counter() - start
        return self.trainer

    def policy_at(self, version: int):
        """(model, tokenizer) of v{version} for generation or evaluation: the trainer's
        when it holds that version, else a weights-only copy from the checkpoint (kept
        until another version is asked for)."""
        if self.trainer is not None and self.trainer.version == version:
            if self.trainer.full_model is not None:
                return self.trainer.full_model, self.trainer.tokenizer
            # Sharded trainers: their weights gathered into a copy (no checkpoint written).
            if self._weights is None or self._weights[0] != version:
                self._weights = (version, *self._gathered_copy())
            return self._weights[1], self._weights[2]
        if self._weights is None or self._weights[0] != version:
            self._weights = (
                version,
                *load_weights_only(self.cfg, self.paths, version, uri=self._uri(version)),
            )
        return self._weights[1], self._weights[2]

    def _gathered_copy(self):
        """(model, tokenizer): the sharded trainers' current weights in the weights-only copy
        this task already holds (loaded once, from the checkpoint they started from), so an
        iteration reads nothing from storage."""
        group = self.trainer
        weights = dict(group.named_weights())
        if self._weights is not None:
            model, tokenizer = self._weights[1], self._weights[2]
        else:
            model, tokenizer = load_weights_only(self.cfg, self.paths, group.checkpoint_version)
        model.load_state_dict(
            {k: v.to(next(model.parameters()).dtype) for k, v in weights.items()}, strict=False
        )
        return model, tokenizer

    def _uri(self, version: int) -> str:
        return self.weights_uri(version) if self.weights_uri else self.paths.checkpoint(version)

    def forget_weights_copy(self) -> None:
        """Let a weights-only copy go (its memory is better spent on the engine)."""
        self._weights = None

    # ---- generation backend

    def load_weights_at(self, version: int, named_tensors) -> None:
        """Make these resources hold policy v{version} with `named_tensors` (Hugging Face
        names), in place: vLLM's in-place reload (`VLLMBackend.load_weights`), or a copy into
        the transformers model a weights-only load made. Nothing is read from storage, and
        the next `backend_at(version)` reloads nothing (weights that came by broadcast,
        `replayrl.engine.asynchronous.weights`)."""
        if self.cfg.rollout.backend == "vllm":
            if self._backend is None:
                raise RuntimeError("no vLLM engine started yet")
            self._backend.load_weights(named_tensors)
            self._backend_version = version
            return
        if self._weights is None:
            raise RuntimeError("no weights-only copy loaded yet")
        _, model, tokenizer = self._weights
        params = dict(model.named_parameters())
        named = list(named_tensors)
        if {name for name, _ in named} != set(params):
            raise KeyError("the staged tensors are not the model's parameters")
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor)
        self._weights = (version, model, tokenizer)

    def backend_at(self, version: int):
        """The generation backend holding policy v{version}. transformers: a view of the
        trainer's model. vLLM: one engine for the whole task, woken and given the trainer's
        weights in place when they changed."""
        from replayrl.policy.generation import make_backend

        r = self.cfg.rollout
        if r.backend != "vllm":
            model, tokenizer = self.policy_at(version)
            if self._backend is None or self._backend.model is not model:
                self._backend = make_backend(r.backend, model, tokenizer, batch_size=r.batch_size)
            return self._backend
        if self._backend is None:
            start = time.perf_counter()
            self._backend = self._start_vllm(version)
            self.startup.engine_start += time.perf_counter() - start
            self._backend_version = version
        start = clock.now()
        if self._backend_sleeping:
            if torch.cuda.is_available():
                # The trainer's activations sit in torch's allocator cache; the engine's share
                # (`memory_share`) counts on them being given back before its KV cache returns.
                torch.cuda.empty_cache()
            # New weights first (only the weights memory wakes for them), then the KV cache.
            # After a level-2 sleep the weights are gone even when the version is the same
            # (no step ran), so they are loaded again: never a generation on discarded ones.
            if self._backend_version != version or self._backend.weights_discarded:
                self._load_engine_weights(version)
            self._backend.wake_up()
            self._backend_sleeping = False
        elif self._backend_version != version:
            self._load_engine_weights(version)
        self._add_engine_sync(start)
        return self._backend

    def _load_engine_weights(self, version: int) -> None:
        """Give the vLLM engine the weights of v{version}: the trainer's tensors when it
        holds that version, else the checkpoint's files."""
        if self.trainer is not None and self.trainer.version == version:
            # In this process's memory, or gathered onto it from sharded trainer ranks.
            self._backend.load_weights(self.trainer.named_weights())
        else:
            # Not in this process's memory (asynchronous workers, a resumed task): the
            # engine reads the checkpoint's weight files itself, tensor by tensor on
            # the CPU, with no second copy of the model on the GPU.
            self._backend.reload_from(
                storage.checkpoint_local_dir(
                    self._uri(version), default_cache_dir(self.cfg), weights_only=True
                )
            )
        self._backend_version = version

    def _start_vllm(self, version: int):
        from replayrl.policy.engine_share import gpu_sharing_from_env, memory_share
        from replayrl.policy.generation import make_backend
        from replayrl.policy.memory_plan import vllm_sleep_level

        r = self.cfg.rollout
        local = storage.checkpoint_local_dir(
            self._uri(version), default_cache_dir(self.cfg), weights_only=True
        )
        share = r.vllm_gpu_memory_utilization
        sharing = gpu_sharing_from_env()
        if share is None and sharing is not None:
            # An asynchronous role: `engines` engines on this GPU, maybe beside a trainer
            # rank that trains while they generate (`engine.asynchronous.devices`).
            engines, trainer_on_gpu = sharing
            share = memory_share(
                trainer_params=checkpoint_num_params(local) if trainer_on_gpu else 0,
                gpu_bytes=gpu_total_bytes(),
                engines=engines,
                trainer_concurrent=True,
            )
            log.info("vLLM engine: gpu_memory_utilization %.2f (automatic)", share)
        if share is None:
            # The trainer (rank 0 of a group: its shard under FSDP) stays on this GPU
            # between its steps for the whole task.
            params = 0 if self.for_one_step else checkpoint_num_params(local)
            if self.cfg.train.distributed == "fsdp":
                params //= self.cfg.train.num_processes
            share = memory_share(trainer_params=params, gpu_bytes=gpu_total_bytes())
            log.info("vLLM engine: gpu_memory_utilization %.2f (automatic)", share)
        options = dict(
            dtype=r.vllm_dtype,
            gpu_memory_utilization=share,
            tensor_parallel_size=r.tensor_parallel_size,
            seed=self.cfg.seed,
            sleep_level=vllm_sleep_level(self.cfg),
        )
        return make_backend(
            "vllm", None, None, batch_size=r.batch_size, checkpoint_dir=local, vllm_options=options
        )

    def before_training(self) -> None:
        """Let the trainer have the GPU: a vLLM engine sleeps (its KV cache and weights
        leave GPU memory) until the next generation wakes it, at its sleep level
        (`rollout.vllm_sleep_level`; 2 discards the weights, which `backend_at` loads again
        before the engine wakes)."""
        if (
            self._backend is not None
            and self.cfg.rollout.backend == "vllm"
            and not self._backend_sleeping
        ):
            start = clock.now()
            self._backend.sleep()
            self._backend_sleeping = True
            self._add_engine_sync(start)

    def _add_engine_sync(self, start: Clocks) -> None:
        took = clock.since(start)
        self._engine_sync = Clocks(
            self._engine_sync.wall + took.wall, self._engine_sync.cpu + took.cpu
        )

    def pop_engine_sync(self) -> Clocks:
        """Wall and CPU seconds spent putting the engine to sleep, waking it and loading new
        weights into it since the last call (the ledger's `engine_sync` part)."""
        took, self._engine_sync = self._engine_sync, Clocks(0.0, 0.0)
        return took

    def close(self) -> None:
        """Stop the generation engine (now rather than at garbage collection) and the trainer
        group's processes."""
        trainer, self.trainer = self.trainer, None
        close_trainers(trainer)
        backend, self._backend = self._backend, None
        close = getattr(backend, "close", None)
        if callable(close):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - closing must not mask the run's outcome
                log.warning("could not close the generation engine: %s", e)
