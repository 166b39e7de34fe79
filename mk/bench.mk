# The benchmark. Included by the root Makefile.
#
#   make bench                        Kernelgate vs Jupyter Kernel Gateway vs direct ZeroMQ,
#                                     one run on this machine: prints a markdown table and
#                                     writes bench-results.json and bench-results.md
#   make bench BENCH_ARGS=--quick     a short run to try it out (numbers mean little)
#   make bench BENCH_ARGS='--only walls'  only direct, runc and both gVisor runtimes in
#                                     alternating rounds (needs `make gvisor`)
#   make bench BENCH_ARGS='--only engines'  Docker+runc, Docker+gVisor and the gVisor engine
#                                     (--engine gvisor) in alternating rounds (needs
#                                     `make gvisor`; samples in docs/bench-engines.json)
#   make bench BENCH_ARGS='--only stages' only the per-stage breakdown of one execute and each
#                                     optional feature on and off
#   make bench-registry               only the registry at scale, old against new: simulated
#                                     nodes (100, 300, 1,000) x kernels (10^4, 10^5) on a
#                                     real etcd, each point run with REGISTRY_BASELINE's
#                                     cluster code and this tree's; samples in
#                                     docs/bench-registry.json. About 25 minutes; a point
#                                     that collapses is cut short and the larger ones skipped
#                                     (BENCH_ARGS='--registry-nodes 100 --registry-kernels
#                                     10000 --registry-window 30' for one point)
#   make bench-versions BASELINE=REV  this tree's gateway against REV's (a release build of
#                                     `git archive REV`), both under runc in alternating
#                                     rounds: creates, round trip, stream; writes
#                                     bench-versions.json and bench-versions.md
#   ./target/release/bench --render docs/bench-results.json
#                                     measures nothing: prints the tables and the README's
#                                     figures of that run's samples (a full run's samples in
#                                     docs/ are what README.md and docs/performance.md quote;
#                                     tests/tests/docs.rs checks them)
#
# The venv $(BENCH_VENV) holds jupyter_kernel_gateway 3.x plus the kernel image's own pinned
# packages (kernel-image/requirements.txt), so local kernels run the same ipykernel,
# matplotlib and numpy as the containers. It is rebuilt when the requirements change.
# Needs Docker and the kernel image (`make image`); removes every kernel it started.

BENCH_VENV ?= $(KERNELGATE_ROOT)/.venv-bench
BENCH_PYTHON ?= python3
BENCH_ARGS ?=

$(BENCH_VENV)/.stamp: $(KERNELGATE_ROOT)/kernel-image/requirements.txt $(KERNELGATE_ROOT)/mk/bench.mk
	rm -rf '$(BENCH_VENV)'
	$(BENCH_PYTHON) -m venv '$(BENCH_VENV)'
	'$(BENCH_VENV)/bin/pip' install --quiet -r '$(KERNELGATE_ROOT)/kernel-image/requirements.txt' \
		'jupyter_kernel_gateway>=3,<4'
	touch '$@'

.PHONY: bench bench-venv bench-versions bench-registry registry-baseline
bench-venv: $(BENCH_VENV)/.stamp

# The registry section's builds are named for it: which baseline, and this tree's commit.
REGISTRY_ENV = REGISTRY_BASELINE_BIN='$(REGISTRY_DIR)/registry_scale' \
	BENCH_REGISTRY_BASELINE_REV="$$(cat '$(REGISTRY_DIR)/rev' 2>/dev/null)" \
	BENCH_CURRENT_REV="$$(git rev-parse --short HEAD)$$(git diff --quiet HEAD || echo ' (with uncommitted changes)')"

bench: image bench-venv python-venv test-tools registry-baseline
	cd '$(KERNELGATE_ROOT)' && $(CARGO) build --release -p kernelgate -p kernelgate-tests
	cd '$(KERNELGATE_ROOT)' && KERNELGATE_IMAGE='$(KERNEL_IMAGE)' \
		KERNELGATE_BIN='$(KERNELGATE_ROOT)/target/release/kernelgate' \
		BENCH_COMMAND='$(strip make bench $(BENCH_ARGS))' $(REGISTRY_ENV) \
		./target/release/bench --venv '$(BENCH_VENV)' \
		--out bench-results.json --md bench-results.md $(BENCH_ARGS)

# Needs neither Docker nor the venv: etcd (`make test-tools`) and the two builds.
bench-registry: test-tools registry-baseline
	cd '$(KERNELGATE_ROOT)' && $(CARGO) build --release -p kernelgate -p kernelgate-tests
	cd '$(KERNELGATE_ROOT)' && BENCH_COMMAND='$(strip make bench-registry $(BENCH_ARGS))' \
		$(REGISTRY_ENV) ./target/release/bench --only registry \
		--out docs/bench-registry.json --md bench-registry.md $(BENCH_ARGS)

# The registry section's baseline: `git archive $(REGISTRY_BASELINE)` (a commit; by default
# the cluster code before the registry's scale work) with this tree's
# tests/src/bin/registry_scale/ copied in, which uses only the registry API both trees
# have, and the baseline's way to find an owner (tests/registry-baseline/routing.rs); built as bench-versions builds its baseline (the same target directory, the
# workspace's own crates cleaned before and after), and kept until that file changes. When
# it does not build, the registry section runs this tree's alone and says so.
REGISTRY_BASELINE ?= 96f05d4
REGISTRY_DIR := $(KERNELGATE_ROOT)/target/registry-baseline/$(REGISTRY_BASELINE)
registry-baseline: $(REGISTRY_DIR)/registry_scale
$(REGISTRY_DIR)/registry_scale: $(wildcard $(KERNELGATE_ROOT)/tests/src/bin/registry_scale/*.rs) $(KERNELGATE_ROOT)/tests/registry-baseline/routing.rs
	rm -rf '$(REGISTRY_DIR)' && mkdir -p '$(REGISTRY_DIR)/src'
	cd '$(KERNELGATE_ROOT)' && git archive '$(REGISTRY_BASELINE)' | tar -x -C '$(REGISTRY_DIR)/src'
	rm -rf '$(REGISTRY_DIR)/src/tests/src/bin/registry_scale.rs' '$(REGISTRY_DIR)/src/tests/src/bin/registry_scale'
	cp -r '$(KERNELGATE_ROOT)/tests/src/bin/registry_scale' '$(REGISTRY_DIR)/src/tests/src/bin/'
	cp '$(KERNELGATE_ROOT)/tests/registry-baseline/routing.rs' '$(REGISTRY_DIR)/src/tests/src/bin/registry_scale/'
	cd '$(KERNELGATE_ROOT)' && $(CARGO) clean --release $(OWN_CRATES)
	cd '$(REGISTRY_DIR)/src' && CARGO_TARGET_DIR='$(KERNELGATE_ROOT)/target' \
		$(CARGO) build --release -p kernelgate-tests --bin registry_scale \
		&& cp '$(KERNELGATE_ROOT)/target/release/registry_scale' '$@' \
		&& git -C '$(KERNELGATE_ROOT)' rev-parse --short '$(REGISTRY_BASELINE)' > '$(REGISTRY_DIR)/rev' \
		|| echo 'registry-baseline: $(REGISTRY_BASELINE) did not build; the registry section runs this tree alone'
	rm -f '$(KERNELGATE_ROOT)/target/release/registry_scale'
	cd '$(KERNELGATE_ROOT)' && $(CARGO) clean --release $(OWN_CRATES)

# The baseline is built from `git archive $(BASELINE)` in target/bench-baseline/src with the
# same target directory (its dependencies are compiled once); its binary is copied out and
# the uplifted one removed, so the build of this tree that follows puts its own back.
# Cargo names a path crate's artifacts the same from either tree and judges them by file
# times (the archive's are the commit's), so the workspace's own crates are cleaned before
# each of the two builds: neither may take the other's.
BASELINE ?= HEAD
BASELINE_DIR := $(KERNELGATE_ROOT)/target/bench-baseline
OWN_CRATES := -p kernelgate-protocol -p kernelgate-policy -p kernelgate-client -p kernelgate \
	-p kernelgate-tests -p zeromq
bench-versions: image test-tools
	rm -rf '$(BASELINE_DIR)' && mkdir -p '$(BASELINE_DIR)/src'
	cd '$(KERNELGATE_ROOT)' && git archive '$(BASELINE)' | tar -x -C '$(BASELINE_DIR)/src'
	cd '$(KERNELGATE_ROOT)' && $(CARGO) clean --release $(OWN_CRATES)
	cd '$(BASELINE_DIR)/src' && CARGO_TARGET_DIR='$(KERNELGATE_ROOT)/target' $(CARGO) build --release -p kernelgate
	cp '$(KERNELGATE_ROOT)/target/release/kernelgate' '$(BASELINE_DIR)/kernelgate'
	rm -f '$(KERNELGATE_ROOT)/target/release/kernelgate'
	cd '$(KERNELGATE_ROOT)' && $(CARGO) clean --release $(OWN_CRATES)
	cd '$(KERNELGATE_ROOT)' && $(CARGO) build --release -p kernelgate -p kernelgate-tests
	cd '$(KERNELGATE_ROOT)' && KERNELGATE_IMAGE='$(KERNEL_IMAGE)' \
		KERNELGATE_BIN='$(KERNELGATE_ROOT)/target/release/kernelgate' \
		BENCH_COMMAND='make bench-versions BASELINE=$(BASELINE)' \
		BENCH_BASELINE_REV="$$(git rev-parse --short '$(BASELINE)')" \
		BENCH_CURRENT_REV="$$(git rev-parse --short HEAD)$$(git diff --quiet HEAD || echo ' (with uncommitted changes)')" \
		./target/release/bench --only versions --baseline-bin '$(BASELINE_DIR)/kernelgate' \
		--out bench-versions.json --md bench-versions.md $(BENCH_ARGS)
