# Writes the kernel's home (its working directory and the state the kernel just saved)
# as an uncompressed tar to stdout, for the gateway to keep while the kernel hibernates.
# Links, devices and pipes are written as what they are, never followed: the gateway
# decides what to keep. Run in the kernel's sandbox with `python -P` from `/` (nothing in
# the home can shadow tarfile), on the home KERNELGATE_WORKDIR names. A pipe is never opened
# and a file is read only as far as the gateway reads (it stops at --hibernate-max-mb).
import os
import sys
import tarfile

os.chdir(os.environ.get("KERNELGATE_WORKDIR") or os.path.expanduser("~"))

with tarfile.open(fileobj=sys.stdout.buffer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
    for root, dirs, files in os.walk(".", followlinks=False):
        dirs.sort()
        for name in sorted(dirs) + sorted(files):
            tar.add(os.path.join(root, name), recursive=False)
