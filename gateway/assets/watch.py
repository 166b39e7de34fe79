# Runs inside a kernel's container (as the kernel's user) for E2B's directory watching.
# Usage: python3 -P -c <this> RELPATH RECURSIVE(0|1) INTERVAL_MS
# Scans the directory (RELPATH, relative to the kernel's working directory) every
# INTERVAL_MS, compares each scan with the one before and prints one JSON line per change:
#   {"ready": true}                      the first scan (the baseline: no events) is taken
#   {"error": CODE, "message": ...}      refused (a Connect code), then it exits
#   {"event": "create"|"write"|"remove"|"rename"|"chmod", "name": ..., "kind": ...,
#    "size": ..., "mode": ..., "mtime_ns": ...}
#   {}                                   a heartbeat, so that a closed pipe ends it
# It also ends when its standard input does (the gateway went away).
import json, os, stat, sys, threading, time

ROOT = os.path.realpath(os.environ.get("KERNELGATE_WORKDIR") or os.getcwd())
# What the gateway's own file operations leave for a moment: never an event.
TRANSIENT = (".kernelgate-upload", ".kernelgate-make-dir")
MAX_ENTRIES = 50_000
HEARTBEAT = 5.0


def say(obj):
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def refuse(code, message):
    say({"error": code, "message": message})
    sys.exit(0)


def resolve(rel):
    if rel.startswith("/") or "\x00" in rel or "\\" in rel:
        refuse("invalid_argument", "paths must be relative to the working directory")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        refuse("invalid_argument", "'..' is not allowed in paths")
    real = os.path.realpath(os.path.join(ROOT, *parts))
    if real != ROOT and not real.startswith(ROOT + "/"):
        refuse("invalid_argument", "path leads outside the working directory (through a symlink)")
    return real


def kind(mode):
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "file" if stat.S_ISREG(mode) else "other"


def scan(top, recursive):
    """name (relative to top) -> lstat facts; symlinks are not followed."""
    seen, pending = {}, [""]
    while pending:
        prefix = pending.pop()
        try:
            it = os.scandir(os.path.join(top, prefix) if prefix else top)
        except OSError:
            continue  # gone, or not readable: nothing in it is seen
        with it:
            for e in it:
                if e.name.endswith(TRANSIENT):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                name = prefix + e.name
                seen[name] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
                if len(seen) > MAX_ENTRIES:
                    refuse("resource_exhausted",
                           f"more than {MAX_ENTRIES} entries to watch: watch a smaller directory")
                if recursive and stat.S_ISDIR(st.st_mode):
                    pending.append(name + "/")
    return seen


def event(what, name, facts):
    mode, size, mtime_ns, _ = facts
    return {"event": what, "name": name, "kind": kind(mode), "size": size,
            "mode": stat.S_IMODE(mode), "mtime_ns": mtime_ns}


def changes(old, new):
    """The events that turn scan `old` into scan `new`, as inotify would tell them."""
    out = []
    gone = {n: f for n, f in old.items() if n not in new or kind(new[n][0]) != kind(f[0])}
    # New names, and names now of another file (another kind, or a file renamed over it).
    born = {n: f for n, f in new.items() if n not in old or old[n][3] != f[3] or n in gone}
    born_by_inode = {f[3]: n for n, f in born.items()}
    old_inodes = {f[3] for f in old.values()}
    for name in sorted(gone):
        facts = gone[name]
        moved = born_by_inode.get(facts[3])
        out.append(event("rename" if moved not in (None, name) else "remove", name, facts))
    for name in sorted(born):
        facts = born[name]
        out.append(event("create", name, facts))
        # A new file with something in it was written too (one moved here was not).
        if stat.S_ISREG(facts[0]) and facts[1] > 0 and facts[3] not in old_inodes:
            out.append(event("write", name, facts))
    for name in sorted(set(old) & set(new) - set(born)):
        before, after = old[name], new[name]
        # A directory's own size and time change with its entries: those are their events.
        if not stat.S_ISDIR(after[0]) and before[1:3] != after[1:3]:
            out.append(event("write", name, after))
        if stat.S_IMODE(before[0]) != stat.S_IMODE(after[0]):
            out.append(event("chmod", name, after))
    return out


def until_stdin_ends():
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    os._exit(0)


def main():
    rel, recursive, interval = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]) / 1000
    top = resolve(rel)
    if not os.path.exists(top):
        refuse("not_found", "no such directory")
    if not os.path.isdir(top):
        refuse("invalid_argument", "not a directory")
    threading.Thread(target=until_stdin_ends, daemon=True).start()
    old = scan(top, recursive)
    say({"ready": True})
    beat = time.monotonic()
    while True:
        started = time.monotonic()
        new = scan(top, recursive)
        for e in changes(old, new):
            say(e)
        old = new
        now = time.monotonic()
        if now - beat >= HEARTBEAT:
            say({})
            beat = now
        # A large tree is scanned less often: at most a third of the time goes to scans.
        time.sleep(max(interval, 2 * (now - started)))


try:
    main()
except (BrokenPipeError, KeyboardInterrupt):
    os._exit(0)
