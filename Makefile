# The two commands of the README:
#   make run   - show the embedded default cluster's topology (no GPU, no server)
#   make test  - ruff, mypy and the whole pytest suite (installs etcd-server first if it is missing)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck pytest clean system-deps

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# etcd (Debian etcd-server) for the ledger's multi-replica tests; the tests start it themselves
system-deps:
	command -v etcd >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server)

run: $(STAMP)
	$(VENV)/bin/toposched topo show --preset hgx-h100

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP) system-deps
	$(VENV)/bin/pytest

test: system-deps lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
