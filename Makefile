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

.PHONY: all build run test test-machine test-build e2e-build lint unit e2e e2e-runc e2e-gvisor e2e-engine e2e-gvisor-ptrace gvisor debug-build test-tools leftovers test-stamp

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

## Everything CI checks: format, lints, unit tests, fuzzing, then the end-to-end suites two
## at a time: the Rust suite under runc and under gVisor (`make gvisor` sets it up first), the
## Python suite, the gVisor engine's suites, the Python suite's widget and E2B tests under
## gVisor and its E2B pause, snapshot and commands tests on the gVisor engine; then a check
## that no test left work behind.
TEST_STAMP := target/.test-started
# Each long step prints when it starts and ends, so a log shows where the time went.
CLOCK = @echo "[$$(date +%T)] $@ $(1)"
test: test-stamp
	$(MAKE) --no-print-directory -j2 --output-sync=target test-machine test-build
	$(call CLOCK,starts the end-to-end suites and fuzzing)
	$(MAKE) --no-print-directory -k -j2 --output-sync=target E2E_THREADS=2 $(E2E_ORDER)
	$(MAKE) --no-print-directory -k E2E_THREADS=2 $(HEAVY_TARGETS)
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

# The crates that ship, tested together (the contract targets below reuse this build).
UNIT_CRATES := -p kernelgate-protocol -p kernelgate-policy -p kernelgate-client -p kernelgate
unit:
	$(CARGO) test $(UNIT_CRATES)

# End-to-end tests start the real binary against real Docker with the real image.
debug-build:
	$(CARGO) build -p kernelgate

# Everything the end-to-end suites need, built once before they run side by side.
e2e-prep: gvisor image test-tools fixture-image python-venv e2e-build
e2e-build: debug-build
	$(CARGO) test -p kernelgate-tests --no-run
	$(CARGO) test $(UNIT_CRATES) --lib --no-run

# What `make test` needs before its suites, in two lanes side by side: the machine's part
# (gVisor, Debian's packages, the images, the test venv: mostly downloads and Docker, one
# at a time, as apt takes one lock) and the build's (lints, unit tests, the binaries the
# suites run: the cores).
test-machine:
	$(MAKE) --no-print-directory -j1 gvisor test-tools image fixture-image python-venv
	$(call CLOCK,has the machine ready)
test-build:
	$(MAKE) --no-print-directory -j1 lint unit e2e-build
	$(call CLOCK,has the build ready)

# Every suite is a target of its own (e2e-<runtime>-<suite>), so that `make -j2` packs
# them onto the two cores as they end. KERNELGATE_RUNTIME picks the runtime for every
# gateway the tests start (tests/src/lib.rs); KERNELGATE_ENGINE=gvisor runs every gateway on
# the gVisor engine (runsc driven directly, no Docker) with the kernel image imported into
# the tests' image store (tests/src/engine.rs). Each runtime and engine first has the
# backend's contract checked against it (contract-*; the fake engine passes the same checks
# among the unit tests).
#
# Under runc every suite runs. Under gVisor, the suites where the runtime changes what
# happens (GVISOR_SUITES: the sandbox's walls and limits, deaths, files, packages,
# hibernation, the network, containers that come and go, and the engine's own suites). The
# others check the gateway's own logic (HTTP errors, the policy, keys and tenants, audit,
# metrics, browsers' requests, the cluster registry, notebooks, custom images' specs), the
# same whatever runs the kernels. On the gVisor engine, the suites that hold the sandbox to
# its promises (ENGINE_SUITES): the second wall and the CPU quota read from the host's cgroup
# (second_wall), hostile kernels and the gateway's memory budget against them
# (hostile_kernels), the sandbox and isolation checks (gateway), deaths named with their
# cause and recovery (recovery), files (agent), packages, and snapshots and forks of whole
# kernels (snapshots).
E2E_THREADS ?= 3
SUITES := $(basename $(notdir $(wildcard tests/tests/*.rs)))
GVISOR_SUITES := agent environment gateway gvisor_container gvisor_engine hibernation \
	hostile_kernels image lifecycle output_limits packages recovery second_wall testnet
ENGINE_SUITES := second_wall hostile_kernels gateway recovery agent packages snapshots
RUNC_TARGETS := $(addprefix e2e-runc-,$(SUITES))
GVISOR_TARGETS := $(addprefix e2e-runsc-,$(GVISOR_SUITES))
ENGINE_TARGETS := $(addprefix e2e-engine-,$(ENGINE_SUITES))
# The order `make test` starts them in: the longest first (as measured by the CLOCK lines of
# a full run, docs/testing.md), so that the two slots end close together. Fuzzing, which
# keeps a core busy for minutes, runs in the same two slots. The suites that flood the
# gateway on purpose (hostile_kernels: four kernels sending at full speed) run afterwards,
# one at a time: beside them, any suite's kernels are starved (a hibernated kernel's resume
# past its 120 s, under gVisor), and two floods measure each other.
HEAVY_TARGETS := e2e-runc-hostile_kernels e2e-runsc-hostile_kernels e2e-engine-hostile_kernels
E2E_LONGEST := python-tests e2e-runc-cluster fuzz-smoke e2e-runsc-hibernation \
	e2e-runc-hibernation e2e-runsc-gateway e2e-engine-gateway e2e-runc-gateway \
	e2e-engine-recovery e2e-engine-packages e2e-runc-agent e2e-runsc-agent e2e-runsc-recovery \
	e2e-runc-recovery e2e-runc-output_limits
E2E_ORDER := contract-runc contract-runsc contract-engine $(E2E_LONGEST) \
	$(filter-out $(E2E_LONGEST) $(HEAVY_TARGETS),$(RUNC_TARGETS) $(GVISOR_TARGETS) \
	$(ENGINE_TARGETS)) python-tests-gvisor python-tests-engine
.PHONY: e2e-prep contract-runc contract-runsc contract-engine \
	$(RUNC_TARGETS) $(GVISOR_TARGETS) $(ENGINE_TARGETS)

CONTRACT = KERNELGATE_IMAGE=$(KERNEL_IMAGE) KERNELGATE_RUNTIME=$(1) $(CARGO) test $(UNIT_CRATES) \
	--lib -- --ignored --exact backend::contract::$(2)_passes_the_contract
contract-runc: e2e-prep
	$(call CONTRACT,runc,docker_engine)
contract-runsc: e2e-prep
	$(call CONTRACT,runsc,docker_engine)
contract-engine: e2e-prep
	$(call CONTRACT,runsc,gvisor_engine)

# $(call SUITE,runtime,suite,extra environment)
SUITE = echo "[$$(date +%T)] $@ starts"; \
	KERNELGATE_IMAGE=$(KERNEL_IMAGE) KERNELGATE_FIXTURE_IMAGE=$(FIXTURE_IMAGE) \
	KERNELGATE_RUNTIME=$(1) $(3) $(CARGO) test -p kernelgate-tests --test $(2) \
		-- --test-threads=$(E2E_THREADS); \
	status=$$?; echo "[$$(date +%T)] $@ done"; exit $$status
$(RUNC_TARGETS): e2e-runc-%: e2e-prep
	@$(call SUITE,runc,$*)
$(GVISOR_TARGETS): e2e-runsc-%: e2e-prep
	@$(call SUITE,runsc,$*)
$(ENGINE_TARGETS): e2e-engine-%: e2e-prep
	@$(call SUITE,runsc,$*,KERNELGATE_ENGINE=gvisor)

e2e: e2e-runc e2e-gvisor
e2e-runc: contract-runc $(RUNC_TARGETS)
e2e-gvisor: contract-runsc $(GVISOR_TARGETS)
e2e-engine: contract-engine $(ENGINE_TARGETS)

# Not part of `make test`: the same suite under Debian's runsc on ptrace, the slower wall
# `make gvisor` keeps registered beside the new one.
e2e-gvisor-ptrace: e2e-prep
	$(call CONTRACT,runsc-ptrace,docker_engine)
	KERNELGATE_IMAGE=$(KERNEL_IMAGE) KERNELGATE_FIXTURE_IMAGE=$(FIXTURE_IMAGE) \
	KERNELGATE_RUNTIME=runsc-ptrace $(CARGO) test -p kernelgate-tests --no-fail-fast \
		-- --test-threads=$(E2E_THREADS)

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
python-tests-engine: gvisor image debug-build
