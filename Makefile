# Entry points for a newcomer: `make test` and `make train`. Each creates .venv on first use and
# installs what it needs. On a machine without an NVIDIA GPU, torch==2.13.0 (the CPU build) is installed
# first so that pip does not pull a multi-GB CUDA build; with a GPU, pip resolves torch the normal way.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1

.PHONY: install test train bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
ifneq ($(HAS_GPU),1)
	$(PIP) install --quiet torch==2.13.0
endif
	$(PIP) install --quiet -e ".[test]"
	@rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q

train: install
	$(VENV)/bin/atrlhf train --config configs/tiny.yaml $(ARGS)

bench: install
	$(PY) benchmarks/reward.py && $(PY) benchmarks/buffer.py && $(PY) benchmarks/losses.py

clean:
	rm -rf $(VENV) mlruns mlflow.db mlartifacts runs .pytest_cache
