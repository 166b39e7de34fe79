# Imported by every Python in a Kernelgate kernel container (this directory is on
# PYTHONPATH): packages installed with the kernel's `pip install` become importable, here and
# in interpreters that were already running. Never raises: a broken hook must not stop the
# interpreter. Then runs the sitecustomize this file shadows, if there is one.
try:
    import kernelgate_packages

    kernelgate_packages.install_hook()
except Exception:
    pass
else:
    try:
        kernelgate_packages.run_next_sitecustomize(__file__)
    except Exception:
        pass
