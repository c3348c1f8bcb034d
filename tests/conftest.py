"""Every test runs with the Hugging Face hub offline: no code path may download a model or
data on CPU, and a test that needs a hub name builds a local hub cache (see
tests/integration/test_hub_inputs.py). Set before any test module imports huggingface_hub,
which reads it once; subprocesses inherit it."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
