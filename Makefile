# Sluice: the verbs. `make help` lists them.
SHELL := /bin/bash
CARGO ?= cargo
VENV ?= .venv
PY := $(VENV)/bin/python
APT_PACKAGES := etcd-server protobuf-compiler libibverbs-dev
# Tests run with a couple of threads: the integration tests start real
# processes and the machine has 2 cores.
TEST_THREADS ?= 2

.PHONY: help deps deps-system deps-python build run test test-rust test-python test-deploy bench bench-priority bench-queue bench-frontend lint fmt clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

deps: deps-system deps-python ## install everything the build and the tests need

deps-system: ## apt packages: etcd-server (tests), protobuf-compiler (build), libibverbs-dev (rdma feature)
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

deps-python: ## the venv with the clients the tests use (openai, grpcio-tools, pytest)
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip >/dev/null
	@$(PY) -m pip install -q -r tests/python/requirements.txt -r tests/deploy/requirements.txt

build: ## build every crate (debug)
	$(CARGO) build --workspace --all-targets

run: deps-system ## set up and run everything: `sluice up` with the built-in model on :8000
	$(CARGO) run --release -p sluice -- up $(ARGS)

test: test-rust test-python test-deploy ## run every test (Rust, Python clients, deploy manifests)

test-rust: ## cargo tests, unit and integration; the rdma KV transport must keep compiling and its verbs layouts must match verbs.h
	$(CARGO) test --workspace -- --test-threads=$(TEST_THREADS)
	$(CARGO) test -p sluice-decode --features rdma --lib transfer::rdma
	$(CARGO) build -p sluice --features rdma

test-python: ## tests that use other people's clients (openai, grpcio) from the venv
	@if [ ! -x $(PY) ]; then echo "no $(VENV): run 'make deps' first"; exit 1; fi
	$(CARGO) build -p sluice
	SLUICE_BIN=$(CURDIR)/target/debug/sluice $(PY) -m pytest -q tests/python

test-deploy: ## validate deploy/ offline: compose, Dockerfile, kustomize + kubernetes-validate
	@if [ ! -x $(PY) ]; then echo "no $(VENV): run 'make deps' first"; exit 1; fi
	$(CARGO) build -p sluice
	SLUICE_BIN=$(CURDIR)/target/debug/sluice PY=$(PY) tests/deploy/validate.sh
	SLUICE_BIN=$(CURDIR)/target/debug/sluice $(PY) tests/deploy/selftest.py

bench: bench-priority bench-queue bench-frontend ## criterion benches (engine roofline, KV transfer, router, balance) and `sluice bench` experiments
	$(CARGO) bench --workspace

bench-priority: ## the priority experiment (mocker) -> tests/bench/results/ttft_by_priority.md
	tests/bench/priority/run.sh

bench-queue: ## queue burst and co-location experiments (mocker) -> tests/bench/results/queue.md
	tests/bench/queue/run.sh

bench-frontend: ## req/s and added latency at near-zero compute -> tests/bench/results/frontend.md
	tests/bench/frontend/run.sh

lint: ## fmt check, clippy -D warnings, buf lint
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	cd proto && npx --yes @bufbuild/buf lint

fmt: ## format the code
	$(CARGO) fmt --all

clean: ## remove build outputs
	$(CARGO) clean
