# Two commands on a fresh machine: `make book` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pip's index warnings about missing local mirrors are noise on this machine.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
QUIET := 2>&1 | { grep -v "^WARNING: Location" || true; }

.PHONY: setup book test lint lab clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt $(QUIET)
	$(PY) -m pip install -q --no-deps -e . $(QUIET)
	$(PY) -c "import attnlib, torch; assert torch.__version__.startswith('2.13.0')"
	touch $@

book: $(STAMP)
	$(VENV)/bin/jupyter-book build . -W --keep-going

lint: $(STAMP)
	$(VENV)/bin/ruff check attnlib tests
	$(VENV)/bin/ruff format --check attnlib tests

test: lint
	$(PY) -m pytest

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks

clean:
	rm -rf _build
