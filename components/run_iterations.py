"""KFP component `run_iterations`.

A task of many iterations in one pod (the pipelines' default "task" layout): `count`
iterations from `iteration`, each generate -> compact -> train -> evaluate (when due) ->
record, with one generation engine, the trainer and its optimizer, and the buffer's
in-memory mirror kept for all of them; a full checkpoint every `train.checkpoint_every`
iterations and at the end (`replayrl.engine.inline.run_task`). A retried pod rewinds to the task's
last full checkpoint. Accelerator step.

The definition lives in `replayrl.kfp.components` so the installed `replayrl compile`
can build pipelines from it; this file re-exports it for pipelines of your own:

    from components.run_iterations import run_iterations
"""

from replayrl.kfp.components import run_iterations

__all__ = ["run_iterations"]
