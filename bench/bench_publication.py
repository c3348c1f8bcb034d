"""One publication of a policy's weights (issue 38 item 2): what the trainer waits for, and
how long until the copy is complete on S3 (a SeaweedFS server on loopback).

Candidates, interleaved, each publishing a fresh version of the same model:

- bare: `safetensors.torch.save_file` of the bf16 weights to a local file, the floor of
  writing those bytes at all (no upload, no hashing, no marker);
- float32_sync: `Trainer.save(uri, weights_only=True, dtype=float32)`, the publication as it
  was: float32 files written, uploaded and marked complete before it returns;
- bf16_background: `Trainer.save(uri, weights_only=True, background=True, dtype=bfloat16)`:
  `_return` is what the trainer waits for (the host snapshot), `_total` until `wait()` finds
  the copy complete and every file hashed;
- broadcast: `replayrl.policy.weight_broadcast.Sender.send` of `Trainer.named_weights()`
  (cast to bfloat16 in the sender's buckets, 256 MiB each, the engine's default) to two
  receiver processes (spawned, each a `Receiver` thread staging what arrives), over gloo on
  loopback: `broadcast_s` is what the trainer waits for, until every receiver acked
  (`Delivery.seconds`); `broadcast_receive_s` is the slower receiver's header-to-last-bucket
  time (`Staged.seconds`). The store is polled every 50 ms on both sides (a receiver for the
  header, the sender for the acks), so up to ~0.1 s of a send is that polling, whatever the
  size. Gloo on the CPU only: NCCL between GPUs is not measured here.

Ratios: the trainer's wait against the bare write and against the float32 publication, the
background publication's whole time against the float32 one, and the broadcast's wait against
the bare write and the float32 publication. The model is a Qwen2 built
in code (random weights; nothing downloaded): ~0.12 B parameters, or the tiny model with
`--quick`. On the CPU a host snapshot is a copy in memory; on a GPU it is a pinned
device-to-host copy (not measured here).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import interleaved, median, paired_ratio, parse_args, report  # noqa: E402

RECEIVERS = 2
BUCKET_BYTES = 256 * 2**20  # asynchronous.weight_bucket_mib's default
TIMEOUT_S = 120.0


def _receiver(member: int, address: tuple[str, int], seen, stop) -> None:
    """A receiver process: a `Receiver` thread joins the sender's group and stages each
    send; each newly staged version goes to `seen` as (member, version, seconds)."""
    import time

    import torch

    from replayrl.policy.weight_broadcast import Receiver

    torch.set_num_threads(1)
    receiver = Receiver(
        member=member, address=lambda: address, timeout_s=TIMEOUT_S, device="cpu"
    ).start()
    last = None
    try:
        while not stop.is_set():
            staged = receiver.peek()
            if staged is not None and staged.version != last:
                last = staged.version
                seen.put((member, staged.version, staged.seconds))
            time.sleep(0.01)
    finally:
        receiver.close()


def build(quick: bool):
    import torch

    from replayrl.engine.resources import Trainer
    from replayrl.policy.tiny_model import build_tiny_model
    from replayrl.policy.tokenizer import build_byte_tokenizer

    torch.set_num_threads(1)
    shape = (
        dict(vocab_size=264)
        if quick
        else dict(
            vocab_size=32_768,
            hidden_size=1024,
            num_layers=8,
            num_heads=16,
            num_kv_heads=4,
            intermediate_size=2816,
        )
    )
    model = build_tiny_model(**shape, seed=0)
    return Trainer(model, build_byte_tokenizer(), None, settings=None, version=1)


def main() -> None:
    import multiprocessing as mp
    import time

    import torch

    from replayrl.engine.resources import host_snapshot
    from replayrl.policy.weight_broadcast import Sender

    args = parse_args(__doc__.splitlines()[0])
    trainer = build(args.quick)
    bf16 = host_snapshot(trainer.model, torch.bfloat16)
    sender = Sender(members=RECEIVERS, timeout_s=TIMEOUT_S, bucket_bytes=BUCKET_BYTES)
    ctx = mp.get_context("spawn")
    seen, stop = ctx.Queue(), ctx.Event()
    receivers = [
        ctx.Process(target=_receiver, args=(m, sender.address, seen, stop), daemon=True)
        for m in range(RECEIVERS)
    ]
    for p in receivers:
        p.start()
    try:
        deadline = time.monotonic() + 300
        # Both have asked to join generation 0, so the first send forms the group with both.
        while len(sender._wanting(0)) < RECEIVERS:
            if time.monotonic() > deadline or not all(p.is_alive() for p in receivers):
                raise RuntimeError("the receiver processes did not ask to join the weight group")
            time.sleep(0.05)
        figures, ratios = measure(args, trainer, bf16, sender, seen)
    finally:
        sender.close()
        stop.set()
        for p in receivers:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    targets = {
        "bf16_over_float32_bytes": "<= 0.51",
        "trainer_wait_over_float32_sync": "<= 0.2",
        "bf16_background_total_over_float32_sync": "<= 0.8",
    }
    report("publication", args=args, figures=figures, ratios=ratios, targets=targets)


def measure(args, trainer, bf16, sender, seen) -> tuple[dict, dict]:
    """The interleaved rounds of every candidate; (figures, ratios)."""
    import os
    import queue
    import time

    import torch
    from safetensors.torch import save_file

    from bench._s3 import s3_server
    from replayrl import storage

    repeats = args.repeats or (2 if args.quick else 5)
    params = sum(p.numel() for p in trainer.model.parameters())
    with s3_server() as s3, tempfile.TemporaryDirectory(prefix="bench-publication-") as tmp:
        os.environ.update(s3.env())
        os.environ["REPLAYRL_CACHE"] = f"{tmp}/scratch"  # checkpoint staging: `temp_root`
        root = f"s3://{s3.bucket}/bench-publication"
        counter = iter(range(1, 10_000))
        returned: list[float] = []
        deliveries = []

        def bare() -> None:
            save_file(bf16, f"{tmp}/bare.safetensors")

        def float32_sync() -> None:
            trainer.save(f"{root}/f32/v{next(counter):06d}", weights_only=True, dtype=torch.float32)

        def bf16_background() -> None:
            start = time.perf_counter()
            uri = f"{root}/bf16/v{next(counter):06d}"
            publication = trainer.save(
                uri, weights_only=True, background=True, dtype=torch.bfloat16
            )
            returned.append(time.perf_counter() - start)
            publication.wait()

        def broadcast() -> None:
            version = next(counter)
            delivery = sender.send(version, trainer.named_weights(), token=str(version))
            if not delivery.complete or delivery.acked != tuple(range(RECEIVERS)):
                raise RuntimeError(f"broadcast of v{version} did not reach both: {delivery}")
            deliveries.append(delivery)

        times = interleaved(
            {
                "bare": bare,
                "float32_sync": float32_sync,
                "bf16_background": bf16_background,
                "broadcast": broadcast,
            },
            repeats=repeats,
        )
        returned = returned[-repeats:]  # the timed rounds (the warm-up came first)
        timed = deliveries[-repeats:]
        waits = [d.seconds for d in timed]
        # Each receiver stages a version before it acks, so by now both have put every one.
        received: dict[int, list[float]] = {}
        while sum(len(v) for v in received.values()) < RECEIVERS * len(deliveries):
            try:
                _member, version, seconds = seen.get(timeout=60)
            except queue.Empty:
                raise RuntimeError("a receiver did not report a version it acked") from None
            received.setdefault(version, []).append(seconds)
        receive_s = [max(received[d.version]) for d in timed]
        f32_uri = f"{root}/f32/v{next(counter):06d}"
        bf16_uri = f"{root}/bf16/v{next(counter):06d}"
        trainer.save(f32_uri, weights_only=True, dtype=torch.float32)
        trainer.save(bf16_uri, weights_only=True, dtype=torch.bfloat16)
        sizes = {}
        for name, uri in (("float32", f32_uri), ("bf16", bf16_uri)):
            files = storage.read_manifest(uri).files
            sizes[name] = sum(f.size for n, f in files.items() if n.endswith(".safetensors"))
    figures = {
        "params": params,
        "float32_weight_bytes": sizes["float32"],
        "bf16_weight_bytes": sizes["bf16"],
        "bare_s": median(times["bare"]),
        "float32_sync_s": median(times["float32_sync"]),
        "bf16_background_return_s": median(returned),
        "bf16_background_total_s": median(times["bf16_background"]),
        "broadcast_s": median(waits),
        "broadcast_receive_s": median(receive_s),
        "broadcast_bytes": timed[-1].bytes,
        "broadcast_receivers": RECEIVERS,
        "broadcast_backend": "gloo (CPU, loopback)",
        "repeats": repeats,
    }
    ratios = {
        "bf16_over_float32_bytes": sizes["bf16"] / sizes["float32"],
        "trainer_wait_over_bare": paired_ratio(returned, times["bare"]),
        "trainer_wait_over_float32_sync": paired_ratio(returned, times["float32_sync"]),
        "bf16_background_total_over_float32_sync": paired_ratio(
            times["bf16_background"], times["float32_sync"]
        ),
        "broadcast_over_bare": paired_ratio(waits, times["bare"]),
        "broadcast_over_float32_sync": paired_ratio(waits, times["float32_sync"]),
    }
    return figures, ratios


if __name__ == "__main__":
    main()
