"""Pipeline `async_segment`: one segment of an asynchronous lineage (`asynchronous.enabled`).
A CPU task opens (or resumes) the lineage and begins the segment; then W generation workers,
the trainer and the evaluator run as parallel accelerator tasks, coordinated only through
the buffer and the published weights under the run root (S3 on a cluster), until the
trainer reaches the segment's end (`asynchronous.segment_steps` / `segment_seconds`).
Schedule it as a recurring run (max concurrency 1) to drive one segment per trigger.
kfp.local cannot run it (it runs tasks one after another); `replayrl run --engine async`
runs the same roles on one machine.

The definition lives in `replayrl.kfp.async_pipeline`; this file builds it with the defaults
(W = 1 worker, the default image, the default `kubernetes:` settings). W is a pod setting,
fixed when the YAML is written from the `asynchronous.workers` of `replayrl compile
--config`. The YAML for the KFP UI is `compiled/async_segment.yaml`, written by `replayrl
compile` (or `python pipelines/async_segment.py`).
"""

from replayrl.kfp.async_pipeline import async_segment_pipeline

async_segment = async_segment_pipeline()

if __name__ == "__main__":
    from pathlib import Path

    from replayrl.kfp.pipelines import compile_pipelines

    for path in compile_pipelines(Path(__file__).parent / "compiled"):
        print(path)
