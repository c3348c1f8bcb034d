"""Where a lineage keeps its state: run-root URIs, files, checkpoints and `state.json`.

The layer under the buffer, the policy and the engines. It knows URIs (`file://` and `s3://`),
bytes and JSON, and nothing about models, rollouts or MLflow:

- `objects`: URIs, atomic writes, directories, checkpoints, `state.json` and its
  compare-and-swap. `replayrl.storage.X` names `replayrl.storage.objects.X`, looked up at
  each use, so a test that patches the defining module patches every caller;
- `s3`: error translation, retries under a deadline and conditional puts for S3;
- `lease`: which run may write to a lineage right now.
"""

from __future__ import annotations

from typing import Any

from replayrl.storage import objects as _objects


def __getattr__(name: str) -> Any:
    try:
        return getattr(_objects, name)
    except AttributeError:
        raise AttributeError(f"module 'replayrl.storage' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | {n for n in dir(_objects) if not n.startswith("_")})
