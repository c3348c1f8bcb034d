"""ReplayBuffer on real Delta tables in tmp_path: idempotent appends, retention, pinned
sampling, bin-pack, vacuum, usage log, stats and validation errors."""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from replayrl.buffer.retention import retained_mask
from replayrl.buffer.schema import ROLLOUT_SCHEMA, USAGE_SCHEMA, rollout_id, validate_rollouts
from replayrl.buffer.table import ROW_GROUP_ROWS, ReplayBuffer
from replayrl.errors import ReplayRLError

pytestmark = pytest.mark.integration

LINEAGE = "test"


def make_rows(
    iteration: int,
    n_prompts: int,
    group_size: int,
    *,
    policy_version: int | None = None,
    correct_every: int = 2,
) -> pa.Table:
    """A valid rollout table: n_prompts x group_size rows of `iteration`; row k is correct
    when k % correct_every == 0."""
    rows = []
    for p in range(n_prompts):
        for s in range(group_size):
            k = p * group_size + s
            n_tokens = 1 + k % 3
            correct = k % correct_every == 0
            rows.append(
                {
                    "rollout_id": rollout_id(
                        lineage=LINEAGE, iteration=iteration, prompt_index=p, sample_index=s
                    ),
                    "lineage": LINEAGE,
                    "iteration": iteration,
                    "policy_version": iteration if policy_version is None else policy_version,
                    "prompt_id": f"p{p}",
                    "group_id": f"{iteration}-{p}",
                    "prompt": f"{p} + {p} =",
                    "completion": f" {2 * p}",
                    "prompt_token_ids": [1, 2, 3],
                    "completion_token_ids": list(range(n_tokens)),
                    "behavior_logprobs": [-0.5] * n_tokens,
                    "reward": float(correct),
                    "correct": correct,
                    "advantage": 1.0 if correct else -1.0,
                    "finish_reason": "stop",
                    "created_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
                }
            )
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)


def make_usage(iteration: int, ids: list[str], *, train_step: int = 0) -> pa.Table:
    n = len(ids)
    return pa.table(
        {
            "lineage": [LINEAGE] * n,
            "iteration": [iteration] * n,
            "train_step": [train_step] * n,
            "rollout_id": ids,
            "policy_version_at_use": [iteration] * n,
            "rollout_policy_version": [0] * n,
        },
        schema=USAGE_SCHEMA,
    )


def ids_of(table: pa.Table) -> list[str]:
    return table.column("rollout_id").to_pylist()


def data_files(table_dir: Path) -> set[str]:
    return {p.name for p in table_dir.glob("*.parquet")}


@pytest.fixture
def buffer(tmp_path: Path) -> ReplayBuffer:
    return ReplayBuffer(str(tmp_path / "buf"))


def fill(buffer: ReplayBuffer, iterations: range, n_prompts: int = 2, group_size: int = 4) -> int:
    version = -1
    for it in iterations:
        version = buffer.append(make_rows(it, n_prompts, group_size), iteration=it)
    return version


def test_append_is_idempotent(buffer: ReplayBuffer):
    assert buffer.version() is None
    v0 = buffer.append(make_rows(2, 2, 4), iteration=2)
    v1 = buffer.append(make_rows(3, 2, 4), iteration=3)
    first_ids = ids_of(buffer.read())
    v2 = buffer.append(make_rows(3, 2, 4), iteration=3)  # a retried generation
    assert (v0, v1, v2) == (0, 1, 2) and buffer.version() == 2
    table = buffer.read()
    assert table.num_rows == 16
    assert ids_of(table) == first_ids and len(set(first_ids)) == 16
    # A retry with fewer rows replaces the iteration's rows, it does not add to them.
    buffer.append(make_rows(3, 1, 4), iteration=3)
    assert buffer.read().num_rows == 12


def test_append_rejects_rows_of_another_iteration(buffer: ReplayBuffer):
    with pytest.raises(ReplayRLError, match="iteration other than 4"):
        buffer.append(make_rows(3, 1, 2), iteration=4)
    assert buffer.version() is None


def test_fifo_capacity_keeps_freshest(buffer: ReplayBuffer):
    fill(buffer, range(4))  # 4 iterations x 8 rows
    report = buffer.compact(capacity=12, current_policy_version=4)
    kept = buffer.read(version=report.version)
    assert (report.rows_before, report.rows_after, report.rows_deleted) == (32, 12, 20)
    # All of iteration 3, then the 4 smallest rollout ids of iteration 2.
    expected_it2 = sorted(ids_of(make_rows(2, 2, 4)))[:4]
    assert sorted(ids_of(kept)) == sorted(ids_of(make_rows(3, 2, 4)) + expected_it2)
    # Nothing left to drop: no new commit.
    again = buffer.compact(capacity=12, current_policy_version=4)
    assert again.version == report.version and again.rows_deleted == 0


@pytest.mark.parametrize(
    ("capacity", "positive_bias", "max_staleness"),
    [(10, 0.0, None), (13, 0.0, None), (13, 0.5, None), (11, 0.3, 2), (30, 1.0, None)],
)
def test_compact_deletes_exactly_what_retention_drops(
    buffer: ReplayBuffer, capacity, positive_bias, max_staleness
):
    for it in range(4):
        buffer.append(make_rows(it, 2, 4, correct_every=3), iteration=it)
    everything = buffer.read()
    keep = retained_mask(
        iteration=everything.column("iteration").to_numpy(),
        tiebreak=np.array(ids_of(everything), dtype=object),
        policy_version=everything.column("policy_version").to_numpy(),
        correct=everything.column("correct").to_numpy(),
        capacity=capacity,
        positive_bias=positive_bias,
        max_staleness=max_staleness,
        current_policy_version=4,
    )
    report = buffer.compact(
        capacity=capacity,
        positive_bias=positive_bias,
        max_staleness=max_staleness,
        current_policy_version=4,
    )
    expected = sorted(np.array(ids_of(everything))[keep].tolist())
    assert sorted(ids_of(buffer.read(version=report.version))) == expected
    assert report.rows_deleted == int((~keep).sum())


def test_positive_bias_keeps_extra_correct_old_rows(buffer: ReplayBuffer):
    fill(buffer, range(3))  # every other row correct
    report = buffer.compact(capacity=16, positive_bias=0.5, current_policy_version=3)
    kept = buffer.read(version=report.version)
    by_iteration = Counter(kept.column("iteration").to_pylist())
    assert by_iteration == {2: 8, 1: 4, 0: 4}  # 8 FIFO rows + 8 correct older rows
    old = kept.filter(pc.less(kept.column("iteration"), 2))
    assert all(old.column("correct").to_pylist())
    # The report names the rows kept only for the bias: those 8, of versions 0 and 1.
    assert report.bias_rows == 8
    assert report.bias_oldest_policy_version == 0
    assert report.bias_mean_policy_version == pytest.approx(0.5)
    plain = buffer.compact(capacity=16, current_policy_version=3)
    assert plain.bias_rows == 0 and plain.bias_oldest_policy_version is None
    assert math.isnan(plain.bias_mean_policy_version)


def test_max_staleness_drops_old_policy_versions(buffer: ReplayBuffer):
    fill(buffer, range(4))
    report = buffer.compact(capacity=1000, max_staleness=1, current_policy_version=3)
    assert set(buffer.read(version=report.version).column("policy_version").to_pylist()) == {2, 3}
    assert report.rows_after == 16


def test_pinned_version_unaffected_by_later_writes(buffer: ReplayBuffer):
    fill(buffer, range(2))
    pinned = buffer.compact(capacity=100, current_policy_version=2).version
    before = buffer.sample(version=pinned, batch_size=4, num_batches=3, seed=7)
    buffer.append(make_rows(2, 2, 4), iteration=2)
    buffer.compact(capacity=10, current_policy_version=3)
    after = buffer.sample(version=pinned, batch_size=4, num_batches=3, seed=7)
    assert [ids_of(b) for b in before] == [ids_of(b) for b in after]
    assert buffer.read(version=pinned).num_rows == 16


def test_seed_determines_the_draw(buffer: ReplayBuffer):
    version = fill(buffer, range(3))
    draw = [ids_of(b) for b in buffer.sample(version=version, batch_size=6, num_batches=4, seed=1)]
    same = [ids_of(b) for b in buffer.sample(version=version, batch_size=6, num_batches=4, seed=1)]
    other = [ids_of(b) for b in buffer.sample(version=version, batch_size=6, num_batches=4, seed=2)]
    assert draw == same and draw != other
    assert all(len(set(batch)) == 6 for batch in draw)  # no repeats within a batch


def test_epoch_mode_uses_each_row_once(buffer: ReplayBuffer):
    version = fill(buffer, range(3))  # 24 rows
    batches = buffer.sample(version=version, batch_size=6, num_batches=4, seed=0, mode="epoch")
    used = [i for b in batches for i in ids_of(b)]
    assert sorted(used) == sorted(ids_of(buffer.read(version=version)))
    # More draws than rows: a second pass, each row once before any twice, no repeat in a
    # batch.
    batches = buffer.sample(version=version, batch_size=6, num_batches=5, seed=0, mode="epoch")
    used = [i for b in batches for i in ids_of(b)]
    assert sorted(used[:24]) == sorted(ids_of(buffer.read(version=version)))
    assert len(set(used[24:])) == 6
    assert all(len(set(ids_of(b))) == 6 for b in batches)
    with pytest.raises(ReplayRLError, match="epoch sampling needs batch_size \\(25\\)"):
        buffer.sample(version=version, batch_size=25, num_batches=1, seed=0, mode="epoch")


def test_uniform_mode_reuses_rows_across_batches(buffer: ReplayBuffer):
    version = fill(buffer, range(1))  # 8 rows
    batches = buffer.sample(version=version, batch_size=6, num_batches=4, seed=0)
    used = [i for b in batches for i in ids_of(b)]
    assert len(used) == 24 and len(set(used)) <= 8  # 24 draws from 8 rows must repeat
    with_replacement = buffer.sample(
        version=version, batch_size=20, num_batches=1, seed=0, replace=True
    )
    assert with_replacement[0].num_rows == 20
    assert with_replacement[0].schema.names == ROLLOUT_SCHEMA.names
    with pytest.raises(ReplayRLError, match="replace=True"):
        buffer.sample(version=version, batch_size=20, num_batches=1, seed=0)


def test_sample_same_rows_before_and_after_bin_pack(buffer: ReplayBuffer, tmp_path: Path):
    version = fill(buffer, range(6))
    before = buffer.sample(version=version, batch_size=5, num_batches=3, seed=3)
    report = buffer.compact(capacity=1000, current_policy_version=6, min_files_to_compact=2)
    assert report.files_before == 6 and report.files_after == 1 and report.files_compacted == 6
    after = buffer.sample(version=report.version, batch_size=5, num_batches=3, seed=3)
    assert [b.to_pylist() for b in before] == [b.to_pylist() for b in after]
    picked = buffer.sample(
        version=report.version, batch_size=5, num_batches=1, seed=3, columns=["reward"]
    )
    assert picked[0].column_names == ["reward"]


def test_every_written_file_has_small_row_groups(buffer: ReplayBuffer):
    """Append, the retention delete and the bin-pack all write row groups of at most
    ROW_GROUP_ROWS rows (a scan decodes one row group at a time: huge groups cost memory)."""
    from deltalake import DeltaTable

    group_size = 8
    n_prompts = ROW_GROUP_ROWS // group_size + 50  # one iteration > one row group
    for it in range(2):
        buffer.append(make_rows(it, n_prompts, group_size), iteration=it)
    report = buffer.compact(
        capacity=n_prompts * group_size + 100, current_policy_version=2, min_files_to_compact=1
    )
    assert report.rows_deleted == n_prompts * group_size - 100 and report.files_compacted >= 1
    groups = [
        pq.ParquetFile(uri).metadata.row_group(i).num_rows
        for uri in DeltaTable(buffer.rollouts_uri).file_uris()
        for i in range(pq.ParquetFile(uri).metadata.num_row_groups)
    ]
    assert sum(groups) == report.rows_after and len(groups) >= 2
    assert max(groups) <= ROW_GROUP_ROWS


def test_sample_does_not_depend_on_write_order(tmp_path: Path):
    forward, backward = ReplayBuffer(str(tmp_path / "f")), ReplayBuffer(str(tmp_path / "b"))
    rng = np.random.default_rng(0)
    for it in range(3):
        forward.append(make_rows(it, 2, 4), iteration=it)
    for it in reversed(range(3)):
        rows = make_rows(it, 2, 4)
        backward.append(rows.take(rng.permutation(rows.num_rows)), iteration=it)
    draws = [
        [ids_of(b) for b in buf.sample(version=2, batch_size=5, num_batches=2, seed=4)]
        for buf in (forward, backward)
    ]
    assert draws[0] == draws[1]


def test_vacuum_waits_for_grace_period(buffer: ReplayBuffer, tmp_path: Path):
    table_dir = tmp_path / "buf" / "rollouts"
    pinned = fill(buffer, range(4))
    files_at_pin = data_files(table_dir)
    within = buffer.compact(capacity=8, current_policy_version=4, min_files_to_compact=1)
    assert within.files_vacuumed == 0 and data_files(table_dir) >= files_at_pin
    assert buffer.read(version=pinned).num_rows == 32  # pinned version still readable
    after = buffer.compact(
        capacity=8, current_policy_version=4, min_files_to_compact=1, vacuum_grace_s=0
    )
    assert after.files_vacuumed > 0
    assert len(data_files(table_dir)) == after.files_after
    assert buffer.read(version=after.version).num_rows == 8
    with pytest.raises(ReplayRLError, match="vacuum"):
        buffer.sample(version=pinned, batch_size=2, num_batches=1, seed=0)


def test_usage_logging_is_idempotent_and_feeds_stats(buffer: ReplayBuffer):
    version = fill(buffer, range(2), n_prompts=1, group_size=4)  # 8 rows, versions 0 and 1
    ids = sorted(ids_of(buffer.read(version=version)))
    buffer.log_usage(make_usage(1, [ids[0], ids[0], ids[1]]), iteration=1)
    buffer.log_usage(make_usage(1, [ids[0], ids[0], ids[1]]), iteration=1)  # retried
    buffer.log_usage(make_usage(2, [ids[0], ids[2]]), iteration=2)
    stats = buffer.stats(current_policy_version=3, version=version)
    assert stats.version == version and stats.rows == 8 and stats.files == 2
    assert stats.bytes > 0
    assert stats.age_histogram == {3: 4, 2: 4}
    # ids[0] used 3 times, ids[1] and ids[2] once, 5 rows never.
    assert stats.reuse_counts == {0: 5, 1: 2, 3: 1}
    assert stats.mean_reward == pytest.approx(0.5) and stats.frac_correct == pytest.approx(0.5)
    assert stats.as_dict()["rows"] == 8
    report = buffer.compact(capacity=100, current_policy_version=3, min_files_to_compact=2)
    assert report.usage_files_compacted == 2


def test_usage_of_reads_the_asked_rows_uses_in_an_iteration_window(buffer: ReplayBuffer):
    ids = sorted(ids_of(buffer.read(version=fill(buffer, range(2), n_prompts=1, group_size=4))))
    assert buffer.usage_of(pa.array(ids), first_iteration=0, before_iteration=9).num_rows == 0
    buffer.log_usage(make_usage(1, [ids[0], ids[1]], train_step=2), iteration=1)
    buffer.log_usage(make_usage(2, [ids[0], ids[2]], train_step=1), iteration=2)
    buffer.log_usage(make_usage(3, [ids[0]]), iteration=3)  # e.g. a retried iteration's own
    uses = buffer.usage_of(pa.array([ids[0], ids[2]]), first_iteration=1, before_iteration=3)
    assert uses.schema == USAGE_SCHEMA
    got = sorted(zip(ids_of(uses), uses.column("train_step").to_pylist(), strict=True))
    assert got == sorted([(ids[0], 2), (ids[0], 1), (ids[2], 1)])
    assert ids_of(buffer.usage_of(pa.array(ids), first_iteration=2, before_iteration=3)) in (
        [ids[0], ids[2]],
        [ids[2], ids[0]],
    )


def test_stats_of_empty_buffer_and_missing_table(buffer: ReplayBuffer):
    with pytest.raises(ReplayRLError, match="append rows first"):
        buffer.stats(current_policy_version=0)
    buffer.append(make_rows(0, 0, 4), iteration=0)
    stats = buffer.stats(current_policy_version=0)
    assert stats.rows == 0 and stats.reuse_counts == {} and math.isnan(stats.mean_reward)
    with pytest.raises(ReplayRLError, match="holds no rollouts"):
        buffer.sample(version=stats.version, batch_size=1, num_batches=1, seed=0)


def test_missing_version_names_table_and_fix(buffer: ReplayBuffer):
    fill(buffer, range(1))
    with pytest.raises(ReplayRLError, match=r"version 9 of .*rollouts cannot be loaded"):
        buffer.sample(version=9, batch_size=1, num_batches=1, seed=0)


def test_unwritable_root_names_uri(tmp_path: Path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    buffer = ReplayBuffer(f"file://{blocker}/buf")
    with pytest.raises(ReplayRLError, match=r"a_file/buf/rollouts.*writable"):
        buffer.append(make_rows(0, 1, 2), iteration=0)


def test_file_uri_root(tmp_path: Path):
    buffer = ReplayBuffer(f"file://{tmp_path}/buf/")
    buffer.append(make_rows(0, 1, 2), iteration=0)
    assert (tmp_path / "buf" / "rollouts" / "_delta_log").is_dir()
    assert buffer.read().num_rows == 2


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t.drop_columns(["reward"]), "missing column.*reward"),
        (lambda t: t.append_column("extra", pa.array([1] * t.num_rows)), "unknown column.*extra"),
        (
            lambda t: t.set_column(0, "rollout_id", pa.array(["x"] * t.num_rows)),
            "rollout_id.*duplicate",
        ),
        (
            lambda t: t.set_column(0, "rollout_id", pa.array([None] * t.num_rows, pa.string())),
            "'rollout_id' has 4 null",
        ),
        (
            lambda t: t.set_column(
                t.schema.get_field_index("behavior_logprobs"),
                "behavior_logprobs",
                pa.array([[0.0] * 5] * t.num_rows, pa.list_(pa.float32())),
            ),
            "'behavior_logprobs' of rollout_id '[0-9a-f]{20}' has 5",
        ),
        (
            lambda t: t.set_column(
                t.schema.get_field_index("advantage"),
                "advantage",
                pa.array([float("nan"), float("nan"), 0.0, 1.0], pa.float32()),
            ),
            "'advantage' has 2 NaN",
        ),
        (
            lambda t: t.set_column(
                t.schema.get_field_index("iteration"), "iteration", pa.array(["x"] * 4)
            ),
            "'iteration' has type string",
        ),
    ],
)
def test_validation_errors_name_the_column(buffer: ReplayBuffer, mutate, message):
    with pytest.raises(ReplayRLError, match=message):
        buffer.append(mutate(make_rows(0, 1, 4)), iteration=0)
    assert buffer.version() is None  # nothing written


def test_validate_rollouts_casts_to_schema():
    rows = make_rows(0, 1, 2).cast(
        ROLLOUT_SCHEMA.set(
            ROLLOUT_SCHEMA.get_field_index("reward"), pa.field("reward", pa.float64())
        )
    )
    assert (
        validate_rollouts(rows.select(list(reversed(rows.column_names)))).schema == ROLLOUT_SCHEMA
    )
