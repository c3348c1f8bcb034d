"""KFP component `generate`.

Policy v_t samples this iteration's rollouts; rewards and advantages are fixed at
generation time and the rows replace any earlier attempt's rows of the iteration
(`replayrl.engine.steps.generate`). Accelerator step.

The definition lives in `replayrl.kfp.components` so the installed `replayrl compile`
can build pipelines from it; this file re-exports it for pipelines of your own:

    from components.generate import generate
"""

from replayrl.kfp.components import generate

__all__ = ["generate"]
