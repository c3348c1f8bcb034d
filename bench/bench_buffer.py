"""Buffer writes against bare pyarrow: `ReplayBuffer.append` throughput vs a bare
`pyarrow.parquet.write_table` of the same rows to the same store (local disk and a SeaweedFS
S3 server), and `ReplayBuffer.compact`'s bin-pack vs a bare read-and-rewrite of the same files.

Append: one iteration of rows per call into a growing table (the loop's pattern), the bare
baseline writing one Parquet file per call into the same kind of location. Compaction: a
table of many small files (one per iteration) bin-packed into one, with retention keeping
every row and no vacuum, against `pq.read_table` of those files + one `pq.write_table`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from bench._common import interleaved, median, paired_ratio, parse_args, report  # noqa: E402
from bench._rows import rollout_rows  # noqa: E402
from replayrl import storage  # noqa: E402
from replayrl.buffer.table import ReplayBuffer  # noqa: E402


def append_pair(*, root: str, filesystem, base: str, rows_per_append: int, storage_options):
    """(buffer append, bare write) callables; each call writes the next iteration's rows."""
    buf = ReplayBuffer(root, storage_options=storage_options)
    batches = [
        rollout_rows(first_iteration=i, iterations=1, rows_per_iteration=rows_per_append, seed=i)
        for i in range(8)
    ]
    state = {"buffer": 0, "bare": 0}

    def subject():
        i = state["buffer"]
        rows = batches[i % len(batches)]
        rows = rows.set_column(2, "iteration", pa.array([i] * rows.num_rows, pa.int64()))
        buf.append(rows, iteration=i)
        state["buffer"] += 1

    def bare():
        i = state["bare"]
        pq.write_table(
            batches[i % len(batches)], f"{base}/part-{i:05d}.parquet", filesystem=filesystem
        )
        state["bare"] += 1

    return subject, bare


def bench_append(*, where: str, repeats: int, rows_per_append: int, s3=None) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-append-") as tmp:
        if s3 is None:
            root, bare_root = f"{tmp}/buffer", f"{tmp}/bare"
            os.makedirs(bare_root)
        else:
            # The library's own clients, configured from the standard AWS variables.
            os.environ.update(s3.env())
            prefix = f"s3://{s3.bucket}/bench-{uuid.uuid4().hex[:8]}"
            root, bare_root = f"{prefix}/buffer", f"{prefix}/bare"
        options = storage.delta_storage_options(root)
        filesystem, base = storage.filesystem(bare_root)
        subject, bare = append_pair(
            root=root,
            filesystem=filesystem,
            base=base,
            rows_per_append=rows_per_append,
            storage_options=options,
        )
        times = interleaved({"bare": bare, "buffer": subject}, repeats=repeats, warmup=2)
    return {
        f"append_{where}_rows_per_call": rows_per_append,
        f"append_{where}_buffer_rows_per_s": rows_per_append / median(times["buffer"]),
        f"append_{where}_bare_rows_per_s": rows_per_append / median(times["bare"]),
        f"append_{where}_buffer_ms": 1e3 * median(times["buffer"]),
        f"append_{where}_bare_ms": 1e3 * median(times["bare"]),
        # throughput ratio = bare seconds / buffer seconds, per back-to-back pair
        f"append_{where}_ratio": paired_ratio(times["bare"], times["buffer"]),
    }


def bench_compaction(*, repeats: int, files: int, rows_per_file: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-compact-") as tmp:
        template = ReplayBuffer(f"{tmp}/template")
        for i in range(files):
            template.append(
                rollout_rows(
                    first_iteration=i, iterations=1, rows_per_iteration=rows_per_file, seed=i
                ),
                iteration=i,
            )
        copies = iter(range(10**6))

        def fresh() -> str:
            path = f"{tmp}/copy-{next(copies)}"
            shutil.copytree(f"{tmp}/template", path)
            return path

        # Copies are made before the timed calls, so copying is never timed.
        pending = {
            "buffer": [fresh() for _ in range(repeats + 1)],
            "bare": [fresh() for _ in range(repeats + 1)],
        }

        def subject():
            ReplayBuffer(pending["buffer"].pop()).compact(
                capacity=10**9,
                current_policy_version=files,
                min_files_to_compact=2,
                vacuum_grace_s=3600.0,
            )

        def bare():
            table_dir = Path(pending["bare"].pop()) / "rollouts"
            paths = sorted(str(p) for p in table_dir.glob("*.parquet"))
            table = pq.read_table(paths)
            pq.write_table(table, str(table_dir / "packed.parquet"))

        times = interleaved({"bare": bare, "buffer": subject}, repeats=repeats, warmup=1)
    rows = files * rows_per_file
    return {
        "compact_files": files,
        "compact_rows": rows,
        "compact_buffer_rows_per_s": rows / median(times["buffer"]),
        "compact_bare_rows_per_s": rows / median(times["bare"]),
        "compact_ratio": paired_ratio(times["bare"], times["buffer"]),
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    repeats = args.repeats or (2 if args.quick else 9)
    rows_per_append = 256 if args.quick else 8192
    figures = bench_append(where="local", repeats=repeats, rows_per_append=rows_per_append)
    from bench._s3 import s3_server

    with s3_server() as s3:
        figures |= bench_append(where="s3", repeats=repeats, rows_per_append=rows_per_append, s3=s3)
    figures |= bench_compaction(
        repeats=max(2, repeats // 3),
        files=8 if args.quick else 64,
        rows_per_file=256 if args.quick else 2048,
    )
    ratios = {k: figures.pop(k) for k in ("append_local_ratio", "append_s3_ratio", "compact_ratio")}
    targets = {
        "append_local_ratio": ">= 0.75",
        "append_s3_ratio": ">= 0.75",
        "compact_ratio": ">= 0.5",
    }
    report("buffer", args=args, figures=figures, ratios=ratios, targets=targets)


if __name__ == "__main__":
    main()
