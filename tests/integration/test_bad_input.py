"""Bad input: damaged Parquet files, a truncated checkpoint, wrong credentials, a missing
bucket, undecodable and enormous completions, NaN rewards, an empty buffer at train time.
Each gets a clear error naming the object and the fix, or is handled; nothing already
stored is lost; `replayrl buffer check|repair|vacuum|stats|inspect` show and repair state."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from fault_helpers import cli, crash_config, rows

from replayrl import storage
from replayrl.buffer.schema import ROLLOUT_SCHEMA
from replayrl.buffer.table import ReplayBuffer
from replayrl.errors import ReplayRLError

pytestmark = pytest.mark.integration
PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"


@pytest.fixture(params=["local", "s3"])
def buffer(request, tmp_path) -> ReplayBuffer:
    if request.param == "local":
        return ReplayBuffer(str(tmp_path / "buf"))
    root = storage.join(request.getfixturevalue("s3_root"), "buf")
    return ReplayBuffer(root, storage_options=storage.delta_storage_options(root))


def data_file(buf: ReplayBuffer, iteration: int) -> str:
    """Relative path of the rollouts file holding `iteration` (one file per append)."""
    table = buf._open(buf.rollouts_uri)
    actions = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    return next(a["path"] for a in actions if a["min.iteration"] == iteration)


def overwrite(buf: ReplayBuffer, relative: str, transform) -> None:
    uri = storage.join(buf.rollouts_uri, relative)
    storage.write_bytes_atomic(uri, transform(storage.read_bytes(uri)))


@pytest.mark.parametrize(
    "damage,problem",
    [
        (lambda b: b[: len(b) // 2], "bytes, the log says"),  # truncated copy
        (lambda b: bytes(len(b)), "not readable as Parquet"),  # same size, zeros
    ],
)
def test_damaged_parquet_is_named_then_set_aside_keeping_every_other_row(buffer, damage, problem):
    for it in (1, 2, 3):
        buffer.append(rows(it), iteration=it)
    bad = data_file(buffer, 2)
    overwrite(buffer, bad, damage)
    with pytest.raises(ReplayRLError) as err:
        buffer.read()
    message = str(err.value)
    assert bad in message and problem in message and "replayrl buffer repair" in message
    with pytest.raises(ReplayRLError, match="buffer repair"):
        buffer.compact(capacity=100, current_policy_version=3, min_files_to_compact=1)
    [found] = buffer.check()
    assert (found.table, found.path, found.rows) == ("rollouts", bad, 8)
    assert buffer.repair(dry_run=True) == [found]
    assert buffer.repair() == [found]
    kept = buffer.read()
    assert sorted(set(kept.column("iteration").to_pylist())) == [1, 3] and kept.num_rows == 16
    assert buffer.check() == []
    # the damaged bytes are kept for forensics, outside the table
    assert storage.exists(storage.join(buffer.root_uri, "quarantine", "rollouts", bad))
    # the lineage can regenerate the lost iteration: append replaces it as usual
    buffer.append(rows(2), iteration=2)
    assert buffer.read().num_rows == 24


def test_nan_rewards_are_refused_and_nothing_stored_is_lost(tmp_path):
    buf = ReplayBuffer(str(tmp_path / "buf"))
    buf.append(rows(1), iteration=1)
    version = buf.version()
    bad = rows(2).set_column(
        ROLLOUT_SCHEMA.get_field_index("reward"),
        ROLLOUT_SCHEMA.field("reward"),
        pa.array([1.0, float("nan")] * 4, pa.float32()),
    )
    with pytest.raises(ReplayRLError, match=r"'reward' has 4 NaN value\(s\).*return 0"):
        buf.append(bad, iteration=2)
    assert buf.version() == version and buf.read().num_rows == 8


def test_completions_that_are_not_utf8(tmp_path):
    """A byte-level model can emit bytes that are not UTF-8: the text gets U+FFFD, the token
    ids keep the bytes; a producer handing over raw non-UTF-8 bytes is told which column."""
    from replayrl.policy.tokenizer import build_byte_tokenizer

    tok = build_byte_tokenizer()
    ids = [32, 0xFF, 0xFE, 52, 0xC3]  # " ", two bytes UTF-8 never uses, "4", a cut-off lead byte
    text = tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" in text and "4" in text
    buf = ReplayBuffer(str(tmp_path / "buf"))
    stored = rows(1, completion=text, tokens=len(ids))
    stored = stored.set_column(
        ROLLOUT_SCHEMA.get_field_index("completion_token_ids"),
        ROLLOUT_SCHEMA.field("completion_token_ids"),
        pa.array([ids] * 8, pa.list_(pa.int32())),
    )
    buf.append(stored, iteration=1)
    back = buf.read()
    assert back.column("completion").to_pylist() == [text] * 8
    assert back.column("completion_token_ids").to_pylist() == [ids] * 8
    raw = stored.set_column(
        ROLLOUT_SCHEMA.get_field_index("completion"),
        "completion",
        pa.array([b"\xff\xfe 42"] * 8, pa.binary()),
    )
    with pytest.raises(ReplayRLError, match="'completion' has type binary"):
        buf.append(raw, iteration=2)
    assert buf.read().num_rows == 8


def test_enormous_completions_round_trip_and_compact(tmp_path):
    buf = ReplayBuffer(str(tmp_path / "buf"))
    huge = "9" * (4 * 2**20)  # 4 MiB of text per row
    for it in (1, 2):
        buf.append(rows(it, n=3, completion=huge, tokens=50_000), iteration=it)
    report = buf.compact(capacity=100, current_policy_version=2, min_files_to_compact=2)
    assert report.rows_after == 6 and report.files_compacted == 2
    [batch] = buf.sample(version=report.version, batch_size=6, num_batches=1, seed=0)
    assert batch.column("completion").to_pylist() == [huge] * 6
    assert {len(x) for x in batch.column("behavior_logprobs").to_pylist()} == {50_000}


def test_empty_buffer_at_train_time_is_a_clear_error(tmp_path):
    from replayrl.engine import inputs, steps
    from replayrl.engine.lineage import open_lineage

    cfg = crash_config(tmp_path, str(tmp_path / "runs"))
    paths, state, _ = open_lineage(cfg)
    buf = inputs.replay_buffer(paths)
    buf.append(rows(1, n=0), iteration=1)  # an iteration that produced nothing
    with pytest.raises(ReplayRLError, match="holds no rollouts.*generate"):
        steps.train(cfg, paths, iteration=1, policy_version=0, buffer_version=buf.version())
    assert storage.complete_versions(paths) == [0]  # no checkpoint was written


@pytest.mark.slow
def test_damaged_buffer_and_truncated_checkpoint_in_a_lineage(tmp_path):
    from replayrl.engine.inline import run_inline

    root = str(tmp_path / "runs")
    cfg = crash_config(tmp_path, root, "iterations=2", "buffer.positive_bias=0.0")
    run_inline(cfg)
    paths = storage.lineage_paths(root, cfg.lineage)
    buf = ReplayBuffer(paths.buffer)
    stats = json.loads(cli("buffer", "stats", "--run-root", root, "--lineage", cfg.lineage).stdout)
    assert stats["rows"] == 64
    lines = cli("buffer", "inspect", "--run-root", root, "--lineage", cfg.lineage, "--limit", "3")
    assert len(lines.stdout.splitlines()) == 3
    assert cli("buffer", "check", "--run-root", root, "--lineage", cfg.lineage).returncode == 0

    # a data file truncated behind the lineage's back
    bad = next(iter(pa.table(buf._open(buf.rollouts_uri).get_add_actions()).column("path")))
    path = Path(paths.buffer) / "rollouts" / str(bad)
    path.write_bytes(path.read_bytes()[:100])
    check = cli("buffer", "check", "--run-root", root, "--lineage", cfg.lineage)
    assert check.returncode == 2 and str(bad) in check.stdout and "buffer repair" in check.stderr
    resumed = crash_config(tmp_path, root, "iterations=3", "buffer.positive_bias=0.0")
    with pytest.raises(ReplayRLError) as err:
        run_inline(resumed)
    assert str(bad) in str(err.value) and "replayrl buffer repair" in str(err.value)
    repair = cli("buffer", "repair", "--run-root", root, "--lineage", cfg.lineage)
    assert repair.returncode == 0 and "moved 1 damaged file(s)" in repair.stderr
    vacuum = cli("buffer", "vacuum", "--run-root", root, "--lineage", cfg.lineage, "--grace-s", "0")
    assert vacuum.returncode == 0 and "rollouts" in json.loads(vacuum.stdout)

    # a published checkpoint damaged afterwards: named, with the fix, no traceback
    weights = Path(storage.checkpoint_files_uri(paths.checkpoint(2))) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ReplayRLError) as err:
        run_inline(resumed)
    message = str(err.value)
    assert "v000002" in message and "model.safetensors' is damaged: it has 1000 bytes" in message
    assert storage.read_state(paths).next_iteration == 3  # nothing advanced


def test_wrong_credentials_and_missing_bucket_stop_a_run_before_it_writes(
    tmp_path, s3_root, s3_server, monkeypatch
):
    from replayrl.engine.inline import run_inline

    bad_secret = "not-the-secret-" + "z" * 16
    with monkeypatch.context() as m:
        m.setenv("AWS_SECRET_ACCESS_KEY", bad_secret)
        with pytest.raises(ReplayRLError, match="rejected the credentials") as err:
            run_inline(crash_config(tmp_path, s3_root))
    assert bad_secret not in str(err.value)
    with pytest.raises(ReplayRLError, match="bucket 'no-such-bucket' does not exist.*mb"):
        run_inline(crash_config(tmp_path, "s3://no-such-bucket/runs"))
    # nothing was written under the run root
    assert s3_server.keys(s3_root.split("/", 3)[3]) == []


def test_files_rewritten_by_a_delete_store_string_view_and_still_read(tmp_path):
    """delta-rs rewrites a file that a retention delete cuts through with rollout_id as
    string_view; reads, stats and sampling must not trip over the mixed types."""
    import glob

    import pyarrow.parquet as pq

    buf = ReplayBuffer(str(tmp_path / "buf"))
    for it in (1, 2, 3):
        buf.append(rows(it), iteration=it)
    buf.compact(capacity=100, current_policy_version=3, min_files_to_compact=2)  # one file
    buf.append(rows(4), iteration=4)
    report = buf.compact(capacity=16, current_policy_version=4, min_files_to_compact=100)
    types = {
        str(pq.read_schema(f).field("rollout_id").type)
        for f in glob.glob(str(tmp_path / "buf" / "rollouts" / "*.parquet"))
    }
    assert "string_view" in types  # the layout this test is about
    assert sorted(set(buf.read().column("iteration").to_pylist())) == [3, 4]
    assert buf.stats(current_policy_version=4).rows == 16
    batches = buf.sample(version=report.version, batch_size=16, num_batches=2, seed=0)
    assert [b.num_rows for b in batches] == [16, 16]
