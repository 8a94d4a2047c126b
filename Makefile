# The two commands of the README. Each creates or refreshes the environment first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.slimgrad-env

.PHONY: demo test lint env test-matrix test-hf-newest test-no-reuse docs test-integrations

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

LINT_PATHS := src tests benchmarks $(wildcard examples)

lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)

# --dist worksteal: each worker starts on one contiguous half of the suite (xdist's default "load"
# hands out the first quarter one test at a time, alternately), so a file's module-level model
# caches and module-scoped fixtures are built in one worker, not both
# --durations=30: the slowest tests in every run's log, to keep the suite's time in view
test: lint
	$(PY) -m pytest -n 2 --dist worksteal -q --durations=30

# The HF suites' rows marked hf_release again under the newest declared transformers (pure Python:
# installed beside the pinned one in $(VENV)/hf-newest and put first on the path): one row per
# (family, path) that runs transformers' release-dependent code (modeling forwards and templates,
# loss functions, the attention interface, cache classes, masks, decorators and keywords); the
# other rows vary dtype, padding and mode over the same code (NOTE [Rows under the newest
# transformers] in tests/conformance/test_hf_families.py). --dist loadfile: each worker imports and
# collects (about a third of the run's CPU time), then builds only its own files' models.
HF_NEWEST := 5.24.0
HF_TESTS := tests/conformance/test_hf_families.py tests/test_convert_hf_loss.py \
	tests/test_convert_hf_attention.py tests/test_convert_hf.py tests/ops/test_gpt2_block.py \
	tests/conformance/test_accelerate_hooks_convert.py
$(VENV)/hf-newest/.stamp-$(HF_NEWEST): $(STAMP)
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/hf-newest transformers==$(HF_NEWEST)
	touch $@

test-hf-newest: $(VENV)/hf-newest/.stamp-$(HF_NEWEST)
	PYTHONPATH=$(VENV)/hf-newest $(PY) -m pytest -n 2 --dist loadfile -q -m hf_release $(HF_TESTS)

# Lowest, pinned and newest declared torch/transformers in their own venvs (multi-GB downloads);
# writes benchmarks/results/version_matrix.jsonl and docs/compatibility.md
test-matrix: $(STAMP)
	$(PY) benchmarks/version_matrix.py

# The suite as an installation without the ownership extension (no compiler) runs it: tests that
# assert a grant skip (tests/_needs_reuse.py), everything else must pass
test-no-reuse: $(STAMP)
	SLIMGRAD_NO_EXT=1 $(PY) -m pytest -n 2 --dist worksteal -q

# The documentation site (docs/, mkdocs.yml) into build/site, warnings as errors. Installs the
# [docs] extra's packages into $(VENV) here, not in env: CI's test set-up stays as fast as it was.
DOCS_STAMP := $(VENV)/.slimgrad-docs
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs'], sep='\n')" > $(VENV)/docs-requirements.txt
	$(PY) -m pip install -q -r $(VENV)/docs-requirements.txt
	touch $@

docs: $(DOCS_STAMP)
	$(PY) benchmarks/make_docs_tables.py --check
	$(PY) -m mkdocs build --strict --site-dir build/site

# slimgrad.integrations' Lightning callback needs Lightning, which the default set-up does not
# install: three pure-Python wheels beside the venv's site-packages (their other dependencies come
# with torch and transformers), then the integration tests that need it or that check what an
# import loads with it installed (`make test` already ran the others, skipping the Lightning ones)
INTEGRATIONS_SITE := $(VENV)/integrations-site
$(INTEGRATIONS_SITE)/.stamp: $(STAMP) constraints.txt
	$(PY) -m pip install -q --no-deps --upgrade --target $(INTEGRATIONS_SITE) -c constraints.txt \
		lightning lightning-utilities torchmetrics
	touch $@

test-integrations: $(INTEGRATIONS_SITE)/.stamp
	PYTHONPATH=$(INTEGRATIONS_SITE) $(PY) -m pytest -p no:xdist -q -rs tests/integrations \
		-k "lightning or import_loads_no_framework"
