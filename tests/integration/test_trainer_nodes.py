"""A trainer that spans nodes, on 127.0.0.1: the ranks a Kubeflow TrainJob starts
(`torchrun`'s RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) join through env://,
rank 0 feeds the others over a collective (`TrainerGroup.from_env` / `follow_env`), and
each "node" has its own cache and temp folder."""

from __future__ import annotations

import pytest

from replayrl.errors import ReplayRLError
from replayrl.policy.distributed import ENV_RENDEZVOUS, join_env_group

pytestmark = pytest.mark.integration


def test_a_rank_without_torchruns_variables_is_refused_with_one_line(monkeypatch):
    for name in ENV_RENDEZVOUS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ReplayRLError, match="LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        join_env_group(gpu=False)
    for name, value in dict(LOCAL_RANK="0", WORLD_SIZE="two", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="1").items():  # fmt: skip
        monkeypatch.setenv(name, value)
    with pytest.raises(ReplayRLError, match="whole numbers"):
        join_env_group(gpu=False)
