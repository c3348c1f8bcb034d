"""The experience replay buffer: the Delta tables (rollouts and usage), their schema, sampling,
retention, maintenance and repair, and the in-memory mirror.

It knows rows and table versions; it knows nothing about models, engines or MLflow.
"""
