"""KFP component `open_lineage`.

Open or resume a lineage: resolve the config, take the lineage's lease, publish
checkpoint v0 and log the warm-start evaluation on first use. Runs with the evaluate
step's pod settings (it evaluates the warm start when it creates a lineage).

The definition lives in `replayrl.kfp.components` so the installed `replayrl compile`
can build pipelines from it; this file re-exports it for pipelines of your own:

    from components.open_lineage import open_lineage
"""

from replayrl.kfp.components import open_lineage

__all__ = ["open_lineage"]
