# Cactus speculative-decoding server. `make test` and `make serve` set everything up.
SHELL := /bin/bash
# Python 3.11, which the pins are for: python3.11 where it is installed, else python3
PYTHON ?= $(shell command -v python3.11 2>/dev/null || echo python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.stamp-$(shell cat requirements.txt requirements-dev.txt pyproject.toml | sha256sum | cut -c1-16)
CACHE := $(CURDIR)/.cache
# The runtime environment (Ray, offline Hugging Face, DeepSpeed) is set by one module,
# cactus/environment.py, in every entry point. Here only what pip's DeepSpeed build and
# the compile caches need.
export DS_ACCELERATOR := cpu
export DS_BUILD_OPS := 0
export TORCH_EXTENSIONS_DIR := $(CACHE)/torch_extensions
export TRITON_CACHE_DIR := $(CACHE)/triton
PYTEST_ARGS ?=

.PHONY: setup protos serve stop test lint format bench bench-kernels bench-distributed bench-batch bench-chaos bench-http bench-policy gpu-check generate models clean

setup: $(STAMP) protos

# gRPC stubs are generated, not committed.
PROTO_SRC := $(shell find protos -name '*.proto')
PROTO_OUT := $(PROTO_SRC:.proto=_pb2.py) $(PROTO_SRC:.proto=_pb2_grpc.py) $(PROTO_SRC:.proto=_pb2.pyi)
protos: $(PROTO_OUT)
# one protoc run writes all three (a pattern rule's targets are made by one run of its
# recipe, in every GNU make): a missing stub or .pyi (deleted by hand) rebuilds them
protos/%_pb2.py protos/%_pb2_grpc.py protos/%_pb2.pyi: protos/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $<

# The stamp is keyed on the pinned requirements: a second run skips the install,
# a changed pin reinstalls. torch goes first so deepspeed builds against it.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	$(PIP) install --quiet $$(grep -E '^torch==' requirements.txt)
	$(PIP) install --quiet --no-build-isolation -r requirements.txt -r requirements-dev.txt
	$(PIP) install --quiet --no-build-isolation --no-deps -e .
	@rm -f $(VENV)/.stamp-*
	@touch $@

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench-kernels: setup
	$(PY) -m benchmarks.bench_kernels

bench-distributed: setup
	$(PY) -m benchmarks.bench_distributed

# Batched engine: tokens/s at B = 1..32 per rule, step split, crossover, memory.
bench-batch: setup
	$(PY) -m benchmarks.bench_batch

# OpenAI HTTP vs gRPC: single-stream tokens/s through the same server.
bench-http: setup
	$(PY) -m benchmarks.bench_http $(if $(filter 1 yes true,$(QUICK)),--quick,)

# Engine actors killed under 8 streaming clients: lost/duplicated tokens, recovery times.
bench-chaos: setup
	$(PY) -m benchmarks.bench_chaos $(if $(filter 1 yes true,$(QUICK)),--quick,)

# The goodput speculation policy vs fixed K = 0..8, served, at 1/4/8/16 clients (plot: .cache/policy.png).
bench-policy: setup
	@mkdir -p $(CACHE)
	$(PY) -m benchmarks.bench_policy $(if $(filter 1 yes true,$(QUICK)),--quick,) --plot $(CACHE)/policy.png

# On a GPU machine (never run on the CPU CI): the CUDA tests (engine, Triton vs torch at
# V = 151,936, a TP = 1 group on one GPU), then the in-process batch sweep on CUDA.
gpu-check: setup
	@$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device (its tests would all be skipped)')"
	$(PY) -m pytest -m gpu tests/workers/test_cuda.py
	$(PY) -m benchmarks.bench_batch --device cuda --quick
	$(PY) -m benchmarks.bench_batch --device cuda --quick --pair qwen3

# Everything, with plots: benchmarks/results/<date>-<host>.md (+ PNGs). QUICK=1: < 10 min (8.6
# here), written to <date>-<host>-quick.md.
bench: setup
	$(PY) -m benchmarks.run $(if $(filter 1 yes true,$(QUICK)),--quick,)

CONFIG ?= configs/default.yaml
# The gRPC port: PORT= if given, else the config's grpc_port (9000 in the shipped configs);
# empty when CONFIG cannot be read, which make stop refuses (never another port's server).
# With no virtual environment (nothing set up, so no server) it is 9000.
GRPC_PORT = $(or $(PORT),$(if $(wildcard $(PY)),$(shell $(PY) -m configs.schema --grpc-port "$(CONFIG)" 2>/dev/null),9000))
# Serve the embedded models: local Ray head on loopback, gRPC on the config's grpc_port or
# PORT (every interface: Ray Serve's gRPC proxy cannot bind one), OpenAI HTTP on
# 127.0.0.1 (config http_host, http_port or HTTP_PORT).
# Ctrl-C shuts everything down; `make stop` stops a detached run.
serve: setup
	$(PY) -m deployments.serve --config "$(CONFIG)" $(if $(PORT),--port $(PORT),) $(if $(HTTP_PORT),--http-port $(HTTP_PORT),)

# Stops the server on GRPC_PORT (one pid file per gRPC port): SIGINT, which drains, then
# a bounded wait. A server still there after STOP_TIMEOUT seconds (default: the config's
# recovery.drain_timeout_s + 60, room for Serve's backstop and Ray's own shutdown; read
# after the SIGINT is sent, so that the drain does not wait for it) is
# SIGKILLed, as Kubernetes ends a pod after its grace period (the Ray head it started
# shares its fate), and make stop fails saying so. A pid file whose pid is not a
# `deployments.serve` process (left by a server that was SIGKILLed or a reboot; the pid
# may have been reused) is removed and nothing is signalled.
STOP_TIMEOUT ?=
stop:
	@case "$(STOP_TIMEOUT)" in *[!0-9]*) \
	  echo "STOP_TIMEOUT must be a whole number of seconds, got '$(STOP_TIMEOUT)'" >&2; exit 2;; esac; \
	if [ -z "$(GRPC_PORT)" ]; then $(PY) -m configs.schema --grpc-port "$(CONFIG)" >/dev/null; \
	  echo "make stop: no gRPC port: CONFIG=$(CONFIG) cannot be read; fix it or give PORT=" >&2; exit 2; fi; \
	pid=$(CACHE)/serve-$(GRPC_PORT).pid; p=$$(cat $$pid 2>/dev/null); \
	if [ -n "$$p" ] && kill -0 $$p 2>/dev/null; then \
	  args=$$(tr '\0' ' ' < /proc/$$p/cmdline 2>/dev/null || ps -ww -o args= -p $$p 2>/dev/null); \
	  if [ -n "$$args" ] && ! echo "$$args" | grep -q 'deployments[.]serve'; then \
	    echo "removed a stale pid file: pid $$p is not a cactus server" >&2; rm -f $$pid; p=; fi; fi; \
	if [ -n "$$p" ] && kill -0 $$p 2>/dev/null; then kill -INT $$p; \
	  bound=$(or $(STOP_TIMEOUT),$$($(PY) -m configs.schema --stop-timeout "$(CONFIG)" 2>/dev/null || echo 90)); \
	  waited=0; while kill -0 $$p 2>/dev/null; do \
	    if [ $$waited -ge $$bound ]; then \
	      echo "the server on port $(GRPC_PORT) (pid $$p) did not stop within $${bound}s of SIGINT: killed it (SIGKILL)" >&2; \
	      kill -KILL $$p 2>/dev/null; rm -f $$pid; exit 1; fi; \
	    sleep 1; waited=$$((waited + 1)); done; \
	  echo "stopped the server on port $(GRPC_PORT)"; \
	else rm -f $$pid; echo "no server running on port $(GRPC_PORT)"; fi

# The prompt reaches the command as written (quotes, $ and backticks included): make's
# $(value) leaves it unexpanded, it is single-quoted for the shell, and --prompt=... keeps
# a prompt starting with "-" from being read as an option.
PROMPT ?= def fibonacci(n):
generate: setup
	$(PY) -m client.cli generate --prompt='$(subst ','\'',$(value PROMPT))' --stream

# Retrain the embedded draft/verifier pair (about an hour on 2 cores; progress printed).
models: setup
	$(PY) -m models.build

# Refuses while a server it started runs: its pid file (in the cache) is what make stop
# finds it by.
clean:
	@for f in $(CACHE)/serve-*.pid; do [ -f "$$f" ] || continue; p=$$(cat "$$f"); \
	  args=$$(tr '\0' ' ' < /proc/$$p/cmdline 2>/dev/null || ps -ww -o args= -p $$p 2>/dev/null); \
	  if [ -n "$$p" ] && kill -0 $$p 2>/dev/null && echo "$$args" | grep -q 'deployments[.]serve'; then \
	    port=$${f##*/serve-}; port=$${port%.pid}; \
	    echo "a server is running on port $$port (pid $$p): make stop PORT=$$port first" >&2; exit 1; fi; done
	rm -rf $(VENV) $(CACHE) .pytest_cache
