"""Checkpoints of a lineage: opaque folders published whole, with a COMPLETE marker last.

A checkpoint lives at `<lineage>/checkpoints/v000003/` (`LineagePaths.checkpoint`): the
Hugging Face layout (safetensors weight shards, tokenizer), the training state of a full
checkpoint (optimizer*, rng_state*: only the trainer reads those), then a COMPLETE marker.

Failure: a checkpoint counts only once its COMPLETE marker exists; `write_checkpoint`
clears what a crashed attempt left, copies the files, then writes the marker last. The
marker lists each file's size, so a reader (`checkpoint_local_dir`) also notices a
checkpoint damaged after it was published. Nothing here knows about models, losses or
trackers. Every object operation goes through `replayrl.storage.objects` (module
attributes, looked up at each call, so a test that patches one there reaches these calls).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.fs as pafs

from replayrl.errors import ReplayRLError
from replayrl.storage import objects
from replayrl.storage.objects import COMPLETE_MARKER

if TYPE_CHECKING:
    from replayrl.storage.state import LineagePaths

# Files of a checkpoint only the trainer reads (generation and evaluation skip them) are
# named after these: optimizer.json, optimizer.safetensors, optimizer-00001-of-00004.
# safetensors, optimizer.safetensors.index.json, rng_state.safetensors, rng_state.json, and
# the optimizer.pt / rng_state.pt of older checkpoints.
TRAINING_STATE_PREFIXES = ("optimizer", "rng_state")


def is_training_state(name: str) -> bool:
    """Whether checkpoint file `name` is training state (optimizer or RNG state) that only
    the trainer reads. Example: "optimizer-00001-of-00002.safetensors" and "rng_state.json"
    are; "model.safetensors" and "tokenizer.json" are not."""
    return any(name == p or name.startswith((p + ".", p + "-")) for p in TRAINING_STATE_PREFIXES)


def is_complete(uri: str) -> bool:
    return objects.exists(objects.join(uri, COMPLETE_MARKER))


def write_checkpoint(local_dir: Path, uri: str) -> None:
    """Publish a checkpoint: clear any partial output a crashed attempt left at `uri`,
    copy the files, then write the COMPLETE marker last. A reader only trusts marked ones."""
    objects.delete(uri)
    objects.upload_dir(local_dir, uri)
    mark_complete(uri, files=_sizes(Path(local_dir)))


def _sizes(local_dir: Path) -> dict[str, int]:
    return {
        p.name: p.stat().st_size
        for p in sorted(Path(local_dir).iterdir())
        if p.is_file() and p.name != COMPLETE_MARKER
    }


def mark_complete(uri: str, *, files: dict[str, int] | None = None) -> None:
    """Write the COMPLETE marker of a checkpoint whose files are all in place. The marker
    lists each file's size in bytes (`files`; by default what is at `uri` now)."""
    if files is None:
        fs, path = objects.filesystem(uri)
        infos = objects._io("list", uri, lambda: fs.get_file_info(pafs.FileSelector(path)))
        files = {
            i.base_name: int(i.size)
            for i in infos
            if i.type == pafs.FileType.File and i.base_name != COMPLETE_MARKER
        }
    # `write_id` makes every publication's marker unique, so a cached copy of an earlier
    # publication of the same version is recognised as stale.
    manifest = {"format": 1, "write_id": uuid.uuid4().hex, "files": dict(sorted(files.items()))}
    objects.write_bytes_atomic(
        objects.join(uri, COMPLETE_MARKER), json.dumps(manifest, indent=1).encode()
    )


def verify_checkpoint(
    uri: str, local_dir: Path, *, skip: Callable[[str], bool] = objects._skip_nothing
) -> None:
    """Check the files in `local_dir` (a copy of checkpoint `uri`) against the sizes its
    COMPLETE marker lists, except the names `skip` is true for (not copied). Markers
    written before sizes were recorded are trusted."""
    try:
        manifest = json.loads((Path(local_dir) / COMPLETE_MARKER).read_bytes())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    for name, size in files.items():
        if skip(name):
            continue
        path = Path(local_dir) / name
        actual = path.stat().st_size if path.exists() else None
        if actual != size:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise ReplayRLError(
                f"Checkpoint '{uri}' is damaged: '{name}' {found} but its {COMPLETE_MARKER} "
                f"marker lists {size} bytes (truncated or partly overwritten). Restore the "
                f"file from a copy, or start a new --lineage from an older complete checkpoint "
                f"(--set model.source=<that checkpoint>)."
            )


def complete_versions(paths: LineagePaths) -> list[int]:
    out = []
    for name in objects.list_dir(paths.checkpoints):
        if (
            name.startswith("v")
            and name[1:].isdigit()
            and is_complete(paths.checkpoint(int(name[1:])))
        ):
            out.append(int(name[1:]))
    return sorted(out)


def checkpoint_local_dir(uri: str, cache_dir: Path, *, weights_only: bool = False) -> Path:
    """A local directory holding the checkpoint at `uri` (downloaded from S3 if needed),
    checked against the sizes its COMPLETE marker lists. `weights_only` skips the training
    state (`is_training_state`: optimizer and RNG state) on S3, so generation and
    evaluation never download it; a local checkpoint is used where it lies."""
    if not is_complete(uri):
        raise ReplayRLError(
            f"Checkpoint '{uri}' is missing or incomplete (no {COMPLETE_MARKER} marker). "
            f"Resume the lineage so the step that writes it runs again."
        )
    skip = is_training_state if weights_only else objects._skip_nothing
    if not objects.is_s3(uri):
        local = Path(objects.normalize_root(uri))
        verify_checkpoint(uri, local, skip=skip)
        return local
    local = cache_dir / ("s3-weights" if weights_only else "s3") / uri[len("s3://") :]
    cached_marker = local / COMPLETE_MARKER
    if cached_marker.exists() and cached_marker.read_bytes() == objects.read_bytes(
        objects.join(uri, COMPLETE_MARKER)
    ):
        try:
            verify_checkpoint(uri, local, skip=skip)
            return local
        except ReplayRLError:
            pass  # a damaged cached copy: fetch it again
    objects.download_dir(uri, local, skip=skip)
    verify_checkpoint(uri, local, skip=skip)
    return local


def prune_checkpoints(paths: LineagePaths, *, keep: int, protect: set[int]) -> list[int]:
    """Delete complete checkpoints older than the newest `keep`, except `protect`."""
    if keep <= 0:
        return []
    versions = complete_versions(paths)
    doomed = [v for v in versions[:-keep] if v not in protect]
    for v in doomed:
        objects.delete(paths.checkpoint(v))
    return doomed
