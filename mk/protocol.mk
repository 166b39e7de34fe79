# Fuzzing of the decoders of untrusted input (the protocol crate's, the vendored ZeroMQ
# reader, and the execution policy's scanner) and the protocol's golden vectors. Included by the root Makefile.
#
#   make fuzz-smoke      each fuzz target for $(FUZZ_SECONDS) s (part of `make test`)
#   make golden          regenerate protocol/tests/golden/*.json and the fuzz seeds with
#                        Python's jupyter_client and jupyter_server (needs PyPI; not part
#                        of `make test`, which uses the committed vectors)
#
# cargo-fuzz needs nightly-only rustc flags; RUSTC_BOOTSTRAP=1 lets the stable toolchain
# accept them. Targets are built without a sanitizer (`-s none`): the crate forbids unsafe
# code, and a build without ASan is about twice as fast to compile and to run. Overflow
# checks and debug assertions stay on (cargo-fuzz's default).

CARGO ?= cargo
PROTOCOL_DIR := $(abspath $(dir $(lastword $(MAKEFILE_LIST)))../protocol)
PROTOCOL_FUZZ_TARGETS := wire_decode connection_file ws_legacy_text ws_legacy_binary ws_v1 zmq_stream
POLICY_DIR := $(abspath $(dir $(lastword $(MAKEFILE_LIST)))../policy)
POLICY_FUZZ_TARGETS := scan
FUZZ_SECONDS ?= 15
CARGO_FUZZ_VERSION ?= 0.13.2
GOLDEN_VENV ?= /tmp/golden-venv
GOLDEN_PIP ?= jupyter_client==8.10.0 jupyter_server==2.21.1 orjson==3.13.0

.PHONY: fuzz-smoke golden

# $(call fuzz_crate,DIR,TARGETS): builds a crate's fuzz targets and runs each one.
define fuzz_crate
	cd $(1) && RUSTC_BOOTSTRAP=1 $(CARGO) fuzz build -s none
	@set -e; cd $(1); mkdir -p fuzz/target/fuzz-smoke; \
	for t in $(2); do \
		mkdir -p fuzz/corpus/$$t; \
		if RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run -s none $$t fuzz/corpus/$$t fuzz/seeds/$$t -- \
			-max_total_time=$(FUZZ_SECONDS) -timeout=10 >fuzz/target/fuzz-smoke/$$t.log 2>&1; then \
			echo "fuzz-smoke: $$t: $$(grep -E '^Done [0-9]+ runs' fuzz/target/fuzz-smoke/$$t.log), no crash"; \
		else \
			tail -n 40 fuzz/target/fuzz-smoke/$$t.log; \
			echo "fuzz-smoke: $$t FAILED; input saved under $(notdir $(1))/fuzz/artifacts/$$t/,"; \
			echo "  replay: cd $(notdir $(1)) && RUSTC_BOOTSTRAP=1 cargo fuzz run -s none $$t <file>"; \
			exit 1; \
		fi; \
	done
endef

fuzz-smoke:
	$(call CLOCK,starts)
	@$(CARGO) fuzz --version >/dev/null 2>&1 || \
		$(CARGO) install cargo-fuzz --locked --version $(CARGO_FUZZ_VERSION)
	$(call fuzz_crate,$(PROTOCOL_DIR),$(PROTOCOL_FUZZ_TARGETS))
	$(call fuzz_crate,$(POLICY_DIR),$(POLICY_FUZZ_TARGETS))
	$(call CLOCK,done)

golden:
	python3 -m venv $(GOLDEN_VENV)
	$(GOLDEN_VENV)/bin/pip install --quiet $(GOLDEN_PIP)
	$(GOLDEN_VENV)/bin/python $(PROTOCOL_DIR)/tests/golden/generate.py
