"""bench/gpu_smoke.sh checks its inputs: on a machine without a GPU it stops at once with exit
code 2 and one line saying why; and the model it builds is Qwen2.5-0.5B's architecture."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_exits_2_with_one_line():
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_smoke.sh"), sys.executable],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_smoke: "), done.stderr
    assert "GPU" in lines[0] or "nvidia-smi" in lines[0] or "vllm" in lines[0]


def test_the_smokes_build_qwen2_5_0_5b_from_the_published_configuration():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from replayrl.policy.memory_plan import published_config

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**published_config("qwen2.5-0.5b")))
    # Qwen2.5-0.5B's published parameter count (embeddings tied to the output layer).
    assert sum(p.numel() for p in model.parameters()) == 494_032_768
