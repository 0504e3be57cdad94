# Serval: `make serve` runs the main job, `make test` the whole test suite.
# Both set up everything from nothing: the virtualenv, the packages and the models they use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODELS := models
# Ray keeps 127.0.0.1 as loopback (instead of this machine's network address) only with this set.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
# Ray token authentication for the clusters make starts and the drivers that join them (see deployments/launcher.py).
export RAY_AUTH_MODE ?= token

.PHONY: venv lint test serve stop models clean bench-scheduler prometheus

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU wheel on these machines; a looser request could pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# The observability tests run a real Prometheus (Debian's package; the tests start it on loopback).
prometheus:
	@command -v prometheus >/dev/null || { export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends prometheus >/dev/null || \
	  { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null; }; }
	@prometheus --version | head -1

# ruff first (seconds): a formatting or lint error fails before the 20-minute suite starts.
lint: venv
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test: venv prometheus lint
	$(PY) -m pytest -q

# The embedded default model: a deterministic random-weight checkpoint made locally (no downloads).
$(MODELS)/tiny-llama/serval_model_spec.json: | venv
	$(VENV)/bin/serval make-model $(MODELS)/tiny-llama --arch llama --size small

models: $(MODELS)/tiny-llama/serval_model_spec.json

# The main job: a local Ray head on loopback serving configs/serve/default.yaml; `make stop` ends it.
SERVE_CONFIG ?= configs/serve/default.yaml
serve: venv models
	$(PY) -m deployments.launcher up --config $(SERVE_CONFIG)

stop: venv
	$(PY) -m deployments.launcher down

bench-scheduler: venv
	$(PY) benchmarks/bench_scheduler.py --num-running 256 1024

clean:
	rm -rf $(VENV) $(MODELS)
