"""The trainer's state in a checkpoint, without pickles: optimizer state and RNG state.

A full checkpoint holds, next to the Hugging Face weights and tokenizer:

    optimizer.json                        param_groups (hyper-parameters, parameters by
                                          name) and each parameter's scalar state (`step`)
    optimizer.safetensors                 each parameter's tensor state (AdamW: `exp_avg`,
                                          `exp_avg_sq`) keyed "<parameter name>/<state key>",
                                          e.g. "model.layers.0.mlp.up_proj.weight/exp_avg";
                                          past `max_shard_size` it is split into
                                          optimizer-00001-of-0000N.safetensors plus
                                          optimizer.safetensors.index.json, as the weights are
    rng_state.safetensors, rng_state.json the torch (and CUDA) generator states as uint8
                                          tensors; numpy's and Python's `random` as JSON

Keyed by parameter name, not by the optimizer's parameter index, so the files say what
they hold and load into any optimizer over the same named parameters. Loading restores
the state bit for bit: the next step equals the step the saving process would have taken.
Checkpoints written before this format (`optimizer.pt`, `rng_state.pt`, torch.save
pickles) are still read, with `torch.load(weights_only=True)`; new ones never write them.
Every file name here starts with "optimizer" or "rng_state", which is how `storage` knows
to leave them out of weights-only copies. A file that does not parse (a damaged JSON, a
safetensors header, a pickle, an RNG state of the wrong size) is refused with one
ReplayRLError line that names it, before any RNG is set. Nothing here knows about storage
or models' layouts: it reads and writes files in a local directory (`storage.checkpoints`
has already checked their hashes).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from replayrl.errors import ReplayRLError

# The flat files a sharded trainer's optimizer state (torch.distributed.checkpoint) is
# written as, beside the weights.
DCP_PREFIX = "optimizer.dcp."
_DCP_METADATA = ".metadata"

OPTIMIZER_JSON = "optimizer.json"
OPTIMIZER_PATTERN = "optimizer{suffix}.safetensors"  # {suffix}: "" or "-00001-of-00002"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
RNG_TENSORS = "rng_state.safetensors"
RNG_JSON = "rng_state.json"
# Older checkpoints (torch.save pickles); read, never written.
LEGACY_OPTIMIZER_FILE = "optimizer.pt"
LEGACY_RNG_FILE = "rng_state.pt"
FORMAT = 1
# A tensor's key in the shards: "<parameter name>/<state key>". Module and state names
# never contain "/", so the key splits back unambiguously.
_SEP = "/"

# What reading a damaged file raises: a bad JSON value or shape, a safetensors header that
# does not parse, a pickle cut short, a tensor of the wrong kind handed to torch's RNG.
_DAMAGE = (
    OSError,
    ValueError,
    KeyError,
    TypeError,
    IndexError,
    AttributeError,
    RuntimeError,
    EOFError,
    pickle.UnpicklingError,
    SafetensorError,
)


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Turn what reading a damaged training-state file raises into one ReplayRLError line
    that names the file (checkpoints of format 2 have their hashes checked before this; an
    older one, or a file damaged in between, ends here)."""
    try:
        yield
    except _DAMAGE as e:
        raise ReplayRLError(
            f"Training state file '{path}' is unreadable or damaged "
            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}). Restore it from a copy, "
            f"or start a new --lineage from the checkpoint's weights with "
            f"--set model.source=<checkpoint> (fresh optimizer)."
        ) from None


@contextlib.contextmanager
def writing(directory: Path) -> Iterator[None]:
    """Turn what writing a policy's files fails with at the disk (a full disk, a quota, a
    read-only or vanished folder: safetensors' I/O SafetensorError, OSError) into one
    ReplayRLError line that names the folder. Nothing written here is visible before the
    caller publishes it (a checkpoint counts only once its COMPLETE marker is swapped in,
    and the publisher removes its own sub-folder when this raises), so the fix is to free
    the space and rerun. Any other SafetensorError is a bug and raises as it is."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        text = " ".join(str(e).split())
        if isinstance(e, SafetensorError) and "I/O error" not in text and "os error" not in text:
            raise
        raise ReplayRLError(
            f"Could not write the policy's files to '{directory}' ({text[:200]}). Nothing "
            f"was published: the lineage stays at its last commit. Free space on that disk, check "
            f"that the folder exists and is writable, and rerun the same command to resume."
        ) from None


# ---------------------------------------------------------------- optimizer


def save_training_state(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    directory: Path,
    *,
    max_shard_size: str | int,
) -> None:
    """Write `optimizer`'s state (its parameters named as in `model`) and this process's
    RNG states into `directory`, next to the weights."""
    write_optimizer_state(
        named_optimizer_state(optimizer, model), directory, max_shard_size=max_shard_size
    )
    write_rng_state(directory)


def load_training_state(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, directory: Path
) -> bool:
    """Load the optimizer state of the checkpoint in `directory` into `optimizer` (over
    `model`'s parameters, on their devices) and restore the RNG states saved with it;
    False when it has none (v0, or a weights-only copy). Reads the old `optimizer.pt`
    format too."""
    directory = Path(directory)
    devices = {n: p.device for n, p in model.named_parameters()}
    if has_dcp_optimizer(directory):
        load_named_state(optimizer, model, read_dcp_optimizer(optimizer, model, directory))
        restore_rng_state(directory)
        return True
    if (directory / OPTIMIZER_JSON).exists() or (directory / LEGACY_OPTIMIZER_FILE).exists():
        # The state allocated for a fresh start (`allocate_optimizer_state`) goes before the
        # saved one is read, so the device never holds both.
        optimizer.state.clear()
    named = read_optimizer_state(directory, device_of=lambda name: devices.get(name, "cpu"))
    if named is not None:
        load_named_state(optimizer, model, named)
    elif (directory / LEGACY_OPTIMIZER_FILE).exists():
        with _reading(directory / LEGACY_OPTIMIZER_FILE):
            legacy = torch.load(directory / LEGACY_OPTIMIZER_FILE, weights_only=True)
            optimizer.load_state_dict(legacy)
    else:
        return False
    restore_rng_state(directory)
    return True


def read_dcp_optimizer(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, directory: Path
) -> dict:
    """The whole name-keyed optimizer state a sharded trainer wrote with DCP (any number of
    ranks), read by this process alone into tensors shaped like `optimizer`'s own (its state
    allocated, `allocate_optimizer_state`)."""
    import torch.distributed.checkpoint as dcp

    named = named_optimizer_state(optimizer, model)
    if not named["state"]:
        raise ValueError("the optimizer's state must be allocated before a DCP load")
    with (
        _reading(directory / (DCP_PREFIX + "metadata")),
        dcp_folder(directory) as folder,
        warnings.catch_warnings(),
    ):
        # DCP warns that it reads without a process group: that is what is meant here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"optimizer": named}, checkpoint_id=folder, no_dist=True)
    return named


def named_optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    """`optimizer.state_dict()` with parameters named as in `model.named_parameters()`
    instead of numbered: {"state": {name: {key: value}}, "param_groups": [{..., "params":
    [name, ...]}]} (the full, name-keyed form torch.distributed.checkpoint also uses)."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ValueError(f"optimizer parameters {missing[:5]} are not parameters of the model")
    order = [names[id(p)] for p in params]  # state_dict's index i is params[i]
    sd = optimizer.state_dict()
    return {
        "state": {order[i]: value for i, value in sd["state"].items()},
        "param_groups": [
            {**group, "params": [order[i] for i in group["params"]]} for group in sd["param_groups"]
        ],
    }


def write_optimizer_state(named: dict, directory: Path, *, max_shard_size: str | int) -> None:
    """Write a name-keyed optimizer state (`named_optimizer_state`) into `directory`:
    tensors to safetensors shards of at most `max_shard_size` (e.g. "2GB"), the rest to
    optimizer.json. One shard at a time is copied to host memory."""
    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, state in named["state"].items():
        scalars[name] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[f"{name}{_SEP}{key}"] = value
            else:
                scalars[name][key] = _to_json(value)
    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern=OPTIMIZER_PATTERN, max_shard_size=max_shard_size
    )
    # A fresh optimizer has no tensors: still one (empty) file, so a reader can tell a
    # lost file from an empty state.
    shards = split.filename_to_tensors or {OPTIMIZER_PATTERN.format(suffix=""): []}
    for filename, keys in shards.items():
        shard = {k: tensors[k].detach().to("cpu").contiguous() for k in keys}
        save_file(shard, directory / filename, metadata={"format": "pt"})
        del shard
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / OPTIMIZER_INDEX).write_text(json.dumps(index, indent=1, sort_keys=True))
    groups = [{k: _to_json(v) for k, v in g.items()} for g in named["param_groups"]]
    meta = {"format": FORMAT, "param_groups": groups, "state": scalars}
    (directory / OPTIMIZER_JSON).write_text(json.dumps(meta, indent=1))


def read_optimizer_state(directory: Path, *, device_of=None) -> dict | None:
    """The name-keyed optimizer state in `directory` (the form `named_optimizer_state`
    returns), or None when it has none. `device_of(name)` says where a parameter's tensors
    go (default: the CPU); each is moved there as it is read, so the host never holds the
    whole state at once. Only the current format: `load_training_state` also reads the old."""
    directory = Path(directory)
    meta_path = directory / OPTIMIZER_JSON
    if not meta_path.exists():
        return None
    with _reading(meta_path):
        meta = json.loads(meta_path.read_text())
        groups, scalars = meta["param_groups"], meta["state"]
        fmt = meta.get("format")
    if fmt != FORMAT:
        raise ReplayRLError(
            f"Optimizer state '{meta_path}' has format {fmt!r}; this replayrl "
            f"reads format {FORMAT}. Resume with the replayrl version that wrote it."
        )
    with _reading(meta_path):
        state: dict[str, dict[str, Any]] = {
            name: {key: _from_json(v) for key, v in values.items()}
            for name, values in scalars.items()
        }
    for shard in _optimizer_shards(directory):
        with _reading(shard), safe_open(str(shard), framework="pt", device="cpu") as f:
            for key in f.keys():
                name, _, sub = key.rpartition(_SEP)
                target = "cpu" if device_of is None else device_of(name)
                # A copy the optimizer owns: get_tensor maps the file, and an untouched
                # page of a private map would change if the file were rewritten in place.
                state.setdefault(name, {})[sub] = f.get_tensor(key).to(target, copy=True)
    return {"state": state, "param_groups": groups}


def _optimizer_shards(directory: Path) -> list[Path]:
    """The shard files: those the index lists, else the one optimizer.safetensors."""
    index = directory / OPTIMIZER_INDEX
    if index.exists():
        with _reading(index):
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = [OPTIMIZER_PATTERN.format(suffix="")]
    lost = [n for n in names if not (directory / n).exists()]
    if lost:
        raise ReplayRLError(
            f"Checkpoint '{directory}' lacks its optimizer state file(s) {', '.join(lost)}. "
            f"Restore them, or start a new --lineage from its weights alone with "
            f"--set model.source=<checkpoint>."
        )
    return [directory / n for n in names]


def load_named_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module, named: dict):
    """Load a name-keyed optimizer state into `optimizer` over `model`'s parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    saved = [g["params"] for g in named["param_groups"]]
    if [sorted(g) for g in saved] != [sorted(g) for g in current]:
        ours = {n for g in current for n in g}
        theirs = {n for g in saved for n in g}
        diff = sorted(ours ^ theirs)[:3] or ["(the same names, grouped differently)"]
        raise ReplayRLError(
            f"The checkpoint's optimizer state does not fit this model's parameters "
            f"({len(theirs)} saved in {len(saved)} group(s), {len(ours)} here in "
            f"{len(current)}; e.g. {', '.join(diff)}). Resume with the model the checkpoint "
            f"was trained from, or start a new --lineage from its weights."
        )
    index = {name: i for i, name in enumerate(n for g in current for n in g)}
    template = optimizer.state_dict()["param_groups"]
    groups = []
    for group, mine in zip(named["param_groups"], template, strict=True):
        restored = tuples_like(group, mine)
        restored["params"] = [index[n] for n in group["params"]]
        groups.append(restored)
    state = {index[name]: value for name, value in named["state"].items() if name in index}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def tuples_like(group: dict, mine: dict) -> dict:
    """A saved param group with JSON's lists turned back into the tuples the optimizer's
    own group `mine` uses (AdamW's betas)."""
    return {
        key: tuple(value) if isinstance(value, list) and isinstance(mine.get(key), tuple) else value
        for key, value in group.items()
    }


# ---------------------------------------------------------------- RNG


def write_rng_state(directory: Path) -> None:
    """The calling process's torch, CUDA, numpy and Python RNG states into `directory`."""
    directory = Path(directory)
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / RNG_TENSORS)
    kind, key, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    states = {
        "format": FORMAT,
        "numpy": {
            "bit_generator": kind,
            "key": [int(k) for k in key],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    (directory / RNG_JSON).write_text(json.dumps(states))


def restore_rng_state(directory: Path) -> bool:
    """Set this process's RNGs from `directory` (new or old format); False when it has
    none. Every step reseeds from (seed, iteration), so this only matters to code that
    draws without reseeding; restoring it keeps a resumed process like the original."""
    directory = Path(directory)
    if (directory / RNG_JSON).exists():
        tensors_file, json_file = directory / RNG_TENSORS, directory / RNG_JSON
        with _reading(json_file):
            states = json.loads(json_file.read_text())
            n, p = states["numpy"], states["python"]
            numpy_state = (
                n["bit_generator"],
                np.asarray(n["key"], dtype=np.uint32),
                n["pos"],
                n["has_gauss"],
                n["cached_gaussian"],
            )
            python_state = (p["version"], tuple(p["internal"]), p["gauss_next"])
        with (
            _reading(tensors_file),
            safe_open(str(tensors_file), framework="pt", device="cpu") as f,
        ):
            torch_state = f.get_tensor("torch")
            cuda = [f.get_tensor(k) for k in sorted(f.keys()) if k.startswith("cuda.")]
    elif (directory / LEGACY_RNG_FILE).exists():
        tensors_file = json_file = directory / LEGACY_RNG_FILE
        with _reading(json_file):
            old = _legacy_rng(json_file)
            torch_state, numpy_state, python_state = old["torch"], old["numpy"], old["python"]
            cuda = list(old.get("cuda", []))
    else:
        return False
    # Check every state before setting any, so a damaged file leaves this process's RNGs
    # as they were.
    with _reading(tensors_file):
        torch.random.default_generator.clone_state().set_state(torch_state)
    with _reading(json_file):
        np.random.RandomState().set_state(numpy_state)
        random.Random().setstate(python_state)
    torch.set_rng_state(torch_state)
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    if cuda and torch.cuda.is_available():
        # A checkpoint from a machine with more GPUs restores the ones this one has.
        for i, state in enumerate(cuda[: torch.cuda.device_count()]):
            with _reading(tensors_file):
                torch.cuda.set_rng_state(state, i)
    return True


def _legacy_rng(path: Path) -> dict:
    """An old `rng_state.pt`: torch.load with only numpy's array types allowed beyond
    tensors and plain containers (no arbitrary code runs)."""
    reconstruct = np._core.multiarray._reconstruct
    allowed = [
        reconstruct,
        # files pickled under numpy 1.x name the same function by its old module
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        np.dtypes.UInt32DType,
    ]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


# ---------------------------------------------------------------- JSON values


def _to_json(value):
    """A state or hyper-parameter value as JSON: 0-dim tensors as {"tensor": dtype,
    "value": number} (exact: a float32 or bfloat16 value is exact as a float64 number)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError("only 0-dim tensors go to JSON")
        return {"tensor": str(value.dtype).removeprefix("torch."), "value": value.item()}
    if isinstance(value, tuple):
        return list(value)
    return value


def _from_json(value):
    if isinstance(value, dict) and set(value) == {"tensor", "value"}:
        return torch.tensor(value["value"], dtype=getattr(torch, value["tensor"]))
    return value


def has_dcp_optimizer(directory: Path) -> bool:
    return (Path(directory) / (DCP_PREFIX + _DCP_METADATA.removeprefix("."))).exists()


@contextlib.contextmanager
def dcp_folder(directory: Path) -> Iterator[str]:
    """A private folder in which the flat "optimizer.dcp.*" files of `directory` appear under
    DCP's own names (symbolic links), for `dcp.load`."""
    directory = Path(directory)
    with tempfile.TemporaryDirectory(prefix="replayrl-dcp-") as tmp:
        for f in directory.iterdir():
            if f.name.startswith(DCP_PREFIX):
                name = f.name.removeprefix(DCP_PREFIX)
                if name == _DCP_METADATA.removeprefix("."):
                    name = _DCP_METADATA
                os.symlink(f.resolve(), Path(tmp) / name)
        yield tmp
