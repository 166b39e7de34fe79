# The benchmark. Included by the root Makefile.
#
#   make bench                        Kernelgate vs Jupyter Kernel Gateway vs direct ZeroMQ,
#                                     one run on this machine: prints a markdown table and
#                                     writes bench-results.json and bench-results.md
#   make bench BENCH_ARGS=--quick     a short run to try it out (numbers mean little)
#   make bench BENCH_ARGS=--walls-only  only direct, runc and both gVisor runtimes in
#                                     alternating rounds (needs `make gvisor`)
#   make bench BENCH_ARGS=--stages-only only the per-stage breakdown of one execute and each
#                                     optional feature on and off
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

.PHONY: bench bench-venv
bench-venv: $(BENCH_VENV)/.stamp

bench: image bench-venv test-tools
	cd '$(KERNELGATE_ROOT)' && $(CARGO) build --release -p kernelgate -p kernelgate-tests
	cd '$(KERNELGATE_ROOT)' && KERNELGATE_IMAGE='$(KERNEL_IMAGE)' \
		KERNELGATE_BIN='$(KERNELGATE_ROOT)/target/release/kernelgate' \
		BENCH_COMMAND='$(strip make bench $(BENCH_ARGS))' \
		./target/release/bench --venv '$(BENCH_VENV)' \
		--out bench-results.json --md bench-results.md $(BENCH_ARGS)
