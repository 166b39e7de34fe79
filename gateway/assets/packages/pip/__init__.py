"""Kernelgate's pip: `install` records packages this gateway allowlisted and synced (the
kernel has no network); other commands run the real pip. See kernelgate_packages."""


def main(args=None):
    from kernelgate_pip import main as shim_main

    return shim_main(args)


def __getattr__(name):
    # The real pip's version, for code that checks `pip.__version__`.
    if name == "__version__":
        import importlib.metadata

        try:
            return importlib.metadata.version("pip")
        except importlib.metadata.PackageNotFoundError:
            return "0"
    raise AttributeError(f"module 'pip' has no attribute {name!r}")
