"""The policy: models and tokenizers, generation backends, gradient steps, checkpoint state,
problem sets, evaluation and Hugging Face hub inputs.

It knows tensors and checkpoints on disk; it knows nothing about the replay buffer, lineages,
MLflow or Kubeflow.
"""
