# The README's two commands: `make up` (install + run the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install install-test up test test-sqlite lint

# Serving installs the package and its runtime dependencies only; the test extras (pytest, mypy,
# playwright, transformers, kubernetes-validate, ...) come with `make test` (install-test).
install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

# `make up UP_ARGS="--port 9000"` passes options to `cloverq up`.
up: install
	@echo "cloverq CLI: $(BIN)/cloverq (or: source $(BIN)/activate, then cloverq)"
	$(BIN)/cloverq up $(UP_ARGS)

lint: install-test
	$(BIN)/ruff check .

# Three pytest-xdist sessions on CI's two cores: with two, 15% of the CPU sat idle while tests
# waited on their stacks (vmstat; one torch thread per test process): the PostgreSQL run took 683 s
# with two sessions and 598 s with three on the same machine. Stack tests stay serial in one group.
PYTEST_WORKERS ?= 3

test: install-test
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup

# CI's second run (.ci/run): the tests whose behaviour differs by backend (tests/conftest.py:
# --backend-subset), on the embedded default's SQLite, whatever CLOVERQ_TEST_DATABASE_URL says.
test-sqlite: install-test
	env -u CLOVERQ_TEST_DATABASE_URL $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --backend-subset
