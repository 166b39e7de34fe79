# `python -m pip ...` (what %pip runs) in a Kernelgate kernel.
import sys

from kernelgate_pip import main

if __name__ == "__main__":
    sys.exit(main())
