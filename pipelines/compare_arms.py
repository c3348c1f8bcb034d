"""Pipeline `compare_arms`: a replay lineage and an on-policy lineage of one config as two
parallel branches (each opened, then N iterations unrolled at compile time), then a
comparison step: held-out pass@1 against generated tokens, measured seconds and modelled
cost, as a Markdown table and an HTML plot in the KFP UI, and as a comparison run (tag
`kind=comparison`) in the config's MLflow experiment.

The definition lives in `replayrl.kfp.pipelines` so the installed `replayrl compile` can
build it; this file builds it with the defaults (N = 10 per arm, the default image, the
default `kubernetes:` settings). The YAML for the KFP UI is `compiled/compare_arms.yaml`,
written by `replayrl compile` (or `python pipelines/compare_arms.py`).
"""

from replayrl.kfp import DEFAULT_ITERATIONS
from replayrl.kfp.pipelines import compare_arms_pipeline

compare_arms = compare_arms_pipeline(iterations=DEFAULT_ITERATIONS)

if __name__ == "__main__":
    from pathlib import Path

    from replayrl.kfp.pipelines import compile_pipelines

    for path in compile_pipelines(Path(__file__).parent / "compiled"):
        print(path)
