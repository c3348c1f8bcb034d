"""KFP component `evaluate`.

Held-out greedy pass@1, sampled pass@k, entropy and response length of the new
checkpoint (`replayrl.engine.steps.evaluate`); only in iterations where evaluation is due.
Accelerator step.

The definition lives in `replayrl.kfp.components` so the installed `replayrl compile`
can build pipelines from it; this file re-exports it for pipelines of your own:

    from components.evaluate import evaluate
"""

from replayrl.kfp.components import evaluate

__all__ = ["evaluate"]
