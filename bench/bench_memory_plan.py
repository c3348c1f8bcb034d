"""The memory plan's activation estimate against the real forward, at configs/shapes-cpu.yaml.

`replayrl plan` (replayrl.policy.memory_plan) estimates what one micro-batch keeps from its
forward to its backward. This measures it exactly: the trainer's own forward
(`TokenPolicyLoss`, the model of configs/shapes-cpu.yaml: hidden 128, 4 layers, 4/2 heads,
MLP 256, vocabulary 151,936) runs on one micro-batch of the preset (8 rows of ~525 tokens,
right-padded to the longest) under `torch.autograd.graph.saved_tensors_hooks`, and every
tensor the graph still holds when the forward returns is summed once per storage (the
parameters excluded: they are counted as weights). Saved tensors of the chunked loss's inner
graphs, freed inside the forward, do not count: they are the logits chunk's transient memory.

Float32 (the CPU trainer) at the preset's shapes, and bf16 autocast (the GPU trainer's
precision, emulated on the CPU) and twice the width with the byte vocabulary, each with and
without activation checkpointing. Prints JSON and writes bench/results/memory_plan.json.

    PYTHONPATH=src python bench/bench_memory_plan.py      (~1-3 min on 2 cores)
"""

from __future__ import annotations

import json
import sys
import time
import weakref
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "memory_plan.json"
TOLERANCE = 0.20


def measured_saved_bytes(model, batch, settings) -> int:
    """Bytes of the storages the autograd graph of one forward holds when it returns."""
    from replayrl.policy.loss_kernels import TokenPolicyLoss

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = TokenPolicyLoss(model, settings)(batch, 1.0)
    alive: dict[int, int] = {}
    for ref in saved:
        t = ref()
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in params or storage.nbytes() == 0:
            continue
        alive[storage.data_ptr()] = storage.nbytes()
    del loss
    return sum(alive.values())


def micro_batch(*, rows: int, completion: int, prompt: int, vocab: int) -> dict:
    """A right-padded micro-batch as `collate` builds it: prompts of prompt-2..prompt tokens
    (chain_sum's bare expressions), `completion` completion tokens each."""
    gen = torch.Generator().manual_seed(0)
    lengths = [prompt - (i % 3) + completion for i in range(rows)]
    longest = max(lengths)
    ids = torch.full((rows, longest), 257, dtype=torch.long)
    attention = torch.zeros((rows, longest), dtype=torch.long)
    mask = torch.zeros((rows, longest - 1))
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, vocab, (n,), generator=gen)
        attention[i, :n] = 1
        mask[i, n - completion - 1 : n - 1] = 1
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": mask,
        "logp_behavior": torch.zeros((rows, longest - 1)),
        "advantages": torch.ones(rows),
    }


def main() -> int:
    sys.path.insert(0, str(REPO / "src"))
    from replayrl.config import load_config
    from replayrl.policy.memory_plan import activation_bytes, model_shape
    from replayrl.policy.tiny_model import build_tiny_model
    from replayrl.policy.training import StepSettings, prepare_model

    cfg = load_config(REPO / "configs" / "shapes-cpu.yaml")
    m, t = cfg.model, cfg.train
    rows, completion, prompt = t.micro_batch_size, cfg.rollout.max_new_tokens, 12
    cases = []
    torch.manual_seed(0)
    # float32 (the CPU trainer) at the preset's shapes; bf16 autocast (the GPU trainer's
    # precision, emulated slowly on a CPU) and twice the width with the byte vocabulary (264
    # rows: the layers' activations do not depend on it, and the output layer is a line of the
    # plan of its own), so a formula that only fits one shape or one precision would show.
    runs = [
        (1, m.vocab_size, ("float32",)),
        (1, 264, ("bfloat16",)),
        (2, 264, ("float32", "bfloat16")),
    ]
    for width, vocab, dtypes in runs:
        shape_cfg = load_config(
            REPO / "configs" / "shapes-cpu.yaml",
            overrides=[
                f"model.hidden_size={m.hidden_size * width}",
                f"model.intermediate_size={m.intermediate_size * width}",
                f"model.vocab_size={vocab}",
            ],
        )
        shape = model_shape(shape_cfg)
        model = build_tiny_model(
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            intermediate_size=shape.intermediate_size,
            max_position_embeddings=1024,
            seed=0,
        )
        batch = micro_batch(rows=rows, completion=completion, prompt=prompt, vocab=259)
        tokens = batch["input_ids"].numel()
        scored = int(batch["completion_mask"].sum())
        for dtype in dtypes:
            for ckpt in (False, True):
                prepare_model(model, activation_checkpointing=ckpt)
                if not ckpt:
                    model.gradient_checkpointing_disable()
                model.train()
                settings = StepSettings(
                    loss_name="grpo",
                    clip_eps=0.2,
                    is_cap=None,
                    temperature=1.0,
                    grad_clip=1.0,
                    lr=1e-4,
                    weight_decay=0.0,
                    betas=(0.9, 0.999),
                    logprob_chunk_tokens=t.logprob_chunk_tokens,
                    dtype=dtype,
                )
                start = time.perf_counter()
                measured = measured_saved_bytes(model, batch, settings)
                bf16 = dtype == "bfloat16"
                # What the forward leaves for backward (a checkpointed layer's recomputed set
                # exists only during backward, which the plan's peak adds).
                estimate = activation_bytes(
                    shape,
                    tokens=tokens,
                    completion_tokens=scored,
                    bf16=bf16,
                    checkpointing=ckpt,
                    recompute=False,
                )
                # The output layer's gradient (and bf16 weight), which the plan lists as its
                # own line, is held by the loss as well.
                head = shape.vocab_size * shape.hidden_size
                estimate += 4 * head + (2 * head if bf16 else 0)
                cases.append(
                    {
                        "hidden_size": shape.hidden_size,
                        "vocab_size": shape.vocab_size,
                        "intermediate_size": shape.intermediate_size,
                        "dtype": dtype,
                        "activation_checkpointing": ckpt,
                        "rows": rows,
                        "padded_tokens": tokens,
                        "measured_bytes": measured,
                        "estimated_bytes": estimate,
                        "ratio": round(estimate / measured, 3),
                        "seconds": round(time.perf_counter() - start, 1),
                    }
                )
                print(json.dumps(cases[-1]), file=sys.stderr, flush=True)
                OUT.parent.mkdir(parents=True, exist_ok=True)
                OUT.write_text(json.dumps({"partial": True, "cases": cases}, indent=2) + "\n")
    worst = max(abs(c["ratio"] - 1) for c in cases)
    result = {
        "what": "saved-tensor bytes of one micro-batch's forward (output layer's held gradient "
        "included) vs replayrl.policy.memory_plan's estimate, configs/shapes-cpu.yaml",
        "torch": torch.__version__,
        "tolerance": TOLERANCE,
        "worst_relative_error": round(worst, 3),
        "within_tolerance": worst <= TOLERANCE,
        "cases": cases,
    }
    print(json.dumps(result, indent=2))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
