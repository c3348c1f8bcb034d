"""Hugging Face hub names (`model.source: owner/name`, `task.path: owner/dataset`), offline:
the test builds a local hub cache (the layout huggingface_hub writes) and runs with
HF_HUB_OFFLINE=1 and every socket refused, so nothing is downloaded. A lineage takes the
model into its checkpoint v0 and the dataset split into `inputs/dataset.parquet` once,
records the commits both resolved to, and its later steps read only the run root."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from replayrl import storage
from replayrl.config import hub_id, load_config
from replayrl.engine import inputs
from replayrl.engine.lineage import open_lineage
from replayrl.errors import ReplayRLError
from replayrl.policy import hub
from replayrl.policy.tiny_model import build_tiny_model, save_model
from replayrl.policy.tokenizer import build_byte_tokenizer

pytestmark = pytest.mark.integration

PRESET = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
MODEL_SHA = "1" * 40
DATA_SHA = "2" * 40
# A dataset card as the hub's viewer reads it (OpenR1-Math-220k's own has this shape).
CARD = """---
license: apache-2.0
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
- config_name: extended
  data_files:
  - split: train
    path: extended/train-*
---
# Math rows
"""


def _rows(start: int, count: int) -> pa.Table:
    return pa.table(
        {
            "problem": [f"What is ${i} + {i}$?" for i in range(start, start + count)],
            "solution": [f"It is $\\boxed{{{2 * i}}}$." for i in range(start, start + count)],
            "answer": [str(2 * i) for i in range(start, start + count)],
        }
    )


def build_hub_cache(root: Path) -> Path:
    """A huggingface_hub cache holding `test-org/tiny-model` and `test-org/math-rows` at the
    commits above, their `main` refs pointing there."""
    model = root / "models--test-org--tiny-model"
    snapshot = model / "snapshots" / MODEL_SHA
    torch.manual_seed(0)
    tiny = build_tiny_model(
        vocab_size=264, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        intermediate_size=64, max_position_embeddings=256, seed=0,
    )  # fmt: skip
    save_model(tiny, build_byte_tokenizer(), snapshot)
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text(MODEL_SHA)

    data = root / "datasets--test-org--math-rows"
    snapshot = data / "snapshots" / DATA_SHA
    (snapshot / "data").mkdir(parents=True)
    (snapshot / "extended").mkdir()
    (snapshot / "README.md").write_text(CARD)
    # The default config's train split in two shards; the extended config must not be read.
    pq.write_table(_rows(0, 30), snapshot / "data" / "train-00000-of-00002.parquet")
    pq.write_table(_rows(30, 30), snapshot / "data" / "train-00001-of-00002.parquet")
    pq.write_table(_rows(1000, 5), snapshot / "extended" / "train-00000-of-00001.parquet")
    (data / "refs").mkdir()
    (data / "refs" / "main").write_text(DATA_SHA)
    return root


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    cache = build_hub_cache(tmp_path / "hf-hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as constants

    # huggingface_hub reads both variables once, at import.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))

    def refuse(*args, **kwargs):
        raise AssertionError(f"the test tried to reach the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    hub.download_model.cache_clear()
    hub.download_dataset.cache_clear()
    yield cache
    hub.download_model.cache_clear()
    hub.download_dataset.cache_clear()


def hub_config(tmp_path: Path, *extra: str):
    return load_config(
        PRESET,
        overrides=[
            f"storage.run_root={tmp_path / 'runs'}",
            f"model.cache_dir={tmp_path / 'cache'}",
            "model.source=test-org/tiny-model",
            "task.name=math",
            "task.path=test-org/math-rows",
            "task.options={}",
            "task.num_train=40",
            "task.num_eval=8",
            "eval.num_prompts=8",
            "rollout.prompts_per_iteration=4",
            "rollout.max_new_tokens=4",
            "buffer.capacity=64",
            "train.batch_size=16",
            *extra,
        ],
    )


def test_a_lineage_takes_hub_names_once_and_records_their_commits(tmp_path, offline_hub):
    cfg = hub_config(tmp_path)
    paths, state, tracker = open_lineage(cfg, evaluate_initial=False)

    # The model is the lineage's v0, weight for weight.
    snapshot = offline_hub / "models--test-org--tiny-model" / "snapshots" / MODEL_SHA
    v0 = Path(storage.checkpoint_files_uri(paths.checkpoint(0)))
    assert storage.is_complete(paths.checkpoint(0))
    want, got = load_file(snapshot / "model.safetensors"), load_file(v0 / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    # The default config's train split, both shards and nothing of `extended`, in one file.
    copy = pq.read_table(paths.dataset)
    assert copy.num_rows == 60
    assert set(copy.column("answer").to_pylist()) == {str(2 * i) for i in range(60)}

    recorded = json.loads(Path(paths.hub_record).read_text())
    assert recorded == {
        "model": {"repo_id": "test-org/tiny-model", "requested": None, "revision": MODEL_SHA},
        "dataset": {"repo_id": "test-org/math-rows", "requested": None, "revision": DATA_SHA},
    }
    params = MlflowClient(state.tracking_uri).get_run(state.mlflow_run_id).data.params
    assert params["hub.model_revision"] == MODEL_SHA
    assert params["hub.dataset_revision"] == DATA_SHA
    assert params["model.source"] == "test-org/tiny-model"

    # Later steps (another pod) read the run root only: with the hub cache gone, the task's
    # prompts come from the lineage's copy, the same ones.
    splits = inputs.task_splits(cfg)
    shutil.rmtree(offline_hub)
    shutil.rmtree(tmp_path / "cache" / "hub-datasets")
    hub.download_model.cache_clear()
    hub.download_dataset.cache_clear()
    assert inputs.task_splits(cfg) == splits
    # And a resumed lineage downloads nothing either.
    paths2, state2, _ = open_lineage(cfg, evaluate_initial=False)
    assert state2.mlflow_run_id == state.mlflow_run_id


def test_a_revision_is_pinned_and_a_missing_one_fails_in_one_line(tmp_path, offline_hub):
    cfg = hub_config(
        tmp_path, f"model.revision={MODEL_SHA}", "task.dataset_config=extended",
        "task.num_train=3", "task.num_eval=2", "eval.num_prompts=2",
        "rollout.prompts_per_iteration=2", "buffer.capacity=16", "train.batch_size=16",
    )  # fmt: skip
    download = inputs.hub_dataset(cfg)
    assert download.revision == DATA_SHA
    assert pq.read_table(download.local).num_rows == 5  # the extended config only

    missing = hub_config(tmp_path, "model.revision=v2.0")
    with pytest.raises(
        ReplayRLError, match=r"'test-org/tiny-model' at revision 'v2.0' is not in the local"
    ):
        open_lineage(missing, evaluate_initial=False)
    # Refused before the lineage's first byte.
    lineage_root = storage.lineage_paths(missing.storage.run_root, missing.lineage).root
    assert not Path(lineage_root).exists()
    with pytest.raises(
        ReplayRLError, match=r"no config 'nope'; its configs: \['default', 'extended'\]"
    ):
        inputs.hub_dataset(hub_config(tmp_path, "task.dataset_config=nope"))
    with pytest.raises(ReplayRLError, match=r"no split 'test'; its splits: \['train'\]"):
        inputs.hub_dataset(hub_config(tmp_path, "task.dataset_split=test"))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B"),
        ("hf://open-r1/OpenR1-Math-220k", "open-r1/OpenR1-Math-220k"),
        ("tiny", None),
        ("s3://bucket/models/Qwen3-0.6B", None),
        ("/models/qwen", None),
        ("./models/qwen", None),
        ("data/train.parquet", None),
        ("runs/alpha/checkpoints/v000001", None),
        (None, None),
    ],
)
def test_which_names_are_hub_ids(name, expected):
    assert hub_id(name) == expected


def test_an_existing_local_directory_is_never_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub_id("models/qwen") is None
    assert hub_id("hf://models/qwen") == "models/qwen"


def test_split_patterns_follow_the_card_or_the_usual_file_names():
    assert hub.split_patterns(CARD, None, "train") == ["data/train-*"]
    assert hub.split_patterns(CARD, "extended", "train") == ["extended/train-*"]
    assert "data/test-*" in hub.split_patterns("# no metadata", None, "test")
    one = "---\nconfigs:\n- config_name: a\n  data_files: a/*.parquet\n---\n"
    assert hub.split_patterns(one, None, "train") == ["a/*.parquet"]
    two = (
        "---\nconfigs:\n- config_name: a\n  data_files: a/*\n"
        "- config_name: b\n  data_files: b/*\n---\n"
    )
    with pytest.raises(ReplayRLError, match=r"configs \['a', 'b'\] and none is the default"):
        hub.split_patterns(two, None, "train")


def test_hub_only_settings_are_refused_for_local_inputs(tmp_path):
    with pytest.raises(ReplayRLError, match="model.revision applies to a Hugging Face hub id only"):
        load_config(PRESET, overrides=["model.revision=main"])
    with pytest.raises(ReplayRLError, match="task.dataset_config .* dataset id only"):
        load_config(PRESET, overrides=["task.dataset_config=extended"])
