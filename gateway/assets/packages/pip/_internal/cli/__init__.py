"""Kernelgate's stand-in for pip's command line package."""
