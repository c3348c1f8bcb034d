"""Pipeline `replay_iteration`: exactly one iteration of a lineage, the one its `state.json`
says is next, committed with a compare-and-swap. Schedule it as a recurring run (max
concurrency 1, no catch-up: `replayrl schedule create`) to train one iteration per trigger;
two overlapping runs cannot both advance the lineage, and once the lineage reaches its
`iterations` a run does nothing.

The definition lives in `replayrl.kfp.pipelines`; the YAML for the KFP UI is
`compiled/replay_iteration.yaml`, written by `replayrl compile`.
"""

from replayrl.kfp.pipelines import replay_iteration_pipeline

replay_iteration = replay_iteration_pipeline()

if __name__ == "__main__":
    from pathlib import Path

    from replayrl.kfp.pipelines import compile_pipelines

    for path in compile_pipelines(Path(__file__).parent / "compiled"):
        print(path)
