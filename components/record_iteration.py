"""KFP component `record_iteration`.

Log the iteration to MLflow and advance the lineage's state.json with a
compare-and-swap: the commit point of an iteration (`replayrl.engine.iteration.record_iteration`).
CPU step; not retried.

The definition lives in `replayrl.kfp.components` so the installed `replayrl compile`
can build pipelines from it; this file re-exports it for pipelines of your own:

    from components.record_iteration import record_iteration
"""

from replayrl.kfp.components import record_iteration

__all__ = ["record_iteration"]
