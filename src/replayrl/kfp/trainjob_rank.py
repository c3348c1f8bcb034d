"""One rank of the trainer on several nodes: what a Kubeflow Trainer TrainJob's pods run
(`replayrl.kfp.trainjob`, `rank_command`):

    python -m torch.distributed.run -m replayrl.kfp.trainjob_rank \\
        --config <the run's config> --owner <the KFP run id> --segment-id <segment>

torchrun turns the torch plugin's PET_* variables into RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; every rank joins the default process group through env://
(`policy.distributed.join_env_group`: NCCL on GPU LOCAL_RANK, gloo on the CPU). Rank 0 is
the segment's asynchronous trainer role, as a one-host trainer pod runs it
(`async_runtime.async_role`: the lineage's lease held as the run, the board, publishing,
MLflow), its trainer group being rank 0 of the joined group
(`engine.trainer_group.start_trainers` takes `TrainerGroup.from_env` when the default
group is joined). The other ranks follow (`trainer_ranks.follow_env`): they load the same
checkpoint into their own node's cache and step on the global batches rank 0 broadcasts;
they hold no lease. Replicas write nothing (rank 0 writes every checkpoint); sharded ranks
(`train.distributed: fsdp`, HSDP across nodes) each upload their own shard files at a full
checkpoint, which rank 0 marks complete once it has every rank's digests. Every line a rank
logs starts with `trainer-rank<r>`. Bad input is one line on stderr (`replayrl: error:
...`) and exit code 2.

Only ran on 127.0.0.1 (two processes, and 2 x 2 sharded ones, on gloo:
tests/integration/test_trainer_nodes.py), not on a cluster or over NCCL.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m replayrl.kfp.trainjob_rank")
    p.add_argument("--config", required=True, help="the run's config (YAML text)")
    p.add_argument("--owner", required=True, help="the KFP run id that holds the lease")
    p.add_argument("--segment-id", required=True)
    return p


def run_rank(*, config: str, owner: str, segment_id: str) -> dict | None:
    """This process's rank of the segment's trainer: rank 0's numbers, None elsewhere."""
    import torch

    from replayrl.config import load_config
    from replayrl.engine.trainer_ranks import follow_env
    from replayrl.policy.distributed import join_env_group

    cfg = load_config(text=config)  # before joining: a bad config stops every rank alike
    rank, world, local, device = join_env_group(gpu=torch.cuda.is_available())
    _log_as(rank)
    log.info("trainer rank %d of %d (local rank %d, %s)", rank, world, local, device)
    try:
        if rank > 0:
            follow_env(cfg)
            log.info("trainer rank %d stops: rank 0 said stop", rank)
            return None
        from replayrl.kfp.async_runtime import async_role

        numbers = async_role(config=config, owner=owner, role="trainer", segment_id=segment_id)
        log.info("trainer rank 0 done: %s", numbers)
        return numbers
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _log_as(rank: int) -> None:
    from replayrl import logs

    fmt = f"%(asctime)s trainer-rank{rank} %(levelname)s %(name)s: %(message)s"
    root = logging.getLogger()
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(fmt))
    if not root.handlers:
        logging.basicConfig(level=logging.INFO, format=fmt)
    root.setLevel(logging.INFO)
    logs.install(os.environ)


def main(argv: list[str] | None = None) -> int:
    from replayrl import logs
    from replayrl.errors import ReplayRLError

    args = _parser().parse_args(argv)
    try:
        run_rank(config=args.config, owner=args.owner, segment_id=args.segment_id)
    except ReplayRLError as e:
        line = logs.redact(" ".join(str(e).split()), secrets=logs.known_secrets(os.environ))
        print(f"replayrl: error: {line}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
