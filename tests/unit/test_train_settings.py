"""`train_settings.step_settings` (the step settings of a config, importable without pyarrow)
gives every preset the settings the engine's steps give it on this machine (they call it:
one definition), and resolves train.dtype for the device it is asked about."""

from __future__ import annotations

from pathlib import Path

import pytest

from replayrl.config import load_config
from replayrl.engine.resources import device
from replayrl.engine.steps import step_settings as engine_settings
from replayrl.errors import ReplayRLError
from replayrl.policy.train_settings import step_settings

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_preset_gets_the_engines_settings(preset):
    cfg = load_config(REPO / "configs" / preset)
    assert step_settings(cfg, device=device()) == engine_settings(cfg)


def test_the_dtype_is_resolved_for_the_device_asked_about():
    cfg = load_config(REPO / "configs" / "qwen2.5-0.5b-gsm8k.yaml")
    assert cfg.train.dtype == "auto"
    assert step_settings(cfg, device="cuda").dtype == "bfloat16"
    assert step_settings(cfg, device="cpu").dtype == "float32"
    bf16 = load_config(
        REPO / "configs" / "qwen2.5-0.5b-gsm8k.yaml", overrides=["train.dtype=bfloat16"]
    )
    with pytest.raises(ReplayRLError, match="needs a CUDA GPU"):
        step_settings(bf16, device="cpu")
