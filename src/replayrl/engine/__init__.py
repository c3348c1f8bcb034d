"""The engines: the per-task resources, the four steps, the lineage record every engine
shares, MLflow tracking, the inline loop and the asynchronous engine.

Built on the policy, storage and buffer layers; it knows nothing about Kubeflow or about
experiments across lineages.
"""
