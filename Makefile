# parc developer entry points; `make help` lists them.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST := $(BIN)/python -m pytest
DEMO   := out/demo

.PHONY: help setup test test-all demo bench lint format clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-9s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[cpu,dev]'
	@touch $(STAMP)

setup: $(STAMP)  ## create .venv and install parc with the cpu and dev extras

test: $(STAMP)  ## run the fast test suite (what CI runs)
	$(PYTEST) -q -n 2 -m "not slow"

test-all: $(STAMP)  ## run every test, slow ones included (large models, full ONNX node suite)
	$(PYTEST) -q -n 2

demo: $(STAMP)  ## build a small GPT, make a training step, plan it (8 GPUs), explain it, run it on 4 CPU ranks, verify it
	@rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(BIN)/parc models build gpt-tiny -o $(DEMO)/gpt-tiny.onnx
	$(BIN)/parc inspect $(DEMO)/gpt-tiny.onnx
	$(BIN)/parc grad $(DEMO)/gpt-tiny.onnx --optimizer momentum --lr 0.1 -o $(DEMO)/gpt-tiny.train.onnx
	$(BIN)/parc inspect $(DEMO)/gpt-tiny.train.onnx
	$(BIN)/parc plan $(DEMO)/gpt-tiny.train.onnx --devices 8xa100-80g -o $(DEMO)/plan8
	$(BIN)/parc explain $(DEMO)/plan8
	$(BIN)/parc plan $(DEMO)/gpt-tiny.train.onnx --devices 4xa100-80g --mesh-dims 1 --hints examples/tensor-parallel.yaml -o $(DEMO)/plan
	$(BIN)/parc run $(DEMO)/plan --steps 20
	$(BIN)/parc verify $(DEMO)/plan
	$(BIN)/parc models build gpt-medium -o $(DEMO)/gpt-medium.onnx
	$(BIN)/parc inspect $(DEMO)/gpt-medium.onnx

bench: $(STAMP)  ## import/inspect, grad and plan time, plan quality, executor overhead, stage search, mixed clusters, predicted vs measured, fault injection (docs/benchmarks.md)
	$(BIN)/python benchmarks/run.py
	$(BIN)/python benchmarks/grad.py
	$(BIN)/python benchmarks/plan.py
	$(BIN)/python benchmarks/runtime.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/hetero.py
	$(BIN)/python benchmarks/predict.py
	$(BIN)/python benchmarks/faults.py

lint: $(STAMP)  ## ruff, and the layer contracts (import-linter: docs/architecture.md)
	$(BIN)/ruff check parc tests benchmarks scripts
	$(BIN)/lint-imports

format: $(STAMP)  ## ruff format
	$(BIN)/ruff format parc tests benchmarks scripts

clean:  ## remove build outputs (keeps .venv)
	rm -rf out build *.egg-info .pytest_cache .ruff_cache
