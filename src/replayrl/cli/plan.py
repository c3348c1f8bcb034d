"""`replayrl plan`: the GPU memory a config needs, per GPU, and whether it fits; with
asynchronous workers, what one publication of the weights costs on each path (`weight sync:`).

replayrl plan --config FILE [--gpus N] [--gpu-memory 80GiB] [--set key=value ...] [--json]

Nothing is downloaded: the model's shape comes from a local checkpoint, the tiny model's
config or the published shapes of the models the presets name (`--model-config` for any
other). Exits 0 when the plan fits, 1 when it does not (the table says where), 2 on bad input.
"""

from __future__ import annotations

import argparse
import re
import sys

from replayrl.cli.args import number, one_line_errors
from replayrl.errors import ReplayRLError

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "gi": 2**30, "g": 2**30}


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920; '80GB' -> 80e9; '141g' and '141Gi' are GiB."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ReplayRLError(f"--gpu-memory must be a size such as 80GiB or 141GB, got {text!r}.")
    return int(float(match.group(1)) * _UNITS[unit])


def render(p) -> str:
    """The plan as a table for people."""
    from replayrl.policy.memory_plan import USABLE_SHARE, GiB

    gib = GiB
    lines = [
        f"model: {p.model.name} ({p.model.num_params:,} parameters, {p.model.num_layers} layers, "
        f"hidden {p.model.hidden_size}, vocabulary {p.model.vocab_size:,})",
        f"layout: {p.layout}",
        f"hardware: {p.gpus} GPU(s) x {p.gpu_bytes / gib:.0f} GiB, of which "
        f"{USABLE_SHARE:.0%} usable; micro-batch {p.micro_batch_tokens:,} tokens",
    ]
    for gpu in p.per_gpu:
        lines.append("")
        lines.append(f"{gpu.role} (x{gpu.count})")
        for phase, items in gpu.phases.items():
            lines.append(f"  {phase}:")
            for item in items:
                lines.append(f"    {item.name:<22}{item.bytes / gib:>9.2f} GiB  {item.note}")
            used = gpu.peak(phase)
            mark = "fits" if used <= gpu.capacity_bytes else "DOES NOT FIT"
            lines.append(
                f"    {'total':<22}{used / gib:>9.2f} GiB  of {gpu.capacity_bytes / gib:.1f}: {mark}"
            )
    lines.append("")
    if p.weight_sync is not None:
        lines.append(p.weight_sync.line())
        if warning := p.weight_sync.warning():
            lines.append(f"warning: {warning}")
    for w in p.warnings:
        lines.append(f"note: {w}")
    if p.fits:
        lines.append("FITS")
    else:
        lines += [f"does not fit: {why}" for why in p.problems]
    return "\n".join(lines) + "\n"


def _plan(args: argparse.Namespace) -> int:
    from replayrl.config import load_config
    from replayrl.policy.memory_plan import model_shape, plan

    cfg = load_config(args.config, overrides=list(args.set or []))
    shape = model_shape(cfg, model_config=args.model_config)
    if args.gpus is not None and args.gpus < 1:
        raise ReplayRLError(f"--gpus must be at least 1, got {args.gpus}.")
    p = plan(
        cfg,
        gpus=args.gpus,
        gpu_bytes=parse_bytes(args.gpu_memory),
        prompt_tokens=args.prompt_tokens,
        shape=shape,
    )
    sys.stdout.write(p.to_json() + "\n" if args.json else render(p))
    return 0 if p.fits else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`replayrl plan`."""
    parser = one_line_errors(
        sub.add_parser("plan", help="GPU memory per GPU for a config, and whether it fits")
    )
    parser.add_argument("--config", required=True, help="YAML config (e.g. configs/...yaml)")
    parser.add_argument(
        "--gpus",
        type=number(int, "[1, inf)"),
        help="GPUs available (default: what the layout uses)",
    )
    parser.add_argument("--gpu-memory", default="80GiB", help="memory per GPU (default 80GiB)")
    parser.add_argument(
        "--prompt-tokens",
        type=number(int, "[1, inf)"),
        help="prompt tokens per sequence (default 512; tiny: 16)",
    )
    parser.add_argument("--model-config", help="a config.json (or its folder) for the model shape")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=_plan)
