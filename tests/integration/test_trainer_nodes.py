"""A trainer that spans nodes, on 127.0.0.1: the ranks a Kubeflow TrainJob starts
(`torchrun`'s RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) join through env://,
rank 0 feeds the others over a collective (`TrainerGroup.from_env` / `follow_env`), and
each "node" is a process with its own cache and temp folder, reading the lineage from S3
(SeaweedFS): two such nodes step as one process on the same global batches, and two nodes
killed after a full checkpoint resume on one process, then on two nodes again, to one
uninterrupted process's weights and AdamW state. Sharded (`train.distributed: fsdp`), two
nodes of two ranks are hybrid-sharded (HSDP), every rank uploads its own shard files to the
checkpoint, whose marker names them all, and one process resumes from it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replayrl.config import load_config
from replayrl.engine.resources import Trainer
from replayrl.engine.steps import step_settings
from replayrl.engine.trainer_group import TrainerGroup, start_trainers
from replayrl.engine.trainer_ranks import follow_env
from replayrl.errors import ReplayRLError
from replayrl.policy.distributed import ENV_RENDEZVOUS, free_port, join_env_group
from replayrl.storage import paths_of

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
PARAM_ATOL = 5e-5  # test_trainer_group's: float sums in another order move Adam's updates
STEPS = 3
# How long the node processes may take: ~15-40 s alone here, over 3 minutes once seen on 2
# cores under a load average of 10; the bound only turns a hang into a failure.
NODES_TIMEOUT_S = 600


def _cfg(run_root: str, *extra: str, world: int = 2):
    """The run's config with `world` trainer ranks, one per node."""
    return load_config(
        PRESET,
        overrides=[
            f"storage.run_root={run_root}",
            "asynchronous.enabled=true",
            f"asynchronous.trainers={world}",
            f"asynchronous.trainer_nodes={world}",
            "train.batch_size=7",  # odd: the two shards (and their token counts) differ
            "train.lr=1e-3",
            "train.micro_batch_size=2",
            *extra,
        ],
    )


def _node(run_root: str, out: str, *, start: int = 0, steps: int = STEPS, then: bool = False):
    """One "node" (one rank per node, LOCAL_RANK 0 on each), as a TrainJob pod's rank runs:
    resume from full checkpoint v{start}, step on global batches start + 1 .. `steps` of
    `out`/batches.arrow (seed: the global step), and save full checkpoint v{steps} (rank 0
    alone writes it). `then`: keep stepping on the later batches after that checkpoint,
    counting the steps in `out`/after.txt, until killed."""
    import logging

    import pyarrow as pa

    torch.set_num_threads(1)
    rank, world, local, device = join_env_group(gpu=False)
    logging.basicConfig(level=logging.INFO)
    print(f"rank {rank} of {world}, local rank {local}, {device}", flush=True)
    cfg = _cfg(run_root, world=world)
    try:
        if rank > 0:
            follow_env(cfg)
            return
        paths = paths_of(cfg)
        trainer = Trainer.load(cfg, paths, version=start, settings=step_settings(cfg))
        group = start_trainers(cfg, trainer, checkpoint_version=start)
        assert isinstance(group, TrainerGroup) and not group._procs
        with pa.ipc.open_file(Path(out) / "batches.arrow") as f:
            batches = [f.get_batch(i) for i in range(f.num_record_batches)]
        stats = []
        for step in range(start + 1, steps + 1):
            rows = pa.Table.from_batches([batches[step - 1]])
            stats += group.train([rows], seed=step)
        group.save(paths.checkpoint(steps))  # a full checkpoint: rank 0 alone writes it
        (Path(out) / "stats.json").write_text(json.dumps([s.loss for s in stats]))
        torch.save(group.model.state_dict(), Path(out) / "weights.pt")
        later = batches[steps:] * 1000  # far more than the test waits for
        for n, rows in enumerate(later if then else [], 1):
            group.train([pa.Table.from_batches([rows])], seed=steps + n)
            (Path(out) / "after.txt").write_text(str(n))
        group.close()
    finally:
        torch.distributed.destroy_process_group()


def _start_node(
    rank: int,
    world: int,
    port: int,
    run_root: str,
    out: Path,
    home: Path,
    *,
    local: int = 0,
    per_node: int = 1,
    target: str = "_node",
    log_name: str = "log.txt",
    **plan,
):
    """Rank `rank` of `world` running `target(run_root, out, **plan)` (`_node`), with
    torchrun's variables (local rank `local` of `per_node`) and the cache and temp folder of
    its node (`home`, shared by that node's ranks)."""
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(per_node),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "REPLAYRL_CACHE": str(home / "cache"),
        "TMPDIR": str(home / "tmp"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path]),
    }
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    code = f"import test_trainer_nodes as t; t.{target}({run_root!r}, {str(out)!r}, **{plan!r})"
    log = open(home / log_name, "w")  # noqa: SIM115 - closed by the test
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log, stderr=log), log


def _start_nodes(world: int, run_root: str, out: Path, **plan):
    """`world` nodes on 127.0.0.1, each with its own home `out`/node{r}."""
    port = free_port()
    return [_start_node(r, world, port, run_root, out, out / f"node{r}", **plan)
            for r in range(world)]  # fmt: skip


def _wait_nodes(nodes, out: Path) -> list[str]:
    """Wait for every node to end; their logs (the test fails, with them, unless all exit 0)."""
    for proc, log in nodes:
        try:
            proc.wait(timeout=NODES_TIMEOUT_S)
        finally:
            proc.kill()
            log.close()
    logs = [(out / f"node{r}" / "log.txt").read_text() for r in range(len(nodes))]
    assert [p.returncode for p, _ in nodes] == [0] * len(nodes), logs
    return logs


def _write_batches(path: Path, batches) -> None:
    import pyarrow as pa

    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.ipc.new_file(path, batches[0].schema) as w:
        for rows in batches:
            w.write_table(rows.combine_chunks())


def _v0_and_batches(cfg, steps: int):
    """Checkpoint v0 of the tiny model (seed 11) under `cfg`'s lineage, and `steps` batches of
    7 rows it sampled: (the lineage's paths, the step settings, the batches)."""
    from rollout_rows import sampled_rows

    from replayrl.policy.tiny_model import build_tiny_model
    from replayrl.policy.tokenizer import VOCAB_SIZE, build_byte_tokenizer
    from replayrl.policy.training import make_optimizer

    paths = paths_of(cfg)
    model = build_tiny_model(vocab_size=VOCAB_SIZE, seed=11)
    tokenizer = build_byte_tokenizer()
    s = step_settings(cfg)
    optimizer = make_optimizer(model, lr=s.lr, weight_decay=s.weight_decay, betas=s.betas)
    Trainer(model, tokenizer, optimizer, settings=s, version=0).save(paths.checkpoint(0))
    table = sampled_rows(model, tokenizer, num_samples=steps)
    return paths, s, [table.slice(7 * i, 7) for i in range(steps)]


@pytest.mark.slow
def test_two_nodes_on_127_0_0_1_step_as_one_process(s3_root, tmp_path):

    cfg = _cfg(s3_root)
    paths, s, batches = _v0_and_batches(cfg, STEPS)
    _write_batches(tmp_path / "batches.arrow", batches)

    logs = _wait_nodes(_start_nodes(2, s3_root, tmp_path), tmp_path)
    assert "trainer rank 1 of 2 follows rank 0 (checkpoint v0)" in logs[1]

    # One process on the same global batches.
    reference = Trainer.load(cfg, paths, version=0, settings=s)
    initial = {k: v.clone() for k, v in reference.model.state_dict().items()}
    want = [reference.train([rows], seed=step)[0].loss for step, rows in enumerate(batches, 1)]
    assert json.loads((tmp_path / "stats.json").read_text()) == pytest.approx(want, rel=1e-4)
    got = torch.load(tmp_path / "weights.pt")
    moved = 0.0
    for name, ref in reference.model.state_dict().items():
        assert torch.allclose(got[name], ref, atol=PARAM_ATOL * 3, rtol=0), name
        moved = max(moved, float((got[name] - initial[name]).abs().max()))
    assert moved > 20 * PARAM_ATOL  # the steps moved far more than the tolerance
    # Rank 0's checkpoint, in S3, holds the trained weights; each node read v0 into its own
    # cache, and no checkpoint was staged in the follower's temp folder.
    saved = Trainer.load(cfg, paths, version=STEPS, settings=s)
    for name, value in saved.model.state_dict().items():
        assert torch.equal(value, got[name]), name
    for r in range(2):
        assert any((tmp_path / f"node{r}" / "cache").rglob("*.safetensors")), r
    assert not any((tmp_path / "node1" / "tmp").iterdir())


RESUMED_STEPS = 5  # v0 -> v2 on 2 nodes (killed after), v2 -> v3 alone, v3 -> v5 on 2 nodes
# test_fsdp's tolerance, 2% of one lr step (2e-5 at lr 1e-3); measured after the 5 steps:
# 1.8e-6, against moves of 5e-3.
RESUMED_ATOL = 0.02 * 1e-3


def _assert_state(trainer, reference, *, steps: int) -> float:
    """`trainer`'s weights and AdamW state within tolerance of the one-process `reference`
    (both `steps` optimizer steps in); returns the largest weight difference."""
    from replayrl.policy.training_state import named_optimizer_state

    want = reference.model.state_dict()
    worst = 0.0
    for name, value in trainer.model.state_dict().items():
        worst = max(worst, float((value - want[name]).abs().max()))
    assert worst <= RESUMED_ATOL, worst
    got = named_optimizer_state(trainer.optimizer, trainer.model)["state"]
    ref = named_optimizer_state(reference.optimizer, reference.model)["state"]
    assert got.keys() == ref.keys() and got
    for name, state in ref.items():
        assert float(got[name]["step"]) == float(state["step"]) == steps, name
        for key in ("exp_avg", "exp_avg_sq"):  # test_fsdp's tolerance on the moments
            assert torch.allclose(got[name][key], state[key], atol=1e-6, rtol=1e-3), (name, key)
    return worst


@pytest.mark.slow
def test_two_nodes_killed_after_a_checkpoint_resume_on_one_and_back_on_two(s3_root, tmp_path):
    """Two nodes step from v0 and write full checkpoint v2, then are SIGKILLed (every rank)
    while they step on; one process resumes from v2 and writes v3 (2 -> 1 ranks), two fresh
    nodes resume from v3 and write v5 (1 -> 2). At v3 and at v5 the weights and AdamW state
    are one uninterrupted process's, within the tolerances of the steps themselves."""
    import time

    from replayrl.storage import complete_versions, read_manifest

    cfg = _cfg(s3_root)
    paths, s, batches = _v0_and_batches(cfg, RESUMED_STEPS)
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    for out in (killed, resumed):
        _write_batches(out / "batches.arrow", batches)

    # Two nodes, v0 -> v2, then on into steps 3, 4, ...: killed once a step after v2 ended.
    nodes = _start_nodes(2, s3_root, killed, steps=2, then=True)
    try:
        deadline = time.monotonic() + NODES_TIMEOUT_S
        while not (killed / "after.txt").exists():
            assert all(p.poll() is None for p, _ in nodes), "a node ended before it was killed"
            assert time.monotonic() < deadline, "the nodes never stepped past checkpoint v2"
            time.sleep(0.05)
        marker = read_manifest(paths.checkpoint(2))
        time.sleep(0.2)  # into the next step
        assert all(p.poll() is None for p, _ in nodes)
        for proc, _ in nodes:
            proc.send_signal(signal.SIGKILL)
    finally:
        for proc, log in nodes:
            proc.kill()
            proc.wait(timeout=30)
            log.close()
    assert [p.returncode for p, _ in nodes] == [-signal.SIGKILL] * 2
    assert complete_versions(paths) == [0, 2]  # nothing after v2 was written
    assert read_manifest(paths.checkpoint(2)).write_id == marker.write_id

    # The uninterrupted run: one process, v0 -> v5, its state taken at v3 and at v5.
    reference = Trainer.load(cfg, paths, version=0, settings=s)
    initial = {k: v.clone() for k, v in reference.model.state_dict().items()}
    want = [reference.train([batches[i]], seed=i + 1)[0].loss for i in range(3)]
    assert json.loads((killed / "stats.json").read_text()) == pytest.approx(want[:2], rel=1e-4)

    # 2 -> 1: one process resumes from the killed nodes' v2 and writes v3.
    one = _cfg(s3_root, world=1)
    alone = start_trainers(one, Trainer.load(one, paths, version=2, settings=s),
                           checkpoint_version=2)  # fmt: skip
    assert isinstance(alone, Trainer)
    assert alone.train([batches[2]], seed=3)[0].loss == pytest.approx(want[2], rel=1e-4)
    _assert_state(alone, reference, steps=3)
    alone.save(paths.checkpoint(3))

    # 1 -> 2: two fresh nodes (new caches, temp folders) resume from v3 and write v5.
    logs = _wait_nodes(_start_nodes(2, s3_root, resumed, start=3, steps=5), resumed)
    assert "trainer rank 1 of 2 follows rank 0 (checkpoint v3)" in logs[1]
    want += [reference.train([batches[i]], seed=i + 1)[0].loss for i in range(3, 5)]
    assert json.loads((resumed / "stats.json").read_text()) == pytest.approx(want[3:], rel=1e-4)
    final = Trainer.load(cfg, paths, version=5, settings=s)
    worst = _assert_state(final, reference, steps=5)
    got = torch.load(resumed / "weights.pt")
    moved = 0.0
    for name, value in final.model.state_dict().items():
        assert torch.equal(value, got[name]), name  # v5 holds rank 0's trained weights
        moved = max(moved, float((value - initial[name]).abs().max()))
    assert moved > 100 * RESUMED_ATOL  # the steps moved far more than the tolerance
    print(f"largest weight difference {worst:.2e}, largest move {moved:.2e}")


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


HSDP_NODES, HSDP_PER_NODE = 2, 2  # 4 gloo processes: the 2 CPU cores here run them in ~15 s


def _hsdp_cfg(run_root: str, *extra: str):
    """The run's config with FSDP trainers on HSDP_NODES nodes of HSDP_PER_NODE ranks."""
    return _cfg(run_root, "train.distributed=fsdp", f"asynchronous.trainer_nodes={HSDP_NODES}",
                *extra, world=HSDP_NODES * HSDP_PER_NODE)  # fmt: skip


def _hsdp_node(run_root: str, out: str, *, steps: int = STEPS):
    """One rank of the sharded trainer on HSDP_NODES "nodes" (ranks numbered node by node,
    as torchrun does): every rank loads its shards of checkpoint v0 (`start_trainers` with
    no trainer on rank 0, `follow_env` elsewhere), they step on global batches 1 ..
    `steps`, write full checkpoint v{steps} (every rank its own files) and rank 0 keeps the
    gathered weights in `out`/weights.pt."""
    import logging

    import pyarrow as pa

    torch.set_num_threads(1)
    rank, world, local, device = join_env_group(gpu=False)
    logging.basicConfig(level=logging.INFO)
    print(f"rank {rank} of {world}, local rank {local}, {device}", flush=True)
    cfg = _hsdp_cfg(run_root)
    try:
        if rank > 0:
            follow_env(cfg)
            return
        paths = paths_of(cfg)
        group = start_trainers(cfg, None, checkpoint_version=0)
        assert isinstance(group, TrainerGroup) and group.sharded and not group._procs
        weight = next(group.model.parameters())
        mesh = {"shape": list(weight.device_mesh.shape), "dims": weight.device_mesh.mesh_dim_names,
                "placements": [str(p) for p in weight.placements]}  # fmt: skip
        (Path(out) / "mesh.json").write_text(json.dumps(mesh))
        with pa.ipc.open_file(Path(out) / "batches.arrow") as f:
            batches = [f.get_batch(i) for i in range(f.num_record_batches)]
        stats = []
        for step in range(1, steps + 1):
            stats += group.train([pa.Table.from_batches([batches[step - 1]])], seed=step)
        group.save(paths.checkpoint(steps))  # every rank uploads its shard files
        (Path(out) / "stats.json").write_text(json.dumps([s.loss for s in stats]))
        torch.save(dict(group.named_weights()), Path(out) / "weights.pt")
        group.close()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_hsdp_on_two_nodes_of_two_ranks_steps_as_one_process_and_publishes_every_shard(
    s3_root, tmp_path
):
    """train.distributed: fsdp on 2 "nodes" x 2 ranks (4 gloo processes on 127.0.0.1, each
    node with its own cache and temp folder): a 2-D mesh, replicated across the nodes and
    sharded within each. The ranks step as one process within the FSDP tests' tolerances;
    their full checkpoint in S3 has a COMPLETE marker naming every rank's optimizer shard
    (uploaded by that rank from its own node), and one process resumes from it (4 -> 1
    ranks) to one uninterrupted process's weights and AdamW state, and steps on alike."""
    from replayrl.storage import read_manifest

    one = _cfg(s3_root, world=1)
    paths, s, batches = _v0_and_batches(one, STEPS + 1)
    _write_batches(tmp_path / "batches.arrow", batches)

    port, world = free_port(), HSDP_NODES * HSDP_PER_NODE
    ranks = [
        _start_node(r, world, port, s3_root, tmp_path, tmp_path / f"node{r // HSDP_PER_NODE}",
                    local=r % HSDP_PER_NODE, per_node=HSDP_PER_NODE, target="_hsdp_node",
                    log_name=f"log{r}.txt")
        for r in range(world)
    ]  # fmt: skip
    for proc, log in ranks:
        try:
            proc.wait(timeout=NODES_TIMEOUT_S)
        finally:
            proc.kill()
            log.close()
    logs = [(tmp_path / f"node{r // HSDP_PER_NODE}" / f"log{r}.txt").read_text()
            for r in range(world)]  # fmt: skip
    assert [p.returncode for p, _ in ranks] == [0] * world, logs
    assert "4 hybrid-sharded (HSDP) trainers on 2 nodes (gloo)" in logs[0], logs[0]
    assert json.loads((tmp_path / "mesh.json").read_text()) == {
        "shape": [2, 2], "dims": ["replicate", "shard"], "placements": ["R", "S(0)"]
    }  # fmt: skip

    # One process on the same global batches.
    reference = Trainer.load(one, paths, version=0, settings=s)
    initial = {k: v.clone() for k, v in reference.model.state_dict().items()}
    want = [reference.train([batches[i]], seed=i + 1)[0].loss for i in range(STEPS)]
    assert json.loads((tmp_path / "stats.json").read_text()) == pytest.approx(want, rel=1e-4)
    got = torch.load(tmp_path / "weights.pt")  # a tied output layer under one name only
    want_weights = reference.model.state_dict()
    assert got.keys() == {n for n, _ in reference.model.named_parameters()}
    moved = 0.0
    for name, value in got.items():
        assert torch.allclose(value, want_weights[name], atol=RESUMED_ATOL, rtol=0), name
        moved = max(moved, float((value - initial[name]).abs().max()))
    assert moved > 50 * RESUMED_ATOL  # the steps moved far more than the tolerance

    # The marker names every rank's shard (and rank 0's metadata and weights).
    listed = read_manifest(paths.checkpoint(STEPS)).files
    assert listed is not None
    shards = {f"optimizer.dcp.__{r}_0.distcp" for r in range(world)}
    assert shards | {"optimizer.dcp.metadata", "model.safetensors"} <= listed.keys(), listed
    for r in range(world):  # each node read v0 into its own cache; its temp folders are gone
        home = tmp_path / f"node{r // HSDP_PER_NODE}"
        assert any((home / "cache").rglob("*.safetensors")), r
        assert not any((home / "tmp").iterdir()), r

    # 4 -> 1: one process resumes from the sharded checkpoint, then steps on.
    alone = Trainer.load(one, paths, version=STEPS, settings=s)
    for name, value in alone.model.named_parameters():
        assert torch.equal(value, got[name]), name  # the checkpoint holds the trained weights
    worst = _assert_state(alone, reference, steps=STEPS)
    loss = alone.train([batches[STEPS]], seed=STEPS + 1)[0].loss
    assert loss == pytest.approx(reference.train([batches[STEPS]], seed=STEPS + 1)[0].loss,
                                 rel=1e-4)  # fmt: skip
    _assert_state(alone, reference, steps=STEPS + 1)
    print(f"largest weight difference {worst:.2e}, largest move {moved:.2e}")


def test_the_trainjobs_rank_module_under_torchrun_runs_the_trainer_role_on_rank_0(tmp_path):
    """`rank_command`'s module, started the way a TrainJob's pod starts it (torchrun): every
    rank joins and logs as itself, rank 0 runs the asynchronous trainer role (here it finds
    the segment is not the lineage's running one: one line), and the job ends."""
    from replayrl.kfp.trainjob import RANK_MODULE, rank_command

    config = _cfg(str(tmp_path / "runs")).to_yaml()
    command, args = rank_command(config=config, owner="run-1", segment_id="0123456789ab")
    assert command[1:] == ["-m", "torch.distributed.run"]
    launcher = ["--nnodes", "1", "--nproc-per-node", "2", "--master-port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REPLAYRL_CACHE": str(tmp_path / "cache")}
    for name in ENV_RENDEZVOUS:
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, *command[1:], *launcher, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "trainer-rank0 INFO" in out and "trainer-rank1 INFO" in out, out
    assert "replayrl: error: segment 0123456789ab is not the lineage's running segment" in out

    # Started without torchrun: one line, exit code 2.
    alone = subprocess.run(
        [sys.executable, "-m", RANK_MODULE, *args[2:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert alone.returncode == 2, alone.stderr
    assert alone.stderr.strip().splitlines() == [
        "replayrl: error: A trainer rank needs RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT in its environment (torchrun sets them, from the PET_* variables of a "
        "Kubeflow TrainJob); start it with `python -m torch.distributed.run`."
    ]
