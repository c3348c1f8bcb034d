"""KFP component `compact`.

Buffer retention (FIFO capacity, positive bias, max staleness), bin-packing and
vacuum; outputs the buffer version train pins (`replayrl.engine.steps.compact`). CPU step.

The definition lives in `replayrl.kfp.components` so the installed `replayrl compile`
can build pipelines from it; this file re-exports it for pipelines of your own:

    from components.compact import compact
"""

from replayrl.kfp.components import compact

__all__ = ["compact"]
