"""Peak memory and wall time of one iteration at Qwen2.5's vocabulary size: `replayrl run
--config configs/shapes-cpu.yaml --iterations 1` under `/usr/bin/time -v`.

The run is one fresh process: a fresh REPLAYRL_CACHE and run root in a temporary directory
(so v0 is built, not found), MLFLOW_TRACKING_URI unset (local sqlite tracking under the
run root), this checkout's `src` first on PYTHONPATH. Its address space is capped
(`--max-vm-gib`, default 8): a run that tries to hold the unchunked float32 logits of a
training batch (~20 GB) fails with an allocation error instead of taking the machine's
memory from everyone on it. Reported: the peak RSS ("Maximum resident set size"), the wall
time and exit status (from `/usr/bin/time`), and each part of the iteration's wall clock
as the run's compute ledger recorded it (generation, training, evaluation, startup, ...),
read back from its MLflow store. Target: peak RSS <= 4 GiB, and the run finishes.

`--set KEY=VALUE` passes overrides to the run (e.g. `--set rollout.max_new_tokens=64` to see
generation's share); such a result is printed, not written to bench/results/.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import report  # noqa: E402

PRESET = REPO / "configs" / "shapes-cpu.yaml"
TIME_BIN = "/usr/bin/time"
# Fewer generated tokens: the same vocabulary and batch, a smoke test of the whole path.
QUICK_OVERRIDES = ["rollout.max_new_tokens=8"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke test: {' '.join(QUICK_OVERRIDES)}"
    )
    parser.add_argument(
        "--no-write", action="store_true", help="print the JSON only; leave bench/results alone"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override for the run"
    )
    parser.add_argument(
        "--max-vm-gib", type=float, default=8.0, help="address-space cap of the run (GiB)"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before it is killed")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    if args.set:
        args.no_write = True  # not the preset: bench/results holds the preset's figures only
    return args


def parse_time_v(text: str) -> dict[str, float]:
    """The figures of GNU time's `-v` report this bench uses.

    Example lines: "Maximum resident set size (kbytes): 3306908",
    "Elapsed (wall clock) time (h:mm:ss or m:ss): 1:29.36", "Exit status: 0".
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        key, _, value = line.strip().rpartition(": ")
        if key == "Maximum resident set size (kbytes)":
            out["peak_rss_kib"] = float(value)
        elif key.startswith("Elapsed (wall clock) time"):
            seconds = 0.0
            for part in value.split(":"):  # [h:]m:ss.ss
                seconds = 60 * seconds + float(part)
            out["wall_s"] = seconds
        elif key in ("User time (seconds)", "System time (seconds)"):
            out["user_s" if key.startswith("User") else "system_s"] = float(value)
        elif key == "Exit status":
            out["exit_status"] = float(value)
    if "peak_rss_kib" not in out:
        raise RuntimeError(f"no 'Maximum resident set size' in the time -v report:\n{text}")
    return out


def ledger(run_root: Path) -> dict[str, float]:
    """The iteration's `ledger/*` metrics from the run's local MLflow store (empty when the
    run died before it recorded one)."""
    db = run_root / "mlflow.db"
    if not db.exists():
        return {}
    with sqlite3.connect(db) as conn:
        try:
            rows = conn.execute(
                "SELECT key, value FROM metrics WHERE key LIKE 'ledger/%' ORDER BY step"
            ).fetchall()
        except sqlite3.Error:
            return {}
    return {key.removeprefix("ledger/"): value for key, value in rows}


def run_once(args: argparse.Namespace, overrides: list[str], tmp: Path) -> dict:
    run_root, report_file = tmp / "runs", tmp / "time.txt"
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env["REPLAYRL_CACHE"] = str(tmp / "cache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    cmd = [TIME_BIN, "-v", "-o", str(report_file), sys.executable, "-m", "replayrl.cli.main", "run"]
    cmd += ["--config", str(PRESET), "--iterations", "1", "--run-root", str(run_root)]
    for item in overrides:
        cmd += ["--set", item]
    cap = int(args.max_vm_gib * 2**30)

    def limit() -> None:  # in the child, before exec: inherited by the run
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    start = time.perf_counter()
    with open(tmp / "run.log", "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=limit, start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=args.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's own process group only
            proc.wait()
            timed_out = True
    wall = time.perf_counter() - start
    log_tail = (tmp / "run.log").read_text(errors="replace").splitlines()[-15:]
    if not report_file.exists():
        raise RuntimeError("no time -v report; the run's log ends:\n" + "\n".join(log_tail))
    timing = parse_time_v(report_file.read_text())
    if timed_out:
        timing["exit_status"] = -1.0
    return {"timing": timing, "wall": wall, "ledger": ledger(run_root), "log_tail": log_tail}


def main() -> None:
    args = parse_args()
    if not Path(TIME_BIN).exists():
        sys.exit(f"{TIME_BIN} is missing (GNU time); install it (apt-get install time).")
    overrides = (QUICK_OVERRIDES if args.quick else []) + args.set
    tmp = Path(tempfile.mkdtemp(prefix="bench-shapes-"))
    try:
        result = run_once(args, overrides, tmp)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    timing, parts = result["timing"], result["ledger"]
    ok = timing["exit_status"] == 0
    peak_gib = timing["peak_rss_kib"] / 2**20
    seconds = {
        key.removesuffix("_seconds"): round(value, 2)
        for key, value in parts.items()
        if key.endswith("_seconds") and not key.endswith("per_rollout_seconds")
    }
    generated = parts.get("generated_tokens", 0.0)
    trained = generated + parts.get("prompt_tokens", 0.0)  # S·B = R here: every row once
    figures = {
        "overrides": overrides,
        "max_vm_gib": args.max_vm_gib,
        "exit_status": int(timing["exit_status"]),
        # The target is about a finished run: a run that died has no peak to meet it with.
        "peak_rss_gib": round(peak_gib, 3) if ok else None,
        "peak_rss_gib_until_exit": round(peak_gib, 3),
        "wall_s": round(timing["wall_s"], 1),
        "user_s": timing.get("user_s"),
        "system_s": timing.get("system_s"),
        "ledger_seconds": seconds,
        "generated_tokens": generated,
        "generation_tokens_per_s": (
            round(generated / parts["generation_seconds"], 1)
            if parts.get("generation_seconds")
            else None
        ),
        "training_tokens_per_s": (
            round(trained / parts["training_seconds"], 1) if parts.get("training_seconds") else None
        ),
    }
    if not ok:
        figures["log_tail"] = result["log_tail"]
    targets = {"peak_rss_gib": "<= 4", "exit_status": "<= 0"}
    report("shapes", args=args, figures=figures, ratios={}, targets=targets)


if __name__ == "__main__":
    main()
