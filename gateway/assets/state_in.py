# Unpacks a hibernated kernel's home from the tar on stdin into the home of the fresh
# kernel that takes its place. The gateway sends only directories and regular files with
# relative paths; anything else is refused here too. Run in the kernel's sandbox with
# `python -P` from `/`, on the home KERNELGATE_WORKDIR names; exit 3 when the tar holds
# something it should not. With --files-only the saved variables (.kernelgate-state) are
# left out: they are discarded.
import os
import sys
import tarfile

os.chdir(os.environ.get("KERNELGATE_WORKDIR") or os.path.expanduser("~"))
files_only = "--files-only" in sys.argv[1:]

with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
    for member in tar:
        parts = member.name.split("/")
        if member.name.startswith("/") or ".." in parts:
            print(f"{member.name}: not a relative path", file=sys.stderr)
            sys.exit(3)
        if files_only and parts[0] == ".kernelgate-state":
            continue
        if member.isdir():
            os.makedirs(member.name, mode=0o700, exist_ok=True)
        elif member.isfile():
            source = tar.extractfile(member)
            parent = os.path.dirname(member.name)
            if parent:
                os.makedirs(parent, mode=0o700, exist_ok=True)
            with open(member.name, "wb") as out:
                while chunk := source.read(1 << 20):
                    out.write(chunk)
            os.chmod(member.name, member.mode & 0o777)
            os.utime(member.name, (member.mtime, member.mtime))
        else:
            print(f"{member.name}: not a file or directory", file=sys.stderr)
            sys.exit(3)
