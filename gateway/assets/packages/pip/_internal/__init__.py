"""Kernelgate's stand-in for pip's internals: only the entry points pip's scripts import."""


def main(args=None):
    from kernelgate_pip import main as shim_main

    return shim_main(args)
