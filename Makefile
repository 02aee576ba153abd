# Both targets create and reuse a virtual environment in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install serve test lint bench clean gpu-wheels lock

$(VENV)/.installed: pyproject.toml constraints.txt
	@echo "batchfit: creating the virtual environment in $(VENV) (first run only; about 2 minutes in all)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# torch first, on its own and pinned: the largest download, and the tested version.
	@echo "batchfit: installing torch 2.13.0 (the largest download; about a minute)"
	$(PY) -m pip install --quiet torch==2.13.0
	@echo "batchfit: installing batchfit and its dependencies, at the tested versions"
	$(PY) -m pip install --quiet --constraint constraints.txt -e '.[test,bench]'
	@echo "batchfit: installed; $(VENV)/bin/batchfit is ready"
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/batchfit serve $(ARGS)

bench: install
	$(VENV)/bin/batchfit bench $(ARGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest

# Wheels of every runtime dependency a bare GPU machine lacks (never torch), for
# scripts/gpu_check.sh there; see docs/gpu.md.
gpu-wheels: install
	$(PY) -m scripts.gpu_wheels --dest .whl

# constraints.txt anew: the newest releases pyproject.toml allows, installed into a fresh
# environment (torch stays at its pin). Run `make test` before committing the result.
LOCK_VENV := $(shell mktemp -u /tmp/batchfit-lock.XXXXXX)
lock:
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(LOCK_VENV)/bin/python -m pip install --quiet '.[test,bench]'
	grep '^#' constraints.txt > constraints.txt.new
	$(LOCK_VENV)/bin/python -m pip freeze --all --exclude pip --exclude batchfit | sed 's/+cpu$$//' >> constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
