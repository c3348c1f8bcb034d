"""The vLLM engine's sleep level, wired: the level the run chooses reaches the engine, and
after a level-2 sleep (weights discarded) the weights are loaded again before the engine
wakes its KV cache, from the new checkpoint or else the last one, so it never generates with
discarded weights.

vLLM's sleep mode exists on CUDA only (the CPU build refuses `enable_sleep_mode`), and vLLM
is not installed in this environment, so `vllm.LLM` itself is replaced by `LLMStandIn`, a
small model of what its `sleep` / `wake_up` / `reload_weights` do to the weights and the KV
cache. Everything above it is real: `VLLMBackend`'s sleep and wake logic, `TaskResources`'
order of loading and waking, and real tiny checkpoints read from their safetensors files.
What the stand-in cannot show (vLLM restoring its buffers after a real level-2 sleep) needs a
GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from replayrl import storage
from replayrl.config import load_config
from replayrl.engine.resources import TaskResources
from replayrl.errors import ReplayRLError
from replayrl.policy.generation_vllm import VLLMBackend
from replayrl.policy.memory_plan import vllm_sleep_level
from replayrl.policy.models import save_policy
from replayrl.policy.tiny_model import build_tiny_model
from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer

pytestmark = pytest.mark.unit
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


class LLMStandIn:
    """What vLLM's sleep mode does to an engine's memory: level 1 keeps a host copy of the
    weights, level 2 discards them; `wake_up(tags)` maps the weights and/or the KV cache back
    (weights discarded at level 2 come back as garbage); `reload_weights` writes into mapped
    weights only. `events` is the order things happened in."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights: dict[str, torch.Tensor] | None = dict(weights)
        self.weights_mapped = self.kv_mapped = True
        self.host_copy: dict[str, torch.Tensor] | None = None
        self.events: list[str] = []

    def sleep(self, *, level: int) -> None:
        self.host_copy = dict(self.weights or {}) if level == 1 else None
        self.weights = None
        self.weights_mapped = self.kv_mapped = False
        self.events.append(f"sleep {level}")

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = tags or ["weights", "kv_cache"]
        if "weights" in tags and not self.weights_mapped:
            self.weights_mapped = True
            self.weights = self.host_copy  # None after level 2: garbage, not the model
        self.kv_mapped = self.kv_mapped or "kv_cache" in tags
        self.events.append(f"wake {'+'.join(tags)}")

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        assert method == "reload_weights"
        assert self.weights_mapped, "vLLM writes new weights into mapped memory only"
        self.weights = {name: t.clone() for name, t in kwargs["weights_iterator"]}
        self.events.append("reload")

    def reset_prefix_cache(self) -> bool:
        return True

    def can_generate(self) -> bool:
        """What `generate` needs: the model's weights and the KV cache on the device."""
        return self.weights is not None and self.weights_mapped and self.kv_mapped


def checkpoint(directory: Path, seed: int) -> dict[str, torch.Tensor]:
    """A real tiny checkpoint (safetensors, as the trainer writes it); its tensors."""
    model = build_tiny_model(vocab_size=VOCAB_SIZE, hidden_size=16, num_layers=1, seed=seed)
    save_policy(model, build_byte_tokenizer(), directory)
    return {k: v for k, v in load_file(directory / "model.safetensors").items()}


def backend_on(directory: Path, *, level: int, weights) -> tuple[VLLMBackend, LLMStandIn]:
    """A real `VLLMBackend` built on `directory` with sleep mode, `vllm.LLM` stood in for."""
    backend = VLLMBackend.__new__(VLLMBackend)
    backend._init_state(directory, tensor_parallel_size=1, sleep_mode=True, sleep_level=level)
    llm = LLMStandIn(weights)
    backend.llm, backend.in_process, backend._tied_embeddings = llm, True, False
    backend.tokenizer = build_byte_tokenizer()
    return backend, llm


def same(got: dict[str, torch.Tensor] | None, want: dict[str, torch.Tensor]) -> bool:
    return (
        got is not None
        and got.keys() == want.keys()
        and all(torch.equal(got[k], want[k]) for k in want)
    )


def test_a_level_2_wake_without_new_weights_reloads_the_last_checkpoint_first(tmp_path):
    v0 = checkpoint(tmp_path / "v0", seed=0)
    v1 = checkpoint(tmp_path / "v1", seed=1)
    backend, llm = backend_on(tmp_path / "v0", level=2, weights=v0)
    backend.sleep()  # the backend's level: 2
    assert backend.sleeping and backend.weights_discarded and not llm.can_generate()
    backend.wake_up()  # no new checkpoint: the last one, v0, is read again
    assert llm.events == ["sleep 2", "wake weights", "reload", "wake kv_cache"]
    assert same(llm.weights, v0) and llm.can_generate() and not backend.weights_discarded
    # With a new checkpoint at wake: its weights, loaded before the KV cache wakes.
    backend.sleep()
    backend.wake_up(tmp_path / "v1")
    assert llm.events[-3:] == ["wake weights", "reload", "wake kv_cache"]
    assert same(llm.weights, v1) and backend.weights_dir == tmp_path / "v1"


def test_discarded_weights_from_memory_are_never_generated_with(tmp_path):
    v0 = checkpoint(tmp_path / "v0", seed=0)
    backend, llm = backend_on(tmp_path / "v0", level=2, weights=v0)
    trained = {k: v + 1 for k, v in v0.items()}  # a trainer's tensors: in no checkpoint yet
    backend.load_weights(trained.items())
    assert backend.weights_dir is None  # the checkpoint v0 no longer holds these weights
    backend.sleep()
    with pytest.raises(ReplayRLError, match="discarded its weights"):
        backend.generate(
            ["1 + 2 ="], num_samples=1, max_new_tokens=2, temperature=1.0, top_p=1.0, seed=0
        )
    assert not llm.kv_mapped and backend.sleeping  # nothing woke, nothing ran
    backend.load_weights(trained.items())  # the caller gives them again: then it wakes
    backend.wake_up()
    assert same(llm.weights, trained) and llm.can_generate()


def test_level_1_keeps_a_host_copy_and_wakes_without_a_reload(tmp_path):
    v0 = checkpoint(tmp_path / "v0", seed=0)
    backend, llm = backend_on(tmp_path / "v0", level=1, weights=v0)
    backend.sleep()
    assert not backend.weights_discarded
    backend.wake_up()
    assert llm.events == ["sleep 1", "wake weights+kv_cache"] and same(llm.weights, v0)


def test_resources_sleep_at_the_runs_level_and_load_before_waking(tmp_path):
    """What the inline engine does around each training phase, at the level the run chose
    (here 2, the inline layout's): sleep, then at the next generation the new checkpoint's
    weights, then the KV cache; and after a sleep with no training (the same version), the
    same checkpoint again."""
    cfg = load_config(
        PRESET,
        overrides=[
            f"storage.run_root={tmp_path / 'runs'}",
            f"model.cache_dir={tmp_path / 'cache'}",
            "rollout.backend=vllm",
        ],
    )
    assert vllm_sleep_level(cfg) == 2
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    tensors = {}
    for version in (0, 1):
        with storage.writing_in_place(paths.checkpoint(version)) as out:
            tensors[version] = checkpoint(out, seed=version)
    local = storage.checkpoint_local_dir(paths.checkpoint(0), tmp_path / "cache")
    backend, llm = backend_on(local, level=vllm_sleep_level(cfg), weights=tensors[0])
    resources = TaskResources(cfg, paths)
    resources._backend, resources._backend_version = backend, 0  # as if `_start_vllm` built it
    resources.before_training()
    assert resources.backend_at(1) is backend  # the trainer (in other processes) wrote v1
    assert llm.events == ["sleep 2", "wake weights", "reload", "wake kv_cache"]
    assert same(llm.weights, tensors[1]) and llm.can_generate()
    resources.before_training()
    resources.backend_at(1)  # no step ran: v1 again, read from its checkpoint
    assert llm.events[-4:] == ["sleep 2", "wake weights", "reload", "wake kv_cache"]
    assert same(llm.weights, tensors[1]) and backend.weight_updates == 2
