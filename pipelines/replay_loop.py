"""Pipeline `replay_loop`: open a lineage, then N iterations unrolled at compile time
(generate -> compact -> train -> evaluate when due -> record), continuing where the lineage
stands. KFP v2 has no while loop, so N is fixed when the YAML is written.

The definition lives in `replayrl.kfp.pipelines` so the installed `replayrl compile` can
build it; this file builds it with the defaults (N = 10, the default image, the default
`kubernetes:` settings). The YAML for the KFP UI is `compiled/replay_loop.yaml`, written by
`replayrl compile` (or `python pipelines/replay_loop.py`).
"""

from replayrl.kfp import DEFAULT_ITERATIONS
from replayrl.kfp.pipelines import replay_loop_pipeline

replay_loop = replay_loop_pipeline(iterations=DEFAULT_ITERATIONS)

if __name__ == "__main__":
    from pathlib import Path

    from replayrl.kfp.pipelines import compile_pipelines

    for path in compile_pipelines(Path(__file__).parent / "compiled"):
        print(path)
