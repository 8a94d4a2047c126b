# The two commands of the README. Each creates or refreshes the environment first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.slimgrad-env

.PHONY: demo test lint env

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,hf,triton]"
	# timm + torchvision for the timm test suites only, outside site-packages (see
	# tests/conformance/_timm_shim.py): a CUDA-built torchvision there would break transformers
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/timm-site -c constraints.txt timm torchvision
	touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/slimgrad demo

LINT_PATHS := src tests $(wildcard examples)

lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)

test: lint
	$(PY) -m pytest -n 2 -q
