# The Python test suite (tests/python): real JupyterLab, jupyter_server, jupyter_client and
# Debian's Chromium against the real gateway. Included by the root Makefile, which makes
# python-tests depend on the kernel image and the debug build.
#
#   make python-venv    .venv-tests with tests/python/requirements.txt (reinstalled only when
#                       that file changes) and /usr/bin/chromium (apt, only when missing)
#   make python-tests   pytest over tests/python; screenshots and logs land in artifacts/
#
# Playwright comes from PyPI but `playwright install` is never run: it downloads a browser
# build of its own, which cannot be fetched here. The tests drive /usr/bin/chromium instead.

PYTHON_ROOT := $(abspath $(dir $(lastword $(MAKEFILE_LIST)))..)
PYTHON ?= python3
PY_VENV := $(PYTHON_ROOT)/.venv-tests
PY_REQUIREMENTS := $(PYTHON_ROOT)/tests/python/requirements.txt
PY_STAMP := $(PY_VENV)/.requirements.stamp
# Per-test limit: the JupyterLab test takes a few minutes on a loaded 2-core machine.
PYTEST_TIMEOUT ?= 900
PYTEST_ARGS ?=

.PHONY: python-venv python-tests python-tests-gvisor python-tests-engine

python-venv: $(PY_STAMP)
	@if [ ! -x /usr/bin/chromium ]; then \
		echo 'installing Debian chromium for the browser tests'; \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y chromium; \
	fi

$(PY_STAMP): $(PY_REQUIREMENTS)
	@[ -x '$(PY_VENV)/bin/python' ] || $(PYTHON) -m venv '$(PY_VENV)'
	'$(PY_VENV)/bin/python' -m pip install --disable-pip-version-check -q -r '$(PY_REQUIREMENTS)'
	@touch '$@'

python-tests: python-venv
	$(call CLOCK,starts)
	cd '$(PYTHON_ROOT)' && KERNELGATE_RUNTIME=$${KERNELGATE_RUNTIME:-runc} KERNELGATE_IMAGE='$(or $(KERNEL_IMAGE),kernelgate-kernel:latest)' KERNELGATE_FIXTURE_IMAGE='$(FIXTURE_IMAGE)' \
		'$(PY_VENV)/bin/python' -m pytest tests/python -v \
		--timeout=$(PYTEST_TIMEOUT) --durations=15 -p no:cacheprovider $(PYTEST_ARGS)
	$(call CLOCK,done)

# The widget tests and E2B's SDKs once more with every kernel under gVisor (the rest of the
# Python suite runs under runc): JupyterLab's widget manager, the comm round trips and the E2B
# surface under both runtimes.
PY_GVISOR_TESTS := tests/python/test_widgets.py tests/python/test_jupyterlab_widgets.py tests/python/test_e2b.py
python-tests-gvisor: python-venv
	$(call CLOCK,starts)
	cd '$(PYTHON_ROOT)' && KERNELGATE_RUNTIME=runsc KERNELGATE_IMAGE='$(or $(KERNEL_IMAGE),kernelgate-kernel:latest)' KERNELGATE_FIXTURE_IMAGE='$(FIXTURE_IMAGE)' \
		'$(PY_VENV)/bin/python' -m pytest $(PY_GVISOR_TESTS) -v \
		--timeout=$(PYTEST_TIMEOUT) --durations=10 -p no:cacheprovider
	$(call CLOCK,done)

# E2B's pause and resume, snapshots, forks, commands, terminals and watches once more on the gVisor
# engine (runsc driven directly, no Docker; the kernel image imported into the tests' image
# store, tests/python/conftest.py): where the engine changes what happens (its whole-kernel
# pause keeps a generator, which Docker's refuses by name). About 80 s.
PY_ENGINE_TESTS := pause or generator or snapshot or fork or commands or terminal or watch
python-tests-engine: python-venv
	$(call CLOCK,starts)
	cd '$(PYTHON_ROOT)' && KERNELGATE_RUNTIME=runsc KERNELGATE_ENGINE=gvisor KERNELGATE_IMAGE='$(or $(KERNEL_IMAGE),kernelgate-kernel:latest)' \
		'$(PY_VENV)/bin/python' -m pytest tests/python/test_e2b.py -k '$(PY_ENGINE_TESTS)' -v \
		--timeout=$(PYTEST_TIMEOUT) --durations=10 -p no:cacheprovider
	$(call CLOCK,done)
