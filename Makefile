# Kernelgate: the two commands are `make run` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
# Where `make run` listens. Unset, the gateway's own default or KERNELGATE_LISTEN applies.
LISTEN ?=

include mk/image.mk
include mk/protocol.mk
include mk/bench.mk
include mk/python.mk
include mk/gateway-image.mk

.PHONY: all build run test lint unit e2e e2e-runc e2e-gvisor e2e-engine e2e-gvisor-ptrace gvisor debug-build test-tools leftovers test-stamp

all: build

build:
	$(CARGO) build --release -p kernelgate

# Flags only for what is not set otherwise, so every KERNELGATE_* variable works with
# `make run`: LISTEN=... on the make command line, else KERNELGATE_LISTEN, else
# 127.0.0.1:8888; KERNELGATE_IMAGE, else the image `make image` built.
RUN_FLAGS := $(if $(LISTEN),--listen $(LISTEN)) $(if $(KERNELGATE_IMAGE),,--image $(KERNEL_IMAGE))

## Build the kernel image if needed and the gateway, then serve.
run: image build
	./target/release/kernelgate serve $(strip $(RUN_FLAGS) $(ARGS))

## Everything CI checks: format, lints, unit tests, fuzzing, then two at a time: the
## end-to-end Rust suite under runc and under gVisor (`make gvisor` sets it up first), the
## Python suite, the gVisor engine's suites and the Python suite's widget and E2B tests
## under gVisor; then a check that no test left work behind.
TEST_STAMP := target/.test-started
# Each long step prints when it starts and ends, so a log shows where the time went.
CLOCK = @echo "[$$(date +%T)] $@ $(1)"
test: test-stamp lint unit fuzz-smoke
	$(call CLOCK,starts the end-to-end suites)
	$(MAKE) --no-print-directory -j2 --output-sync=target E2E_THREADS=2 \
		e2e-runc e2e-gvisor python-tests e2e-engine python-tests-gvisor
	$(MAKE) --no-print-directory leftovers
	$(call CLOCK,done)

## Fails when a test left a container, runtime directory, log or network namespace behind.
leftovers:
	@bash mk/leftovers.sh $(TEST_STAMP)

test-stamp:
	@mkdir -p target && touch $(TEST_STAMP)
	$(call CLOCK,starts make test)

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

unit:
	$(CARGO) test -p kernelgate-protocol -p kernelgate-policy -p kernelgate-client -p kernelgate

# End-to-end tests start the real binary against real Docker with the real image.
debug-build:
	$(CARGO) build -p kernelgate

# The suite under each runtime: KERNELGATE_RUNTIME picks it for every gateway the tests
# start (tests/src/lib.rs). First the backend's contract against the Docker engine under
# that runtime (the fake engine passes the same checks among the unit tests); under gVisor,
# the gVisor engine's (runsc driven directly, no Docker) before it. Under runc every suite
# runs; under gVisor the suites where the runtime changes what happens (GVISOR_SUITES: the
# sandbox's walls and limits, deaths, files, packages, hibernation, the network, containers
# that come and go, and the engine's own suites). The others check the gateway's own logic
# (HTTP errors, the policy, keys and tenants, audit, metrics, browsers' requests, the
# cluster registry, notebooks, custom images' specs), the same whatever runs the kernels.
E2E_THREADS ?= 3
GVISOR_SUITES := agent environment gateway gvisor_container gvisor_engine hibernation \
	hostile_kernels image lifecycle output_limits packages recovery second_wall testnet
E2E = KERNELGATE_IMAGE=$(KERNEL_IMAGE) KERNELGATE_RUNTIME=$(1) \
	$(CARGO) test -p kernelgate --lib -- --ignored --exact backend::contract::docker_engine_passes_the_contract && \
	KERNELGATE_IMAGE=$(KERNEL_IMAGE) KERNELGATE_FIXTURE_IMAGE=$(FIXTURE_IMAGE) \
	KERNELGATE_RUNTIME=$(1) $(CARGO) test -p kernelgate-tests --no-fail-fast $(addprefix --test ,$(2)) \
		-- --test-threads=$(E2E_THREADS)

e2e: e2e-runc e2e-gvisor

e2e-runc: image debug-build test-tools fixture-image
	$(call CLOCK,starts)
	$(call E2E,runc)
	$(call CLOCK,done)

e2e-gvisor: gvisor image debug-build test-tools fixture-image
	$(call CLOCK,starts)
	KERNELGATE_IMAGE=$(KERNEL_IMAGE) $(CARGO) test -p kernelgate --lib -- --ignored --exact \
		backend::contract::gvisor_engine_passes_the_contract
	$(call E2E,runsc,$(GVISOR_SUITES))

# The gVisor engine (`--engine gvisor`: no Docker, the gateway runs runsc itself) under the
# suites that hold the sandbox to its promises: the second wall and the CPU quota read from
# the host's cgroup (second_wall), hostile kernels and the gateway's memory budget against
# them (hostile_kernels), the sandbox and isolation checks (gateway), deaths named with
# their cause and recovery (recovery), files (agent) and packages.
# KERNELGATE_ENGINE=gvisor makes every gateway the tests start run on the engine, with the
# kernel image imported into the tests' image store (tests/src/engine.rs).
ENGINE_SUITES := second_wall hostile_kernels gateway recovery agent packages
e2e-engine: gvisor image debug-build test-tools fixture-image
	$(call CLOCK,starts)
	KERNELGATE_IMAGE=$(KERNEL_IMAGE) KERNELGATE_FIXTURE_IMAGE=$(FIXTURE_IMAGE) \
	KERNELGATE_RUNTIME=runsc KERNELGATE_ENGINE=gvisor $(CARGO) test -p kernelgate-tests \
		--no-fail-fast $(addprefix --test ,$(ENGINE_SUITES)) -- --test-threads=$(E2E_THREADS)
	$(call CLOCK,done)

# Not part of `make test`: the same suite under Debian's runsc on ptrace, the slower wall
# `make gvisor` keeps registered beside the new one.
e2e-gvisor-ptrace: gvisor image debug-build test-tools fixture-image
	$(call E2E,runsc-ptrace)

## Registers gVisor with Docker: `kernelgate-runsc`, the newest runsc found (the release's
## backports on the host's own Debian mirror, unpacked into /usr/local/lib/kernelgate/runsc)
## on systrap where it works, else ptrace; and `kernelgate-runsc-ptrace`, Debian's runsc on
## ptrace. Idempotent, says what it chose, keeps everything else in
## /etc/docker/daemon.json; running containers survive and keep their runsc binary.
gvisor:
	@if [ "$$(id -u)" = 0 ]; then python3 mk/gvisor-setup.py; else sudo python3 mk/gvisor-setup.py; fi

# The derived image of the custom-image tests is built with the test venv's pip.
FIXTURE_PYTHON := $(PY_VENV)/bin/python
fixture-image: python-venv

# Debian's Prometheus (the operability test has it scrape a live gateway on loopback) and
# etcd-server (the cluster registry's tests run a member on loopback; its package does not
# start one). gcc and Python 3.11's headers build the packages tests' native-extension wheel
# (tests/packages/make_wheels.py).
TEST_TOOLS := prometheus:prometheus etcd:etcd-server gcc:gcc \
	x86_64-linux-gnu-python3.11-config:libpython3.11-dev
test-tools:
	@missing=; for t in $(TEST_TOOLS); do \
		command -v $${t%%:*} >/dev/null 2>&1 || missing="$$missing $${t#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian$$missing for the tests"; \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y --no-install-recommends $$missing; \
	fi

# The Python suite drives the debug binary too.
python-tests: image debug-build fixture-image test-tools
python-tests-gvisor: gvisor image debug-build fixture-image test-tools
