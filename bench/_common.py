"""Shared plumbing for the benchmarks: argument parsing, interleaved timing, the machine
description and the JSON result each script prints and writes to `bench/results/<name>.json`.

Every benchmark compares the library against the best a bare library call does on the same
data in the same run, measured interleaved (baseline, subject, baseline, ...) and reported
as medians, so the ratios hold on a shared, noisy machine. This module knows nothing about
what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
DATA_DIR = BENCH_DIR / ".data"  # cached inputs (the 1M-row table); git-ignored


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, a smoke test (seconds, not minutes)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats")
    parser.add_argument(
        "--no-write", action="store_true", help="print the JSON only; leave bench/results alone"
    )
    return parser.parse_args()


def machine() -> dict[str, object]:
    """What the figures were measured on (no hostname)."""
    import deltalake
    import pyarrow
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deltalake": deltalake.__version__,
        "pyarrow": pyarrow.__version__,
    }


def interleaved(
    fns: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each function, called in turn (a, b, a, b, ...) `repeats` times
    after `warmup` untimed rounds, so machine noise hits every candidate alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median of the per-round ratios: each pair ran back to back, under the same noise."""
    return float(statistics.median(n / d for n, d in zip(numerator, denominator, strict=True)))


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MiB: VmHWM of /proc/self/status.
    Not getrusage's ru_maxrss: Linux carries that over exec, so a child started from a big
    parent would report the parent's peak."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def report(
    name: str, *, args: argparse.Namespace, figures: dict, ratios: dict, targets: dict
) -> dict:
    """Print the result as one JSON object and write it to bench/results/<name>.json.

    `ratios` maps a ratio's name to its value; `targets` maps the same name to a string
    such as ">= 0.75"; `met` says for each whether the value meets its target.
    """
    met = {}
    for key, target in targets.items():
        op, bound = target.split()
        value = ratios.get(key, figures.get(key))
        met[key] = (
            None
            if value is None
            else (value >= float(bound) if op == ">=" else value <= float(bound))
        )
    result = {
        "bench": name,
        "quick": bool(args.quick),
        "ratios": ratios,
        "targets": targets,
        "met": met,
        "figures": figures,
        "machine": machine(),
        "argv": sys.argv[1:],
    }
    text = json.dumps(result, indent=2, sort_keys=False)
    print(text, flush=True)
    if not args.no_write and not args.quick:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        tmp = RESULTS_DIR / f"{name}.json.tmp"
        tmp.write_text(text + "\n")
        tmp.replace(RESULTS_DIR / f"{name}.json")
    return result
