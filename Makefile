# The README's two commands: `make up` (install + run the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install up test lint bench

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

up: install
	$(BIN)/cloverq up

lint: install
	$(BIN)/ruff check .

# Two pytest-xdist sessions side by side (CI's two cores); stack tests stay serial in one group.
PYTEST_WORKERS ?= 2

test: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup
