"""Shared by the vLLM tests: one warm-started tiny model per session, as a checkpoint."""

from __future__ import annotations

import pytest
from vllm_reference import warm_started_model

from replayrl.policy.tiny_model import save_model


@pytest.fixture(scope="session")
def warm_checkpoint(tmp_path_factory):
    """The directory of a tiny model given 60 supervised steps (so greedy completions are
    answers with an EOS, not near-ties); each test module loads its own copy from it."""
    model, tokenizer = warm_started_model()
    directory = tmp_path_factory.mktemp("warm-ckpt")
    save_model(model, tokenizer, directory)
    return directory
