"""Sampling cost and memory: `ReplayBuffer.sample` of 4,096 rows from a 1M-row and a
100k-row buffer (local disk), against the best bare pyarrow does for the same uniform
draw (read the columns of every row, then `take` the drawn rows). Every read is of the
columns the trainer reads (`replayrl.engine.steps.TRAIN_COLUMNS`), as `steps.train` samples them.

The long-lived reader, `replayrl.buffer.mirror.BufferMirror`, on copies of the same two
buffers: the same 4,096-row draw from memory after one full sync, and the cost of syncing
one appended iteration (2,048 rows) into the 1M-row and the 100k-row buffer, which should
not depend on the buffer's size. The appends go to copies of the tables in a temporary
folder, so the cached buffers stay as they are.

The buffers are cached under bench/.data/ (built once, ~20 s for 1M rows). Memory is
measured in separate processes: the peak RSS of one `sample` from the big buffer, of
opening it without sampling (the import baseline), and of reading the whole table.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

from bench._common import interleaved, median, paired_ratio, parse_args, report  # noqa: E402
from bench._rows import cached_buffer, rollout_rows  # noqa: E402
from replayrl.buffer.mirror import BufferMirror  # noqa: E402
from replayrl.buffer.table import ReplayBuffer  # noqa: E402
from replayrl.engine.steps import TRAIN_COLUMNS  # noqa: E402

ROWS_PER_ITERATION = 2048  # 256 prompts x 8 samples per iteration
DRAW = 4096

_CHILD = """
import json, sys
sys.path.insert(0, {repo!r})
from bench._common import peak_rss_mb
from bench._rows import cached_buffer
buf = cached_buffer(rows={rows}, rows_per_iteration={rpi})
version = buf.version()
what = {what!r}
if what == "sample":
    out = buf.sample(version=version, batch_size={draw}, num_batches=1, seed=0, columns={columns!r})
    assert out[0].num_rows == {draw}
elif what == "full":
    from deltalake import DeltaTable
    table = DeltaTable(buf.rollouts_uri).to_pyarrow_dataset().to_table(columns={columns!r})
    print(json.dumps({{"table_mb": table.nbytes / 2**20}}))
print(json.dumps({{"peak_rss_mb": peak_rss_mb()}}), flush=True)
# Skip the interpreter's teardown: pyarrow's dataset threads, still joinable there, now and
# then abort the process ("terminate called without an active exception") after its work is
# done and printed.
import os
os._exit(0)
"""


def child(what: str, *, rows: int) -> dict:
    code = _CHILD.format(
        repo=str(Path(__file__).resolve().parents[1]),
        rows=rows,
        rpi=ROWS_PER_ITERATION,
        what=what,
        draw=DRAW,
        columns=TRAIN_COLUMNS,
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    out: dict = {}
    for line in done.stdout.splitlines():
        out |= json.loads(line)
    return out


def bare_sampler(buf, seed_box: list[int]):
    """Uniform draw with bare pyarrow: every row's columns read, then the drawn rows taken."""
    from deltalake import DeltaTable

    def draw():
        table = DeltaTable(buf.rollouts_uri).to_pyarrow_dataset().to_table(columns=TRAIN_COLUMNS)
        rng = np.random.default_rng(seed_box[0])
        return table.take(pa.array(rng.choice(table.num_rows, size=DRAW, replace=False)))

    return draw


def mirror_figures(buffers: dict[str, ReplayBuffer], *, repeats: int) -> dict:
    """Per buffer: the first (full) sync of a mirror of a copy of it, the median
    `mirror.sample` of DRAW rows after it, and the syncs of one appended iteration each
    (appended to the copy, alternating between the buffers so noise hits both alike)."""
    out: dict = {"sample": {}, "sync_append": {name: [] for name in buffers}}
    with tempfile.TemporaryDirectory(prefix="bench-mirror-") as tmp:
        copies, mirrors, next_iteration = {}, {}, {}
        for name, buf in buffers.items():
            shutil.copytree(buf.rollouts_uri, f"{tmp}/{name}/rollouts")
            copies[name] = ReplayBuffer(f"{tmp}/{name}")
            mirrors[name] = BufferMirror(copies[name], columns=TRAIN_COLUMNS)
            report = mirrors[name].sync()
            out[f"first_sync_{name}_s"] = report.seconds
            out[f"rows_{name}"] = report.rows
            last = pc.max(copies[name].read(columns=["iteration"]).column("iteration"))
            next_iteration[name] = last.as_py() + 1  # appends past the last iteration
        seed = [0]

        def sampler(name: str):
            mirror = mirrors[name]

            def call():
                seed[0] += 1
                return mirror.sample(
                    version=mirror.version,
                    batch_size=DRAW,
                    num_batches=1,
                    seed=seed[0],
                    columns=TRAIN_COLUMNS,
                )

            return call

        out["sample"] = interleaved(
            {name: sampler(name) for name in buffers}, repeats=max(5, 4 * repeats), warmup=2
        )
        for round_ in range(1 + 4 * repeats):  # the first round is a warm-up
            for name in buffers:
                it = next_iteration[name]
                rows = rollout_rows(
                    first_iteration=it,
                    iterations=1,
                    rows_per_iteration=ROWS_PER_ITERATION,
                    seed=10_000 + it,
                )
                copies[name].append(rows, iteration=it)
                next_iteration[name] = it + 1
                start = time.perf_counter()
                report = mirrors[name].sync()
                seconds = time.perf_counter() - start
                assert (report.rows_decoded, report.rows_dropped) == (ROWS_PER_ITERATION, 0)
                if round_:
                    out["sync_append"][name].append(seconds)
    return out


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    big_rows, small_rows = (40_000, 4_096) if args.quick else (1_000_000, 100_000)
    repeats = args.repeats or (2 if args.quick else 5)
    big = cached_buffer(rows=big_rows, rows_per_iteration=ROWS_PER_ITERATION)
    small = cached_buffer(rows=small_rows, rows_per_iteration=ROWS_PER_ITERATION)
    versions = {id(big): big.version(), id(small): small.version()}
    seed = [0]

    def subject(buf):
        def call():
            seed[0] += 1
            return buf.sample(
                version=versions[id(buf)],
                batch_size=DRAW,
                num_batches=1,
                seed=seed[0],
                columns=TRAIN_COLUMNS,
            )

        return call

    times = interleaved(
        {
            "sample_small": subject(small),
            "sample_big": subject(big),
            "bare_small": bare_sampler(small, seed),
            "bare_big": bare_sampler(big, seed),
        },
        repeats=repeats,
        warmup=1,
    )
    mem = {what: child(what, rows=big_rows) for what in ("open", "sample", "full")}
    mirror = mirror_figures({"big": big, "small": small}, repeats=repeats)
    mirror_sample = mirror["sample"]
    mirror_sync = mirror["sync_append"]
    extra_mb = mem["sample"]["peak_rss_mb"] - mem["open"]["peak_rss_mb"]
    full_extra_mb = mem["full"]["peak_rss_mb"] - mem["open"]["peak_rss_mb"]
    figures = {
        "rows_big": big_rows,
        "rows_small": small_rows,
        "draw_rows": DRAW,
        "sample_big_ms": 1e3 * median(times["sample_big"]),
        "sample_small_ms": 1e3 * median(times["sample_small"]),
        "bare_big_ms": 1e3 * median(times["bare_big"]),
        "bare_small_ms": 1e3 * median(times["bare_small"]),
        "peak_rss_open_mb": mem["open"]["peak_rss_mb"],
        "peak_rss_sample_big_mb": mem["sample"]["peak_rss_mb"],
        "peak_rss_full_read_big_mb": mem["full"]["peak_rss_mb"],
        "table_big_in_memory_mb": mem["full"]["table_mb"],
        # BufferMirror, on copies of the same buffers.
        "mirror_first_sync_big_s": mirror["first_sync_big_s"],
        "mirror_first_sync_small_s": mirror["first_sync_small_s"],
        "mirror_sample_big_ms": 1e3 * median(mirror_sample["big"]),
        "mirror_sample_small_ms": 1e3 * median(mirror_sample["small"]),
        "mirror_sample_repeats": len(mirror_sample["big"]),
        "mirror_sync_append_rows": ROWS_PER_ITERATION,
        "mirror_sync_append_big_ms": 1e3 * median(mirror_sync["big"]),
        "mirror_sync_append_small_ms": 1e3 * median(mirror_sync["small"]),
        "mirror_sync_append_repeats": len(mirror_sync["big"]),
    }
    ratios = {
        "sample_big_over_small": paired_ratio(times["sample_big"], times["sample_small"]),
        "sample_big_ms": figures["sample_big_ms"],
        "sample_big_over_bare_big": paired_ratio(times["sample_big"], times["bare_big"]),
        # Peak RSS that sampling adds on top of opening the buffer, against what reading the
        # whole table (the same columns) adds, both measured the same way in this run: a
        # sampler that held the whole table would be at ~1.
        "sample_extra_rss_over_full_read": extra_mb / full_extra_mb,
        # The same, per MiB of those columns' in-memory size (no target: the peak includes
        # decode buffers and allocator retention, not only data held).
        "sample_extra_rss_over_table": extra_mb / mem["full"]["table_mb"],
        # The long-lived reader: a draw from memory, and a sync of one appended iteration
        # whose cost must not grow with the buffer (medians of alternating rounds).
        "mirror_sample_big_ms": figures["mirror_sample_big_ms"],
        "mirror_sample_big_over_small": paired_ratio(mirror_sample["big"], mirror_sample["small"]),
        "mirror_sync_append_big_over_small": paired_ratio(mirror_sync["big"], mirror_sync["small"]),
    }
    targets = {
        "sample_big_over_small": "<= 2",
        "sample_big_ms": "<= 50",
        "sample_extra_rss_over_full_read": "<= 0.5",
        "mirror_sample_big_ms": "<= 50",
        "mirror_sync_append_big_over_small": "<= 1.5",
    }
    report("sampling", args=args, figures=figures, ratios=ratios, targets=targets)


if __name__ == "__main__":
    main()
