"""One publication of a policy's weights (issue 38 item 2): what the trainer waits for, and
how long until the copy is complete on S3 (a SeaweedFS server on loopback).

Candidates, interleaved, each publishing a fresh version of the same model:

- bare: `safetensors.torch.save_file` of the bf16 weights to a local file, the floor of
  writing those bytes at all (no upload, no hashing, no marker);
- float32_sync: `Trainer.save(uri, weights_only=True, dtype=float32)`, the publication as it
  was: float32 files written, uploaded and marked complete before it returns;
- bf16_background: `Trainer.save(uri, weights_only=True, background=True, dtype=bfloat16)`:
  `_return` is what the trainer waits for (the host snapshot), `_total` until `wait()` finds
  the copy complete and every file hashed.

Ratios: the trainer's wait against the bare write and against the float32 publication, and
the background publication's whole time against the float32 one. The model is a Qwen2 built
in code (random weights; nothing downloaded): ~0.14 B parameters, or the tiny model with
`--quick`. On the CPU a host snapshot is a copy in memory; on a GPU it is a pinned
device-to-host copy (not measured here).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import interleaved, median, paired_ratio, parse_args, report  # noqa: E402


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
    import os
    import time

    import torch
    from safetensors.torch import save_file

    from bench._s3 import s3_server
    from replayrl import storage
    from replayrl.engine.resources import host_snapshot

    args = parse_args(__doc__.splitlines()[0])
    repeats = args.repeats or (2 if args.quick else 5)
    trainer = build(args.quick)
    params = sum(p.numel() for p in trainer.model.parameters())
    bf16 = host_snapshot(trainer.model, torch.bfloat16)
    with s3_server() as s3, tempfile.TemporaryDirectory(prefix="bench-publication-") as tmp:
        os.environ.update(s3.env())
        os.environ["REPLAYRL_CACHE"] = f"{tmp}/scratch"  # checkpoint staging: `temp_root`
        root = f"s3://{s3.bucket}/bench-publication"
        counter = iter(range(1, 10_000))
        returned: list[float] = []

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

        times = interleaved(
            {"bare": bare, "float32_sync": float32_sync, "bf16_background": bf16_background},
            repeats=repeats,
        )
        returned = returned[-repeats:]  # the timed rounds (the warm-up came first)
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
        "repeats": repeats,
    }
    ratios = {
        "bf16_over_float32_bytes": sizes["bf16"] / sizes["float32"],
        "trainer_wait_over_bare": paired_ratio(returned, times["bare"]),
        "trainer_wait_over_float32_sync": paired_ratio(returned, times["float32_sync"]),
        "bf16_background_total_over_float32_sync": paired_ratio(
            times["bf16_background"], times["float32_sync"]
        ),
    }
    targets = {
        "bf16_over_float32_bytes": "<= 0.51",
        "trainer_wait_over_float32_sync": "<= 0.2",
        "bf16_background_total_over_float32_sync": "<= 0.8",
    }
    report("publication", args=args, figures=figures, ratios=ratios, targets=targets)


if __name__ == "__main__":
    main()
