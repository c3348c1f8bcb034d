"""The Kubeflow Pipelines engine: components, pipelines, `kfp.local` runs, submission.

The same step functions as the inline engine (`replayrl.engine.steps`, `replayrl.engine.lineage`), one pod
per step. Definitions live inside the package so the installed `replayrl compile` can build
them; the top-level `components/` and `pipelines/` folders re-export them for readers and
hold the compiled YAML. Importing this package imports nothing heavy; `kfp` is imported by
the modules that need it.
"""

from __future__ import annotations

# The image every step runs in (the project's image: replayrl with its `kfp` extra, and the
# `gpu` extra for vLLM). `replayrl compile --image` replaces it in one place.
DEFAULT_IMAGE = "ghcr.io/replayrl/replayrl:0.1.0"

# Iterations `replay_loop` unrolls when compiled without --iterations (the committed YAML).
DEFAULT_ITERATIONS = 10
