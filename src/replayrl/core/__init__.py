"""Core maths: losses, advantages, rewards, staleness, metrics, the compute ledger and its clocks.

Pure functions over numbers and tensors: nothing here reads files, talks to a server or
knows about Kubeflow, MLflow or the buffer. Everything else in replayrl builds on it.
"""
