"""replayrl: RL post-training of language models with a durable experience replay buffer."""

__version__ = "0.1.0"
