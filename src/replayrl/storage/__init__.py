"""Where a lineage keeps its state: run-root URIs, files, checkpoints and `state.json`.

The layer under the buffer, the policy and the engines. It knows URIs (`file://` and `s3://`),
bytes and JSON, and nothing about models, rollouts or MLflow:

- `objects`: URIs, the S3 settings, atomic writes, reads, listings and folders;
- `transfer`: whole folders uploaded and downloaded (`upload_dir`, `download_dir`);
- `checkpoints`: checkpoint folders and their COMPLETE marker;
- `state`: a lineage's layout (`LineagePaths`), `state.json` and its compare-and-swap;
- `s3`: error translation, retries under a deadline and conditional puts for S3;
- `lease`: which run may write to a lineage right now.

`replayrl.storage.X` names X of `objects`, `transfer`, `checkpoints` or `state` (the first
that has it), looked up at each use, so a test that patches the defining module patches
every caller.
"""

from __future__ import annotations

from typing import Any

from replayrl.storage import checkpoints as _checkpoints
from replayrl.storage import objects as _objects
from replayrl.storage import state as _state
from replayrl.storage import transfer as _transfer

_MODULES = (_objects, _transfer, _checkpoints, _state)


def __getattr__(name: str) -> Any:
    for module in _MODULES:
        try:
            return getattr(module, name)
        except AttributeError:
            continue
    raise AttributeError(f"module 'replayrl.storage' has no attribute {name!r}")


def __dir__() -> list[str]:
    public = {n for module in _MODULES for n in dir(module) if not n.startswith("_")}
    return sorted(set(globals()) | public)
