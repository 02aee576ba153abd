# Both targets create and reuse a virtual environment in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install serve test lint bench clean gpu-wheels

$(VENV)/.installed: pyproject.toml
	@echo "batchfit: creating the virtual environment in $(VENV) (first run only; about 2 minutes in all)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# torch first, on its own and pinned: the largest download, and the tested version.
	@echo "batchfit: installing torch 2.13.0 (the largest download; about a minute)"
	$(PY) -m pip install --quiet torch==2.13.0
	@echo "batchfit: installing batchfit and its dependencies"
	$(PY) -m pip install --quiet -e '.[test,bench]'
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

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
