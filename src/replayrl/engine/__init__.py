"""The engines, and the one record path they share.

- `resources`: what lives for a whole task (the trainer, one generation engine, the buffer's
  mirror, the data splits): `TaskResources`;
- `inputs`: what a lineage starts from (problem splits, checkpoint v0, hub inputs);
- `steps`: the four steps of an iteration (generate, compact, train, evaluate);
- `record`: the record path's shared pieces (retention, the usage log and its staleness,
  what a full checkpoint records and leaves behind);
- `lineage`: opening, rewinding and recording an iteration (the commit point);
- `metric_schema`: every metric, declared once; `tracking`: MLflow;
- `inline`: the inline loop; `asynchronous/`: W workers, T trainers and an evaluator.

Built on the policy, storage and buffer layers; it knows nothing about Kubeflow or about
experiments across lineages.
"""
