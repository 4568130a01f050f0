# The two commands of the README:
#   make run   - the main job on the embedded default (no GPU, no server): show an HGX H100 box's
#                topology, plan two Llama-3.1-70B-Instruct instances on it, write and print their vLLM launch scripts
#   make test  - ruff, mypy and the whole pytest suite (installs etcd-server first if it is missing)
#   make fuzz  - the long fuzz run of every parser (docs/fuzz.md); the pytest suite runs a brief one
#   make check-engines - every launch through the real vLLM/SGLang parsers, shellcheck, kubernetes-validate
#   make docs-img - the documented screenshots and plots in docs/img (tools/docs_img_web.py, tools/docs_img_sim.py)
# `make run` installs toposched with its runtime dependencies only; the targets that develop or check it
# (test, lint, typecheck, fuzz, check-engines) add the dev extras (pytest, Ray, schemathesis, matplotlib...).
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
# `make run`'s launch scripts, one per instance (printed one after another, only the first would run)
RUN_LAUNCH := $(VENV)/run-launch

.PHONY: run test lint typecheck pytest clean system-deps fuzz check-engines docs-img

$(RUN_STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(DEV_STAMP): $(RUN_STAMP)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# etcd (Debian etcd-server) for the ledger's and the service's multi-replica tests (the tests start it
# themselves), promtool (Debian prometheus) for the alert rules, chromium for the web page test,
# shellcheck for the launch scripts (the tests run it where it is installed), libibverbs1 for the real
# mooncake_master of the KV-cache store test (mooncake-transfer-engine-non-cuda, a dev extra, links it),
# Open MPI and sshd for the real mpirun-over-ssh run of a multi-node TensorRT-LLM LeaderWorkerSet,
# openssl for the certificate of the etcd gRPC client's TLS test
system-deps:
	command -v etcd >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server)
	command -v promtool >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus)
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	command -v shellcheck >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck)
	command -v mpirun >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin)
	test -x /usr/sbin/sshd || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server)
	dpkg -s libibverbs1 >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1)
	command -v openssl >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl)

run: $(RUN_STAMP)
	$(VENV)/bin/toposched topo show --preset hgx-h100
	$(VENV)/bin/toposched plan --preset hgx-h100 --model llama-3.1-70b-instruct --slo-tpot-ms 40 --replicas 2
	rm -rf $(RUN_LAUNCH)
	$(VENV)/bin/toposched launch vllm --preset hgx-h100 --model llama-3.1-70b-instruct --slo-tpot-ms 40 --replicas 2 \
		--out $(RUN_LAUNCH)
	@for script in $(RUN_LAUNCH)/*.sh; do echo "== $$script"; cat "$$script"; done

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(DEV_STAMP)
	$(VENV)/bin/mypy

pytest: $(DEV_STAMP) system-deps
	$(VENV)/bin/pytest

test: system-deps lint typecheck pytest

# Per target: FUZZ_EXAMPLES hypothesis examples or FUZZ_SECONDS seconds, whichever ends first;
# FUZZ_TARGETS=smi,nccl picks targets; the smallest input of each finding goes to FUZZ_FINDINGS.
FUZZ_EXAMPLES ?= 5000
FUZZ_SECONDS ?= 120
FUZZ_FINDINGS ?= /tmp/fuzz-findings
fuzz: $(DEV_STAMP)
	$(PY) -m tests.fuzz.runner --examples $(FUZZ_EXAMPLES) --seconds $(FUZZ_SECONDS) \
		--findings $(FUZZ_FINDINGS) $(if $(FUZZ_TARGETS),--targets $(FUZZ_TARGETS))

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

# Every launch through vLLM 0.33.0's / SGLang 0.5.23's own parsers and config validation, shellcheck and
# kubernetes-validate (docs/engine-checks.md); builds its venv once in ~/.cache/toposched.
check-engines: $(DEV_STAMP)
	$(PY) -m checks.engines.run

# the web page's screenshots (starts toposched serve itself; headless chromium) and simulate --out's plots
docs-img: $(DEV_STAMP) system-deps
	$(PY) tools/docs_img_web.py --out docs/img
	$(PY) tools/docs_img_sim.py
