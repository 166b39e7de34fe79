"""The venv's `pip` and `pip3` scripts run `from pip._internal.cli.main import main`;
this `main` is Kernelgate's (see kernelgate_pip)."""


def main(args=None):
    from kernelgate_pip import main as shim_main

    return shim_main(args)
