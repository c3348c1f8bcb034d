"""KFP component `compare`.

Replay vs on-policy over the lineages of the config's MLflow experiment
(`replayrl.experiments.compare.run_compare`): a Markdown table with the plot embedded and an HTML
page for the KFP UI, the headline numbers as metrics, and the files logged to a
comparison run in MLflow (one per KFP run id, so a retry reuses it). CPU step.

The definition lives in `replayrl.kfp.components` so the installed `replayrl compile`
can build pipelines from it; this file re-exports it for pipelines of your own:

    from components.compare import compare
"""

from replayrl.kfp.components import compare

__all__ = ["compare"]
