#!/bin/bash
# Inside the kernel image's root filesystem, as root: creates the user `kernel` (uid/gid 1000),
# the venv /opt/kernel/venv from requirements.txt, trims it and precompiles all Python code.
# Shared by both builds: build-offline.sh runs it in the chroot (under `env -i`), the
# Dockerfile runs it in a RUN step. Expects /opt/kernel/{requirements.txt,launch.py,
# kernelgate_state.py} in place.
#
# Usage: setup-venv.sh BASE_PYTHON      (/usr/bin/python3 offline, /usr/local/bin/python3 docker)
set -euo pipefail

base_python=${1:?usage: setup-venv.sh BASE_PYTHON}
kdir=/opt/kernel
venv=$kdir/venv

# The unprivileged user the kernel runs as; its home is a tmpfs at run time.
if ! getent group kernel >/dev/null; then groupadd --gid 1000 kernel; fi
if ! getent passwd kernel >/dev/null; then
    useradd --uid 1000 --gid 1000 --home-dir /home/kernel --create-home \
        --shell /usr/sbin/nologin --comment "Kernelgate kernel" kernel
fi
chmod 0700 /home/kernel
# E2B's SDKs and the code written for them name the working directory /home/user.
ln -sfn /home/kernel /home/user
# Mount point of the per-kernel socket directory (the gateway bind-mounts over it).
install -d -o 1000 -g 1000 -m 0770 /run/kernel

"$base_python" -m venv "$venv"
# Wheels only: the image has no compiler, and a wheel-less release should fail loudly.
"$venv/bin/python" -m pip install --no-cache-dir --no-compile --only-binary=:all: \
    --disable-pip-version-check --no-input --progress-bar off -r "$kdir/requirements.txt"
"$venv/bin/python" -m pip check
# pip stays: derived images install their wheels with it (docs/custom-images.md); with no
# network in a kernel it cannot fetch anything there. setuptools is dead weight.
"$venv/bin/python" -m pip uninstall --yes --quiet --disable-pip-version-check setuptools

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
stdlib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')

# The gateway imports the state helper in the kernel (`__import__('kernelgate_state')`), but
# the launcher takes /opt/kernel off sys.path: the venv links to it instead.
ln -sf "$kdir/kernelgate_state.py" "$site/kernelgate_state.py"

# Test suites nothing imports at run time (numpy.testing, pandas._testing and
# matplotlib.testing stay); about 70 MB.
rm -rf "$site"/pandas/tests "$site"/matplotlib/tests "$site"/tornado/test
find "$site"/numpy "$site"/mpl_toolkits -depth -type d -name tests -exec rm -rf {} +
find "$site" -depth -type d -name __pycache__ -exec rm -rf {} +

# Precompile: with a read-only root and PYTHONDONTWRITEBYTECODE nothing is cached at run
# time, and imports would take ~2 s instead of ~0.6 s. unchecked-hash pycs stay valid
# whatever the file times are after tar/import. The -x patterns skip files that are
# deliberately not valid Python 3 (lib2to3's test data).
"$venv/bin/python" -m compileall -q -j 0 --invalidation-mode unchecked-hash \
    -x '/(lib2to3/tests|test)/' "$stdlib" "$site"
