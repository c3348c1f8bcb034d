# The README's three commands: `make setup`, `make run`, `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run run-on-policy test test-unit lint format clean

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

test:
	$(BIN)/python -m pytest tests

test-unit:
	$(BIN)/python -m pytest tests/unit -q

lint:
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

format:
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

clean:
	rm -rf runs .pytest_cache
