"""Policies on disk: the initial checkpoint (v0), loading, saving with optimizer state.

v0 is either a user's Hugging Face checkpoint or the tiny byte-level demo model, built in
code and given a short, deterministic, cached supervised warm start on the task so RL has
signal (it stops on validation prompts held out of the training pool, never on the
evaluation prompts that later report held-out pass@1). Checkpoint directories are plain Hugging Face layout (safetensors shards +
tokenizer); a full checkpoint adds the optimizer and RNG state (`training_state`, also
safetensors and JSON). Publishing them (and the COMPLETE marker) is `storage`'s job.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from replayrl import storage
from replayrl.config import ModelConfig, RunConfig, default_cache_dir, hub_id
from replayrl.errors import ReplayRLError
from replayrl.policy import hub
from replayrl.policy.evaluation import evaluate_policy
from replayrl.policy.generation import TransformersBackend
from replayrl.policy.problems import Problem, TaskSplits
from replayrl.policy.tiny_model import build_tiny_model, supervised_loss
from replayrl.policy.tokenizer import build_byte_tokenizer
from replayrl.policy.training_state import save_training_state, writing
from replayrl.progress import progress

log = logging.getLogger(__name__)
# Our own progress bars say what is happening; per-file bars of transformers are noise here.
hf_logging.disable_progress_bar()
# Weights and optimizer state are split into safetensors shards of at most this size
# (with an index json): a 0.5B model's float32 weights (2 GB) are 2 shards and its AdamW
# state 4; a 7B model's 28 and 56. Shards bound the memory one file needs in flight and
# let downloads run file by file; the demo model stays one model.safetensors.
MAX_SHARD_SIZE = "1GB"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
WARM_START_FILE = "warm_start.json"


def load_policy(directory: Path, *, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a Hugging Face checkpoint directory, on the CPU in `dtype`
    (float32: the trainer's master weights; see `workers.weights_only_dtype` for copies
    that only generate)."""
    directory = Path(directory)
    if not (directory / "config.json").exists():
        raise ReplayRLError(
            f"No model at '{directory}' (config.json missing). Point model.source at a Hugging "
            f"Face checkpoint directory, or use model.source=tiny."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ReplayRLError(f"Cannot load the model at '{directory}': {e}") from None
    return model, _padded_left(tokenizer)


def policy_skeleton(directory: Path, *, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of the checkpoint in `directory` with the model built on the meta
    device from its config.json: every parameter and buffer shaped, none allocated, no weight
    read. A sharded trainer rank other than 0 builds this; its shards then come from rank 0
    (`sharded.broadcast_from_rank0`), so only rank 0 holds the whole model on the host."""
    from transformers import AutoConfig

    directory = Path(directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as e:
        raise ReplayRLError(f"Cannot load the model at '{directory}': {e}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, _padded_left(tokenizer)


def _padded_left(tokenizer):
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_policy(
    model,
    tokenizer,
    directory: Path,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    max_shard_size: str | int = MAX_SHARD_SIZE,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write the weights (safetensors shards of at most `max_shard_size`) with their
    model.safetensors.index.json, and the tokenizer, into `directory`; with `optimizer`,
    also its state and the RNG states (a full checkpoint, see `training_state`). No pickles.

    The index is written even for a single weights file: the optimizer's shards are
    safetensors files too, and engines that glob "*.safetensors" (vLLM) load only the files
    the index names. `state_dict` (full tensors) replaces the model's own parameters: a
    sharded trainer passes the weights it gathered."""
    directory = Path(directory)
    with writing(directory):  # a full disk: one line, nothing published
        directory.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(
            directory, safe_serialization=True, max_shard_size=max_shard_size, state_dict=state_dict
        )
        _index_single_weights_file(directory)
        tokenizer.save_pretrained(directory)
        if optimizer is not None:
            save_training_state(optimizer, model, directory, max_shard_size=max_shard_size)


def _index_single_weights_file(directory: Path) -> None:
    """model.safetensors.index.json for an unsharded model.safetensors (transformers writes
    one only for shards)."""
    single, index = directory / WEIGHTS_FILE, directory / WEIGHTS_INDEX
    if not single.exists() or index.exists():
        return
    with safe_open(str(single), framework="pt") as f:
        keys = list(f.keys())
    weight_map = {k: WEIGHTS_FILE for k in sorted(keys)}
    meta = {"metadata": {"total_size": single.stat().st_size}, "weight_map": weight_map}
    index.write_text(json.dumps(meta, indent=2) + "\n")


# The warm start holds out the last training problems to know when to stop: one in eight, at
# most this many (a rough pass@1 is all the stop rule needs).
WARM_START_VALIDATION_MAX = 128
# The warm start's torch threads. CPU results are bit-exact for a seed and a thread count,
# but a different count sums in a different order (the same seed warm-started on 1 and on 2
# threads gives different weights, and greedy eval pass@1 0.215 vs 0.176 from them). Pinned,
# v0 is the same whatever OMP_NUM_THREADS or core count the process that builds the cache
# has, and the cache key need not name it.
WARM_START_THREADS = 1


def warm_start_split(splits: TaskSplits) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
    """(problems the warm start trains on, problems it early-stops on).

    The validation problems are the last `min(128, n // 8)` (at least 1) of the n training
    problems, and the warm start trains on the rest. They never include an evaluation
    prompt (the task's train and eval splits share no prompt text), so the held-out pass@1
    reported for v0 and every later checkpoint is measured on prompts the warm start never
    saw, nor chose its stopping step by. RL still draws from all n training problems: the
    validation problems only pick the warm start's stopping step, and are not reported.
    Deterministic for the seed, like the splits themselves. n < 2 leaves no validation.

        n = 4000 -> train on 3872, stop on 128;   n = 200 -> 175 and 25;   n = 9 -> 8 and 1
    """
    train = splits.train
    n = len(train)
    count = min(WARM_START_VALIDATION_MAX, max(1, n // 8)) if n >= 2 else 0
    return train[: n - count], train[n - count :]


def _warm_start_key(cfg: RunConfig, splits: TaskSplits) -> str:
    """The warm start's cache key: a digest of every input `warm_start_tiny` reads.

    The model's shape and vocabulary, the warm-start knobs, the seed, the generation
    settings of its evaluations (max new tokens, batch size), the position budget (which
    reads the longest train and eval prompt), the reward kind, and the problems themselves
    (prompt ids and targets of the training and validation problems, in order), so the
    task's name, options, file (path and content), sizes and seed, and the validation split
    rule, all count through what they produce. `v` versions the code (tokenizer, model,
    optimizer): bump it when the warm start computes something else from the same inputs.
    """
    m = cfg.model
    train, validation = warm_start_split(splits)
    problems = hashlib.sha256()
    for group in (train, validation):
        for p in group:
            problems.update(json.dumps([p.prompt_id, p.target]).encode())
        problems.update(b"|")
    key = {
        "v": 4,  # 4: built on WARM_START_THREADS torch threads
        "shape": [
            m.hidden_size,
            m.num_layers,
            m.num_heads,
            m.num_kv_heads,
            m.intermediate_size,
        ],
        "vocab_size": m.vocab_size,
        "warm": [
            m.warm_start_max_steps,
            m.warm_start_lr,
            m.warm_start_batch_size,
            m.warm_start_eval_every,
            m.warm_start_target_pass1,
        ],
        "seed": cfg.seed,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "eval_batch_size": cfg.rollout.batch_size,
        "max_positions": _max_positions(cfg, splits),
        "reward_kind": splits.reward_kind,
        "problems": [len(train), len(validation), problems.hexdigest()],
    }
    blob = json.dumps(key, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def initial_policy_dir(cfg: RunConfig, splits: TaskSplits) -> Path:
    """A local directory with v0: the user's model (a hub id's snapshot in the Hugging Face
    cache, `replayrl.policy.hub`; a replayrl checkpoint's weights; a Hugging Face folder,
    local or on S3), or the cached warm-started tiny model; with model.untie_word_embeddings,
    a cached copy of it whose output embedding is its own (`untied_copy`)."""
    local = _source_dir(cfg, splits)
    return untied_copy(cfg, local) if cfg.model.untie_word_embeddings else local


def untie_word_embeddings(model) -> bool:
    """Give `model`'s output embedding (lm_head) its own trainable copy of the input
    embedding's weights, and say so in its config (tie_word_embeddings False), so
    save_pretrained writes both matrices and from_pretrained (and vLLM) reads them back
    as two. Returns False when they were not tied (nothing to do)."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if out.weight is not inp.weight and not tied:
        return False
    if out.weight is inp.weight:
        out.weight = torch.nn.Parameter(inp.weight.detach().clone())
    model.config.tie_word_embeddings = False
    for sub in ("text_config", "get_text_config"):
        text = getattr(model.config, sub, None)
        text = text() if callable(text) else text
        if text is not None and hasattr(text, "tie_word_embeddings"):
            text.tie_word_embeddings = False
    return True


def untied_copy(cfg: RunConfig, source: Path) -> Path:
    """`source` itself when its config does not tie the word embeddings, else a copy with
    them untied (`untie_word_embeddings`), cached under the cache directory by a digest of
    the source's path and files, written to a temporary folder and renamed when complete (a
    crash leaves no half copy in use). The weights keep the source's dtype."""
    config = json.loads((Path(source) / "config.json").read_text())
    text = config.get("text_config") or {}
    if not config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)):
        return source
    digest = hashlib.sha256(str(Path(source).resolve()).encode())
    for f in sorted(Path(source).iterdir()):
        if f.is_file():
            digest.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    cache = default_cache_dir(cfg) / "untied" / digest.hexdigest()[:16]

    def build(tmp: Path) -> None:
        model, tokenizer = load_policy(source, dtype=_stored_dtype(config))
        untie_word_embeddings(model)
        save_policy(model, tokenizer, tmp)
        for extra in ("generation_config.json", WARM_START_FILE):
            if (Path(source) / extra).exists() and not (tmp / extra).exists():
                shutil.copy2(Path(source) / extra, tmp / extra)
        log.info("untied word embeddings: %s -> %s", source, cache)

    return built_once(cache, build, what="untied copy")


def _stored_dtype(config: dict) -> torch.dtype:
    """The dtype a checkpoint's config says its weights are stored in (float32 if unsaid)."""
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    return getattr(torch, str(name), torch.float32)


def _source_dir(cfg: RunConfig, splits: TaskSplits) -> Path:
    """`initial_policy_dir` before untying."""
    if cfg.model.source != "tiny":
        src = cfg.model.source
        repo = hub_id(src)
        if repo is not None:
            return hub.download_model(repo, cfg.model.revision).local
        if storage.is_complete(src):
            # A replayrl checkpoint (of another lineage): the files its COMPLETE marker
            # names, checked, without the optimizer and RNG state (a new lineage starts fresh).
            return storage.checkpoint_local_dir(src, default_cache_dir(cfg), weights_only=True)
        if storage.is_s3(src):
            local = default_cache_dir(cfg) / "models" / src[len("s3://") :].rstrip("/")
            return built_once(local, lambda tmp: storage.download_dir(src, tmp), what="model")
        path = Path(storage.normalize_root(src))
        if not (path / "config.json").exists():
            raise ReplayRLError(
                f"model.source '{src}' is not a Hugging Face checkpoint directory (no config.json). "
                f"Fix the path, or use model.source=tiny for the built-in demo model."
            )
        return path
    cache = default_cache_dir(cfg) / "warmstart" / _warm_start_key(cfg, splits)

    def build(tmp: Path) -> None:
        report = warm_start_tiny(cfg, splits, tmp)
        (tmp / WARM_START_FILE).write_text(json.dumps(report, indent=2))

    return built_once(cache, build, what="warm start")


def built_once(cache: Path, build: Callable[[Path], None], *, what: str) -> Path:
    """The cache entry `cache`, built by `build(tmp)` into a temporary folder and renamed
    into place when complete, by one process at a time: every process that finds it missing
    (two first runs at once on a cold cache, xdist workers, a sweep's lineages) takes an
    exclusive lock beside it (`<cache>.lock`, released by the kernel if the holder dies),
    and the ones that waited find it built. A crash mid-build leaves only a temporary folder,
    removed by the next build; a complete entry is never removed or rewritten."""
    if (cache / storage.COMPLETE_MARKER).exists():
        log.info("%s: cached at %s", what, cache)
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.with_name(cache.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another process is building %s; waiting for it", what, cache)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (cache / storage.COMPLETE_MARKER).exists():
            return cache
        tmp = cache.with_name(cache.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed build's (we hold the lock)
        build(tmp)
        (tmp / storage.COMPLETE_MARKER).write_text("complete\n")
        shutil.rmtree(cache, ignore_errors=True)  # an incomplete entry of an older version
        tmp.rename(cache)
    return cache


def _max_positions(cfg: RunConfig, splits: TaskSplits) -> int:
    """The tiny model's max_position_embeddings: 256, or more when the longest prompt plus
    rollout.max_new_tokens needs it (rounded up to a multiple of 256), so transformers does
    not warn and vLLM accepts the whole sequence. One token per byte of the prompt."""
    longest = max(len(p.prompt.encode()) for p in [*splits.train, *splits.eval])
    needed = longest + cfg.rollout.max_new_tokens
    return max(256, -(-needed // 256) * 256)


def warm_start_tiny(cfg: RunConfig, splits: TaskSplits, out_dir: Path) -> dict:
    """Supervised next-token training on (prompt, target) pairs until greedy pass@1 on
    validation problems held out of the training pool (`warm_start_split`, never the
    evaluation prompts) reaches the target. Runs on WARM_START_THREADS torch threads whatever
    the caller's count (restored after), so the weights are bit-exact for the seed and the
    inputs on a given CPU; the result is cached under `_warm_start_key`."""
    m = cfg.model
    train, validation = warm_start_split(splits)
    if m.warm_start_max_steps > 0 and not validation:
        raise ReplayRLError(
            f"The task has {len(splits.train)} training problem(s), leaving the tiny model's "
            "warm start no validation prompt to stop on; give it at least 2 (task.num_train, "
            "or a larger task file)."
        )
    with torch_threads(WARM_START_THREADS):
        return _warm_start_tiny(cfg, splits, train, validation, out_dir)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on `n` torch intra-op threads, then restore the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _warm_start_tiny(
    cfg: RunConfig,
    splits: TaskSplits,
    train: Sequence[Problem],
    validation: Sequence[Problem],
    out_dir: Path,
) -> dict:
    m = cfg.model
    torch.manual_seed(cfg.seed)
    tokenizer = build_byte_tokenizer(vocab_size=m.vocab_size)
    model = build_tiny_model(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size,
        max_position_embeddings=_max_positions(cfg, splits),
        seed=cfg.seed,
    )
    # beta2 0.98, a 100-step linear warm-up and a grad-norm clip of 1 make this small-batch,
    # high-lr run reach the target in ~1000 steps instead of stalling around pass@1 0.05.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=m.warm_start_lr, betas=(0.9, 0.98), weight_decay=0.0
    )
    warmup_steps = 100
    backend = TransformersBackend(model, tokenizer, batch_size=cfg.rollout.batch_size)
    rng = np.random.default_rng([cfg.seed, 7])
    start = time.perf_counter()
    pass1, step = 0.0, 0
    bar = progress(total=m.warm_start_max_steps, desc="warm start")
    for step in range(1, m.warm_start_max_steps + 1):
        idx = rng.integers(0, len(train), size=m.warm_start_batch_size)
        loss = supervised_loss(
            model=model,
            tokenizer=tokenizer,
            prompts=[train[i].prompt for i in idx],
            targets=[train[i].target for i in idx],
        )
        for group in optimizer.param_groups:
            group["lr"] = m.warm_start_lr * min(1.0, step / warmup_steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.update(1)
        if step % m.warm_start_eval_every == 0 or step == m.warm_start_max_steps:
            pass1 = _greedy_pass1(backend, validation, cfg, splits.reward_kind)
            bar.set_postfix(loss=f"{loss.item():.3f}", pass1=f"{pass1:.3f}")
            if pass1 >= m.warm_start_target_pass1:
                break
    bar.close()
    seconds = time.perf_counter() - start
    _log_warm_start(m, pass1=pass1, step=step)
    save_policy(model, tokenizer, out_dir)
    return {
        "steps": step,
        "pass1": pass1,  # on the validation problems
        "validation_prompts": len(validation),
        "seconds": seconds,
    }


def _greedy_pass1(
    backend: TransformersBackend, problems: Sequence[Problem], cfg: RunConfig, reward_kind: str
) -> float:
    """The warm start's stopping signal: greedy pass@1 on the validation problems."""
    res = evaluate_policy(
        backend=backend,
        problems=problems,
        reward_kind=reward_kind,
        max_new_tokens=cfg.rollout.max_new_tokens,
        num_samples=1,
        k=1,
        temperature=1.0,
        seed=cfg.seed,
        sampled=False,
    )
    return res.pass1


def _log_warm_start(m: ModelConfig, *, pass1: float, step: int) -> None:
    """Say when the warm start was off, or stopped short of its target pass@1."""
    if m.warm_start_max_steps == 0:
        log.info("warm start off (model.warm_start_max_steps=0): v0 is the seeded random model")
    elif pass1 < m.warm_start_target_pass1:
        log.warning(
            "warm start reached validation pass@1 %.3f < target %.3f after %d steps; RL may "
            "have little signal",
            pass1,
            m.warm_start_target_pass1,
            step,
        )
