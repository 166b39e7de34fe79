# Runs inside a kernel's container (as the kernel's user) for the gateway's files API.
# Usage: python3 -c <this> OP RELPATH    (OP: get, put, list, delete; put reads stdin)
#        python3 -c <this> read RELPATH OFFSET LENGTH    (the file's size and a newline, then
#        at most LENGTH bytes from OFFSET)
# Paths are relative to the kernel's working directory; anything that would leave it
# (absolute paths, "..", symlinks pointing out) is refused. Exit codes carry the outcome.
import errno, json, os, stat, sys

OK, NOT_FOUND, BAD_PATH, IS_DIR, NOT_DIR, EXISTS_DIR, FORBIDDEN, NO_SPACE = 0, 10, 11, 12, 13, 14, 15, 16
# What an OSError means for the caller; any other is a failure of the gateway's (exit 1).
ERRNO_EXITS = {
    errno.ENOENT: NOT_FOUND,
    errno.ELOOP: BAD_PATH, errno.ENAMETOOLONG: BAD_PATH, errno.EINVAL: BAD_PATH,
    errno.ENOTDIR: NOT_DIR, errno.EEXIST: NOT_DIR, errno.EISDIR: IS_DIR, errno.ENOTEMPTY: IS_DIR,
    errno.EACCES: FORBIDDEN, errno.EPERM: FORBIDDEN, errno.EROFS: FORBIDDEN,
    errno.ENOSPC: NO_SPACE, errno.EDQUOT: NO_SPACE, errno.EFBIG: NO_SPACE,
}
ROOT = os.path.realpath(os.environ.get("KERNELGATE_WORKDIR") or os.getcwd())


def fail(code, message):
    sys.stderr.write(message)
    sys.exit(code)


def resolve(rel):
    if rel.startswith("/") or "\x00" in rel or "\\" in rel:
        fail(BAD_PATH, "paths must be relative to the working directory")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        fail(BAD_PATH, "'..' is not allowed in paths")
    path = os.path.join(ROOT, *parts)
    real = os.path.realpath(path)
    if real != ROOT and not real.startswith(ROOT + "/"):
        fail(BAD_PATH, "path leads outside the working directory (through a symlink)")
    return real


def entry(path):
    st = os.lstat(path)
    kind = "directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
    return {
        "name": os.path.basename(path),
        "path": os.path.relpath(path, ROOT),
        "type": kind,
        "size": st.st_size,
        "modified": st.st_mtime,
    }


def main():
    op, rel = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
    path = resolve(rel)
    if op == "list":
        if not os.path.exists(path):
            fail(NOT_FOUND, "no such directory")
        if not os.path.isdir(path):
            fail(NOT_DIR, "not a directory")
        items = sorted(os.listdir(path))
        json.dump([entry(os.path.join(path, n)) for n in items], sys.stdout)
    elif op == "get":
        if not os.path.exists(path):
            fail(NOT_FOUND, "no such file")
        if os.path.isdir(path):
            fail(IS_DIR, "is a directory")
        # Non-blocking: a pipe is refused, never waited on.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                fail(BAD_PATH, "not a regular file")
            while True:
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                sys.stdout.buffer.write(chunk)
    elif op == "read":
        offset, length = int(sys.argv[3]), int(sys.argv[4])
        if not os.path.exists(path):
            fail(NOT_FOUND, "no such file")
        if os.path.isdir(path):
            fail(IS_DIR, "is a directory")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                fail(BAD_PATH, "not a regular file")
            sys.stdout.buffer.write(b"%d\n" % st.st_size)
            f.seek(min(offset, st.st_size))
            while length > 0:
                chunk = f.read(min(length, 1 << 20))
                if not chunk:
                    break
                sys.stdout.buffer.write(chunk)
                length -= len(chunk)
    elif op == "put":
        if path == ROOT or os.path.isdir(path):
            fail(EXISTS_DIR, "a directory has that name")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.realpath(os.path.dirname(path)) != os.path.dirname(path):
            fail(BAD_PATH, "path leads outside the working directory (through a symlink)")
        tmp = path + ".kernelgate-upload"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                while True:
                    chunk = sys.stdin.buffer.read(1 << 20)
                    if not chunk:
                        break
                    f.write(chunk)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)  # a full disk leaves no half upload behind
            except OSError:
                pass
            raise
        json.dump(entry(path), sys.stdout)
    elif op == "delete":
        if path == ROOT:
            fail(BAD_PATH, "the working directory itself cannot be deleted")
        if not os.path.lexists(path):
            fail(NOT_FOUND, "no such file")
        if os.path.isdir(path):
            try:
                os.rmdir(path)
            except OSError:
                fail(IS_DIR, "directory is not empty")
        else:
            os.unlink(path)
    else:
        fail(BAD_PATH, "unknown operation")


try:
    main()
except OSError as e:
    fail(ERRNO_EXITS.get(e.errno, 1), f"{e.strerror}")
