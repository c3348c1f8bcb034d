"""What a pipeline's `config` parameter accepts, as the KFP UI's run form sends it.

The form's text fields are one line: a preset pasted into one loses its line breaks, and as
every preset starts with `#` comments, the flattened text is one YAML comment. It used to
load the defaults (the tiny demo) under the user's lineage, silently; now the first task
refuses it with one line that says what to paste: the one-line JSON of
`replayrl config json FILE` (which loads to the same config), or an s3:// URI of the file."""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_helpers import cli

from replayrl import storage
from replayrl.config import load_config
from replayrl.errors import ReplayRLError
from replayrl.kfp import runtime

pytestmark = pytest.mark.integration
PRESETS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
IDS = [p.stem for p in PRESETS]


@pytest.mark.parametrize("preset", PRESETS, ids=IDS)
@pytest.mark.parametrize("join", [" ", ""], ids=["breaks-to-spaces", "breaks-removed"])
def test_a_flattened_preset_is_refused_in_one_line_never_defaulted(preset, join):
    flat = join.join(preset.read_text().splitlines())
    assert flat.lstrip().startswith("#")  # why it parses to nothing
    with pytest.raises(ReplayRLError) as err:
        runtime.resolve(flat, lineage="mine", run_root="s3://bucket/runs")
    message = str(err.value)
    assert "\n" not in message
    assert "replayrl config json FILE" in message and "s3://" in message


@pytest.mark.parametrize("text", ["# only a comment", "[1, 2]", "just words", "42"])
def test_a_config_that_is_not_a_mapping_is_refused(text):
    with pytest.raises(ReplayRLError, match="replayrl config json FILE"):
        runtime.resolve(text)


def test_empty_is_still_the_built_in_demo():
    assert runtime.resolve("").to_dict() == runtime.resolve("{}").to_dict()


@pytest.mark.parametrize("preset", PRESETS, ids=IDS)
def test_config_json_prints_one_line_that_loads_to_the_same_config(preset):
    proc = cli("config", "json", str(preset), timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.rstrip("\n")
    assert line and "\n" not in line
    assert load_config(text=line).to_dict() == load_config(preset).to_dict()
    # ... and that line, as the run form sends it, is what the pipeline runs.
    got = runtime.resolve(line, lineage="mine")
    assert got.storage.lineage == "mine"
    assert got.train == load_config(preset).train and got.arm == load_config(preset).arm


def test_config_json_of_a_missing_file_is_one_line():
    proc = cli("config", "json", "no/such.yaml", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "replayrl: error: Config file 'no/such.yaml' does not exist."
    ]


def test_an_s3_uri_of_a_preset_is_the_preset(s3_root):
    preset = Path(__file__).parents[2] / "configs" / "qwen2.5-0.5b-gsm8k.yaml"
    uri = f"{s3_root}/configs/{preset.name}"
    storage.write_bytes_atomic(uri, preset.read_bytes())
    got = runtime.resolve(uri, run_root=f"{s3_root}/runs")
    want = load_config(preset)
    assert got.train == want.train and got.rollout == want.rollout and got.task == want.task
    assert got.storage.run_root == f"{s3_root}/runs"
