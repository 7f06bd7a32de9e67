# ampwatch: one entry point for newcomers and CI.
#   make test   lint (ruff, mypy), then the whole test suite (creates .venv on first use)
#   make test-fast  lint, then the tests not marked slow (the edit loop)
#   make lint   ruff over the tree, mypy over the four product packages (contract, agent, server, dashboards)
#   make demo   collector + 2-rank DDP job with an overflow, live (ARGS=--once exits at the end; ARGS=--help)
#   make bench  run the benchmarks (ARGS=--quick for a short run; ARGS=--list says what each measures)
#   make bench-gpu  check the agent on a GPU: truth, syncs, overhead (ARGS="--device cpu --quick": CPU smoke run)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ampwatch-installed

.PHONY: venv lint test test-fast demo bench bench-gpu clean

venv: $(STAMP)

# torch first, pinned: an unpinned torch (or one pulled in by a package) downloads a multi-GB CUDA build.
$(STAMP): contract/pyproject.toml agent/pyproject.toml server/pyproject.toml dashboards/pyproject.toml \
	  support/pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e ./contract -e ./agent -e ./server -e ./dashboards \
	  -e ./support -r requirements-dev.txt
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

# Two pytest-xdist workers: most tests wait on processes, servers, Prometheus and a browser, so on 2 cores the
# suite takes less time this way than one test at a time (figures: docs/testing.md). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

test-fast: lint
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) examples/demo.py $(ARGS)

# About 55 minutes on 2 cores (ARGS=--quick: about two); writes docs/benchmarks.md and .json.
# One section into the existing page: make bench ARGS="--only inspection --merge".
# Drives Debian's prometheus-pushgateway and valgrind (apt-get install prometheus-pushgateway valgrind).
bench: $(STAMP)
	@for tool in prometheus-pushgateway valgrind; do command -v $$tool >/dev/null || \
	  echo "make bench: $$tool is missing (apt-get install $$tool); its sections will report an error"; done
	$(PY) -m bench $(ARGS)

# Needs only torch and the source of the agent and its contract, so it runs with any python that has torch (a GPU
# machine may have no venv): the venv's python when there is one, else $(PYTHON). Writes artifacts/gpu/gpu.json and gpu.md.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
bench-gpu:
	PYTHONPATH=agent/src:contract/src:support/src $(GPU_PYTHON) -m bench.gpu $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache data artifacts
