# The two commands of the README:
#   make run   - show the embedded default cluster's topology (no GPU, no server)
#   make test  - ruff, mypy and the whole pytest suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck pytest clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/toposched topo show --preset hgx-h100

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(VENV)/bin/pytest

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
