"""KFP component `train`.

S gradient steps on rows sampled from the pinned buffer version; writes checkpoint
v_{t+1} and the usage log (`replayrl.engine.steps.train`). Accelerator step.

The definition lives in `replayrl.kfp.components` so the installed `replayrl compile`
can build pipelines from it; this file re-exports it for pipelines of your own:

    from components.train import train
"""

from replayrl.kfp.components import train

__all__ = ["train"]
