"""The local copies of published weights that a worker or the evaluator keeps on its disk.

Workers and the evaluator read published versions from an S3 run root through
`storage.checkpoint_local_dir`, which keeps a verified copy of each in the cache
(`config.default_cache_dir`: on a Kubeflow accelerator pod, the scratch volume). Kept for
ever, those copies would fill the volume (30.5 GB a version at 7B in float32: a 600 Gi
scratch after about 19 publications, and the pod is evicted), so after each successful load
a role drops every copy but the versions it may still load:

- a worker: the version it runs now (loaded just now) and the newest announced one;
- the evaluator: the due versions it has not evaluated yet;
- either: every version a role of the segment says it is loading or generating with
  (`board.versions_in_use`), because the roles of one machine (`run --engine async`) share
  one cache: a copy another role resolved is never dropped under it.

So a worker's cache holds at most two versions beside those in use by the others (at most
one each), the evaluator's at most its backlog. A drop is crash-safe and leaves downloads
in progress alone (`storage.drop_cached_copies`). A local run root caches nothing: its
checkpoints are read where they lie. This module knows nothing about models.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from replayrl import storage
from replayrl.config import RunConfig, default_cache_dir
from replayrl.engine.asynchronous import board
from replayrl.storage import LineagePaths

log = logging.getLogger(__name__)

_PUBLISHED = re.compile(r"v(\d{9})")  # `board.weights_uri`'s folders


def cached_versions(cfg: RunConfig, paths: LineagePaths) -> list[int]:
    """Published versions (v0, the lineage's initial checkpoint, included) that have a local
    copy in this machine's cache: none for a local run root."""
    if not storage.is_s3(paths.root):
        return []
    cache = default_cache_dir(cfg)
    found = []
    if _copies(cache, board.weights_uri(paths, 0)).is_dir():
        found.append(0)
    try:
        names = os.listdir(_copies(cache, board.published_dir(paths)))
    except FileNotFoundError:
        names = []
    found += [int(m.group(1)) for n in names if (m := _PUBLISHED.fullmatch(n))]
    return sorted(set(found))


def _copies(cache: Path, uri: str) -> Path:
    return storage.cached_copies_dir(uri, cache, weights_only=True)


def keep_only(cfg: RunConfig, paths: LineagePaths, keep: set[int], *, role: str) -> list[int]:
    """Role `role` (`worker<i>`, `evaluator`) has loaded what it needs: drop the cached
    copies of every published version but `keep` and those another role of the segment is
    loading or generating with (`board.versions_in_use`, read after the copies are listed: a
    role says what it loads before it reads a byte; this role's own statement still names
    the version it ran before). Returns the versions dropped."""
    cached = cached_versions(cfg, paths)
    if not set(cached) - keep:
        return []
    keep = keep | board.versions_in_use(paths, cfg.asynchronous.workers, besides=role)
    cache = default_cache_dir(cfg)
    dropped = []
    for v in cached:
        if v not in keep and storage.drop_cached_copies(
            board.weights_uri(paths, v), cache, weights_only=True
        ):
            dropped.append(v)
    if dropped:
        log.info("dropped the cached copies of published versions %s", dropped)
    return dropped
