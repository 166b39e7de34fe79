"""Kernelgate's pip command (see kernelgate_packages for the whole design): `pip install`
offline from this gateway's allowlist and wheelhouse, `pip uninstall` of what it installed,
anything else through the real pip. Kept apart from the import hook, which every interpreter
loads at start, so that only pip pays for compiling this (the read-only mount keeps no
bytecode).
"""

import os
import sys

from kernelgate_packages import (
    ALLOWED_VAR,
    REPORT_VAR,
    DEFAULT_REPORT,
    REAL_PIP_VAR,
    SHIM_DIR,
    normalize,
    tree_dir,
    list_path,
    _plain_name,
    _read_json,
    read_installed,
    installed_dirs,
)

# ---------------------------------------------------------------------------------------
# pip: output


class _Output:
    def __init__(self, quiet=0):
        self.quiet = quiet

    def info(self, line):
        if self.quiet < 1:
            print(line, flush=True)

    def warning(self, line):
        if self.quiet < 2:
            sys.stdout.flush()
            print(f"WARNING: {line}", file=sys.stderr, flush=True)

    def error(self, line):
        sys.stdout.flush()
        print(f"ERROR: {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# pip: requirements

NOT_BY_NAME = (
    "this kernel installs only allowlisted packages by name "
    "(no paths, URLs, VCS links or builds: it has no network)"
)


class Requirement:
    """One requirement by name: the project `name` as written, its normalized `key`, the
    `specifier` and `marker` as strings and whether the marker holds here."""

    def __init__(self):
        self.name = ""
        self.key = ""
        self.specifier = ""
        self.marker = ""
        self.applies = True
        self._spec = None

    def satisfied_by(self, version):
        if self._spec is not None:
            return self._spec.contains(version, prereleases=True)
        # Without packaging: names only, plus exact pins compared as text.
        for clause in filter(None, (c.strip() for c in self.specifier.split(","))):
            if clause.startswith("==") and "*" not in clause:
                if clause.lstrip("=").strip() != version:
                    return False
        return True


def _looks_like_location(text):
    import re

    head = text.split(";", 1)[0].strip()
    lowered = head.lower()
    return (
        "://" in head
        or lowered.startswith(("git+", "hg+", "svn+", "bzr+", "file:"))
        or head.startswith((".", "/", "~"))
        or "/" in head
        or "\\" in head
        or lowered.endswith((".whl", ".zip", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar"))
        or re.match(r"^[A-Za-z0-9._-]+\s*(\[[^\]]*\])?\s*@", head) is not None
    )


def parse_requirement(text):
    """A Requirement, or why `text` is not one (a one-line str; NOT_BY_NAME for paths, URLs
    and VCS links)."""
    import re

    if _looks_like_location(text):
        return NOT_BY_NAME
    req = Requirement()
    try:
        from packaging.requirements import InvalidRequirement
        from packaging.requirements import Requirement as Parsed
    except ImportError:
        match = re.match(
            r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(\[[^\]]*\])?\s*([^;]*)(;.*)?$",
            text,
        )
        if not match:
            return "not a requirement"
        req.name = match.group(1)
        req.specifier = match.group(3).strip().strip("()").strip()
        req.marker = (match.group(4) or "")[1:].strip()
    else:
        try:
            parsed = Parsed(text)
        except InvalidRequirement as err:
            return (str(err).strip().splitlines() or ["not a requirement"])[0]
        if parsed.url:
            return NOT_BY_NAME
        req.name = parsed.name
        req._spec = parsed.specifier
        req.specifier = str(parsed.specifier)
        if parsed.marker is not None:
            req.marker = str(parsed.marker)
            try:
                req.applies = parsed.marker.evaluate()
            except Exception:
                req.applies = True
    req.key = normalize(req.name)
    return req


# ---------------------------------------------------------------------------------------
# pip: command lines

# Options of `pip install` (and pip's general options) that take a value.
_VALUED = {
    "-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-t", "--target",
    "--platform", "--python-version", "--implementation", "--abi", "--root", "--prefix",
    "--src", "--upgrade-strategy", "-C", "--config-settings", "--global-option",
    "--install-option", "--report", "-i", "--index-url", "--extra-index-url", "-f",
    "--find-links", "--no-binary", "--only-binary", "--progress-bar", "--root-user-action",
    "--python", "--log", "--log-file", "--local-log", "--proxy", "--retries", "--timeout",
    "--exists-action", "--trusted-host", "--cert", "--client-cert", "--cache-dir",
    "--use-feature", "--use-deprecated", "--keyring-provider", "--hash",
}
# Options that change nothing here (no network, wheels only): accepted silently.
_SILENT = {
    "--no-cache-dir", "--disable-pip-version-check", "--no-input", "--no-color",
    "--no-warn-script-location", "--no-warn-conflicts", "--no-compile", "--compile",
    "--prefer-binary", "--no-index", "--isolated", "-v", "--verbose", "--require-virtualenv",
    "--no-python-version-warning", "--pre", "--progress-bar", "--only-binary",
    "--root-user-action", "--upgrade-strategy", "--cache-dir", "--retries", "--timeout",
    "--exists-action", "--break-system-packages",
}
# Options that would build or install something other than an allowlisted wheel by name.
_REFUSED = {
    "--no-build-isolation", "--no-binary", "-e", "--editable", "--use-pep517",
    "--no-use-pep517", "-C", "--config-settings", "--global-option", "--install-option",
}
_SHORT_FLAGS = {"q": "--quiet", "U": "--upgrade", "v": "--verbose", "I": "--ignore-installed",
                "h": "--help", "y": "--yes"}
_SHORT_VALUED = {"-r", "-c", "-e", "-t", "-i", "-f", "-C"}


def _split_options(args):
    """(option, value or None) pairs and positional arguments, the way optparse reads pip's
    command lines (`--opt=value`, `--opt value`, `-rFILE`, `-qU`)."""
    items = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            items.extend((None, a) for a in args[i:])
            break
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if not eq and name in _VALUED:
                value = args[i] if i < len(args) else ""
                i += 1
                eq = "="
            items.append((name, value if eq else None))
        elif arg.startswith("-") and len(arg) > 1:
            if arg[:2] in _SHORT_VALUED:
                value = arg[2:]
                if not value:
                    value = args[i] if i < len(args) else ""
                    i += 1
                items.append((arg[:2], value))
            else:
                for ch in arg[1:]:
                    items.append((_SHORT_FLAGS.get(ch, f"-{ch}"), None))
        else:
            items.append((None, arg))
    return items


def _subcommand(args):
    """The index of pip's subcommand in `args`, or None."""
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            return i
        if arg in _VALUED:
            i += 1
        i += 1
    return None


class InstallOptions:
    def __init__(self):
        self.quiet = 0
        self.no_deps = False
        self.dry_run = False
        self.report = None
        self.help = False
        self.requirements = []  # as written
        self.files = []
        self.ignored = []
        self.refused = []  # (what, reason)
        self.errors = []


def _parse_install(args):
    opts = InstallOptions()
    for name, value in _split_options(args):
        if name is None:
            opts.requirements.append(value)
        elif name in ("-q", "--quiet"):
            opts.quiet += 1
        elif name in ("-U", "--upgrade", "--force-reinstall", "-I", "--ignore-installed"):
            pass  # one version per package is available; installing it is all there is
        elif name == "--no-deps":
            opts.no_deps = True
        elif name == "--dry-run":
            opts.dry_run = True
        elif name == "--report":
            opts.report = value
        elif name in ("-h", "--help"):
            opts.help = True
        elif name in ("-r", "--requirement"):
            opts.files.append(value)
        elif name in _REFUSED:
            what = f"{name} {value}" if value else name
            opts.refused.append((what, f"{name} is not supported: {NOT_BY_NAME}"))
        elif name in _SILENT:
            pass
        else:
            opts.ignored.append(name)
    return opts


def _read_requirements_file(path, opts, depth=0):
    """Appends the requirements of a requirements file (and of the files it includes)."""
    import re

    if depth > 10:
        opts.errors.append(f"Requirements files nest too deeply at {path}")
        return
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        opts.errors.append(f"Could not open requirements file: {err}")
        return
    text = re.sub(r"\\\n", "", text)
    for raw in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line:
            continue
        if line.startswith("-"):
            for name, value in _split_options(line.split()):
                if name in ("-r", "--requirement"):
                    nested = os.path.join(os.path.dirname(path), value)
                    _read_requirements_file(nested, opts, depth + 1)
                elif name in _REFUSED:
                    what = f"{name} {value}" if value else name
                    opts.refused.append((what, f"{name} is not supported: {NOT_BY_NAME}"))
                elif name is not None and name not in _SILENT:
                    opts.ignored.append(name)
            continue
        # Per-requirement options (`--hash=...`) follow the requirement.
        requirement = re.split(r"\s+--?[A-Za-z]", line, maxsplit=1)[0].strip()
        opts.requirements.append(requirement)


INSTALL_USAGE = """Usage:
  pip install [options] <requirement specifier> ...
  pip install [options] -r <requirements file> ...

This kernel has no network. `pip install` records packages an operator allowlisted and synced
for this kernel's image; they are importable at once.

Options:
  -r, --requirement <file>  Install from the given requirements file.
  -U, --upgrade             Accepted; each package has one synced version.
  --no-deps                 Don't install package dependencies.
  --dry-run                 Show what would be installed.
  --report <file>           Write a JSON report ('-' for stdout).
  -q, --quiet               Give less output.
Other pip options are ignored with a warning; builds, paths and URLs are refused."""


# ---------------------------------------------------------------------------------------
# pip: the gateway's files


def _read_allowed():
    """(normalized name -> allowlist entry, what an operator does to add one), from the
    allowlist file; an unreadable or missing file allows nothing."""
    path = os.environ.get(ALLOWED_VAR)
    data = {}
    if path:
        try:
            data = _read_json(path)
        except (OSError, ValueError):
            data = {}
    if not isinstance(data, dict):
        data = {}
    allowed = {}
    for entry in data.get("entries") or []:
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            allowed.setdefault(normalize(entry["name"]), entry)
    how = data.get("how_to_add")
    if not isinstance(how, str) or not how.strip():
        how = "an operator adds it to the gateway's package allowlist and syncs the wheelhouse"
    how = how.strip()
    how = how[0].upper() + how[1:]
    if not how.endswith("."):
        how += "."
    return allowed, how


def _read_lock(tree):
    try:
        lock = _read_json(os.path.join(tree, "lock.json"))
    except (OSError, ValueError):
        lock = {}
    if not isinstance(lock, dict):
        lock = {}
    for field in ("requirements", "packages"):
        if not isinstance(lock.get(field), dict):
            lock[field] = {}
    if not isinstance(lock.get("refused"), list):
        lock["refused"] = []
    return lock


def _sync_refusal(lock, key):
    """Why the last sync refused the allowlist entry `key`, if it did."""
    for refusal in lock["refused"]:
        if not isinstance(refusal, dict) or not isinstance(refusal.get("requirement"), str):
            continue
        req = parse_requirement(refusal["requirement"])
        if isinstance(req, Requirement) and req.key == key:
            return str(refusal.get("reason") or "no reason given")
    return None


def _image_distribution(key, tree):
    """The image's distribution of `key` (found outside the wheelhouse), or None."""
    import importlib.metadata as metadata

    tree_real = os.path.realpath(tree)
    excluded = (tree_real + os.sep, os.path.realpath(SHIM_DIR))
    paths = []
    for p in sys.path:
        real = os.path.realpath(p or os.curdir)
        if real == tree_real or real.startswith(excluded[0]) or real == excluded[1]:
            continue
        paths.append(p)
    for dist in metadata.distributions(name=key, path=paths):
        try:
            if normalize(dist.metadata["Name"] or "") == key:
                return dist
        except Exception:
            continue
    return None


def _free_mib(path):
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize // (1 << 20)


def write_installed(path, data):
    """Replaces the installed list atomically; on failure the old list stays and no
    temporary file is left behind."""
    import json

    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _save_installed(path, data, out, what):
    """Writes the list; prints and returns the error message when it cannot, else None."""
    import errno

    try:
        write_installed(path, data)
        return None
    except OSError as err:
        if err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            message = (
                f"No space left in the kernel's home to record the {what} "
                f"({_free_mib(os.path.dirname(path))} MiB free); delete files and try again."
            )
        else:
            message = f"Cannot record the {what} in {path}: {err.strerror or err}"
        out.error(message)
        return message


class _ListLock:
    """An advisory lock on the home directory, so two pips do not interleave their
    read-modify-write of the installed list. Best effort: no lock, no wait."""

    def __init__(self, path):
        self._dir = os.path.dirname(path) or os.curdir
        self._fd = None

    def __enter__(self):
        try:
            import fcntl

            self._fd = os.open(self._dir, os.O_RDONLY)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except (OSError, ImportError):
            self._close()
        return self

    def __exit__(self, *exc):
        self._close()

    def _close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _append_report(argv, requested, installed, refused):
    """One JSON line for the gateway's audit log; any failure is ignored."""
    import datetime
    import json

    path = os.environ.get(REPORT_VAR) or DEFAULT_REPORT
    now = datetime.datetime.now(datetime.timezone.utc)
    line = json.dumps(
        {
            "time": now.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "argv": argv,
            "requested": requested,
            "installed": installed,
            "refused": refused,
        }
    )
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o660)
    except OSError:
        return
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def _print_report(target, installed, already, refused, out):
    import json

    text = json.dumps({"installed": installed, "already": already, "refused": refused})
    if target == "-":
        print(text, flush=True)
        return
    try:
        with open(target, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    except OSError as err:
        out.error(f"Cannot write the report to {target}: {err.strerror or err}")


# ---------------------------------------------------------------------------------------
# pip install


def _described(packages):
    """`a-1.0 b-2.0`, sorted by name, as pip's "Successfully installed" line has it."""
    ordered = sorted(packages, key=lambda e: normalize(e["name"]))
    return " ".join(f"{e['name']}-{e['version']}" for e in ordered)


def install(args, argv):
    """`pip install ARGS`; returns the exit status."""
    opts = _parse_install(args)
    out = _Output(opts.quiet)
    if opts.help:
        print(INSTALL_USAGE)
        return 0
    for path in opts.files:
        _read_requirements_file(path, opts)
    for message in opts.errors:
        out.error(message)
    if opts.errors:
        return 1
    if opts.ignored:
        names = ", ".join(dict.fromkeys(opts.ignored))
        out.warning(f"ignoring {names}: packages come from this gateway's wheelhouse")
    if not opts.requirements and not opts.refused:
        out.error('You must give at least one requirement to install (see "pip help install")')
        return 1

    tree = tree_dir()
    listed = list_path()
    refused = []  # report entries
    already = []
    requested = []

    def refuse(requirement, message, *more, reason=None):
        out.error(message)
        for line in more:
            print(line, file=sys.stderr, flush=True)
        refused.append({"requirement": requirement, "reason": reason or message})

    for what, reason in opts.refused:
        refuse(what, f"Cannot install with {what}: {reason}.")

    with _ListLock(listed):
        allowed, how_to_add = _read_allowed()
        lock = _read_lock(tree)
        installed_list = read_installed(listed)
        by_key = {normalize(e["name"]): e for e in installed_list["installed"]}
        plan = {}  # key -> lock entry, in collection order
        order = []  # keys in install order (dependencies first)
        planned_by = []  # the requirements that brought something to install

        for text in opts.requirements:
            req = parse_requirement(text)
            if isinstance(req, str):
                requested.append(text)
                if req == NOT_BY_NAME:
                    refuse(text, f"Cannot install '{text}': {NOT_BY_NAME}.")
                else:
                    refuse(text, f"Invalid requirement: {text!r}: {req}")
                continue
            if not req.applies:
                out.info(
                    f"Ignoring {req.name}: markers '{req.marker}' don't match your environment"
                )
                continue
            requested.append(req.key)

            dist = _image_distribution(req.key, tree)
            if dist is not None and req.satisfied_by(dist.version):
                location = str(dist.locate_file("")).rstrip("/")
                out.info(f"Requirement already satisfied: {text} in {location} ({dist.version})")
                already.append({"name": dist.metadata["Name"], "version": dist.version})
                continue

            if req.key not in allowed:
                names = sorted(e.get("name", k) for k, e in allowed.items())
                if names:
                    shown = ", ".join(names[:20])
                    if len(names) > 20:
                        shown += f", ... ({len(names) - 20} more)"
                    listing = f"Allowed packages: {shown}"
                else:
                    listing = "No packages are allowed for this kernel."
                refuse(
                    text,
                    f"Package '{req.name}' is not in this gateway's package allowlist, so it "
                    f"cannot be installed in this kernel (it has no network). {how_to_add}",
                    listing,
                )
                continue

            not_synced = (
                f"Package '{req.name}' is allowed but not synced for this kernel's image yet: "
                f"an operator runs `kernelgate packages sync`."
            )
            locked = lock["requirements"].get(req.key)
            if not isinstance(locked, dict):
                why = _sync_refusal(lock, req.key)
                more = [f"The last sync refused it: {why}"] if why else []
                # The sync's reason is the one that says what to do: the cell's error
                # carries it too.
                refuse(text, not_synced, *more, reason=" ".join([not_synced, *more]))
                continue

            top = lock["packages"].get(req.key)
            if not isinstance(top, dict) or not isinstance(top.get("version"), str):
                refuse(text, not_synced)
                continue
            if not req.satisfied_by(top["version"]):
                display = top.get("name") or req.name
                refuse(
                    text,
                    f"this gateway provides {display} {top['version']}, which does not "
                    f"satisfy '{text}'.",
                )
                continue

            closure = [k for k in locked.get("packages") or [req.key] if isinstance(k, str)]
            if req.key in closure:
                closure.remove(req.key)
            closure.insert(0, req.key)
            if opts.no_deps:
                closure = closure[:1]
            entries = []
            for key in closure:
                pkg = lock["packages"].get(key)
                if isinstance(pkg, dict) and pkg.get("in_image"):
                    continue  # the image has it (the lock never lists these here)
                if not (
                    isinstance(pkg, dict)
                    and isinstance(pkg.get("version"), str)
                    and _plain_name(pkg.get("dir"))
                    and os.path.isdir(os.path.join(tree, pkg["dir"]))
                ):
                    entries = None
                    break
                entries.append((key, pkg))
            if entries is None:
                refuse(text, not_synced)
                continue

            for key, pkg in entries:
                display = pkg.get("name") or key
                dependent = "" if key == req.key else f" (from {req.name})"
                have = by_key.get(key)
                if have and have["version"] == pkg["version"] and have["dir"] == pkg["dir"]:
                    location = os.path.join(tree, pkg["dir"])
                    shown = text if key == req.key else display
                    out.info(
                        f"Requirement already satisfied: {shown} in {location}{dependent} "
                        f"({pkg['version']})"
                    )
                    entry = {"name": display, "version": pkg["version"]}
                    if entry not in already:
                        already.append(entry)
                    continue
                if key in plan:
                    continue
                out.info(f"Collecting {text if key == req.key else display}{dependent}")
                plan[key] = pkg
                if text not in planned_by:
                    planned_by.append(text)
            for key, _pkg in reversed(entries):
                if key in plan and key not in order:
                    order.append(key)

        installed = [
            {"name": plan[k].get("name") or k, "version": plan[k]["version"]} for k in order
        ]
        status = 0
        if refused:
            installed = []
            status = 1
        elif installed and opts.dry_run:
            out.info(f"Would install {_described(installed)}")
            installed = []
        elif installed:
            entries = [e for e in installed_list["installed"] if normalize(e["name"]) not in plan]
            for k in order:
                pkg = plan[k]
                entries.append(
                    {"name": pkg.get("name") or k, "version": pkg["version"], "dir": pkg["dir"]}
                )
            installed_list["installed"] = entries
            out.info("Installing collected packages: " + ", ".join(e["name"] for e in installed))
            failure = _save_installed(listed, installed_list, out, "install")
            if failure is None:
                out.info(f"Successfully installed {_described(installed)}")
            else:
                refused = [{"requirement": t, "reason": failure} for t in planned_by]
                installed = []
                status = 1

    if opts.report:
        _print_report(opts.report, installed, already, refused, out)
    if (installed or refused) and not opts.dry_run:
        _append_report(argv, requested, installed, refused)
    return status


# ---------------------------------------------------------------------------------------
# pip uninstall and the real pip


def uninstall(args, general):
    """`pip uninstall ARGS`: packages installed here leave the installed list; the others
    go to the real pip. `general` are pip's options given before the subcommand."""
    names = []
    passthrough = []
    quiet = 0
    out = _Output()
    for name, value in _split_options(args):
        if name is None:
            names.append(value)
        elif name in ("-r", "--requirement"):
            opts = InstallOptions()
            _read_requirements_file(value, opts)
            for message in opts.errors:
                out.error(message)
            if opts.errors:
                return 1
            names.extend(opts.requirements)
        else:
            if name in ("-q", "--quiet"):
                quiet += 1
            passthrough.append(name if value is None else f"{name}={value}")
    out.quiet = quiet

    listed = list_path()
    mine = []
    others = []
    with _ListLock(listed):
        data = read_installed(listed)
        by_key = {normalize(e["name"]): e for e in data["installed"]}
        for text in names:
            req = parse_requirement(text)
            key = req.key if isinstance(req, Requirement) else None
            if key in by_key and by_key[key] not in mine:
                mine.append(by_key[key])
            elif key not in by_key:
                others.append(text)
        if mine:
            data["installed"] = [e for e in data["installed"] if e not in mine]
            if _save_installed(listed, data, out, "uninstall") is not None:
                return 1
            for e in mine:
                out.info(f"Found existing installation: {e['name']} {e['version']}")
                out.info(f"Uninstalling {e['name']}-{e['version']}:")
                out.info(f"  Successfully uninstalled {e['name']}-{e['version']}")
    if others or not names:
        return run_real_pip(general + ["uninstall"] + passthrough + others)
    return 0


def run_real_pip(args):
    """Runs the real pip (`python -P -m pip ARGS`) without this directory and with the
    installed tree directories on its PYTHONPATH; returns its exit status."""
    import subprocess

    if os.environ.get(REAL_PIP_VAR):
        print(
            "ERROR: the real pip is not reachable (the kernelgate shim found itself)",
            file=sys.stderr,
        )
        return 1
    own = os.path.realpath(SHIM_DIR)
    parts = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and os.path.realpath(p) != own
    ]
    for d in installed_dirs(list_path(), tree_dir()):
        if d not in parts and os.path.isdir(d):
            parts.append(d)
    env = dict(os.environ)
    env[REAL_PIP_VAR] = "1"
    # The kernel has no network: the version check could only wait for a timeout.
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    if parts:
        env["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        env.pop("PYTHONPATH", None)
    # -P: the working directory stays off sys.path, so a `pip` there cannot be picked.
    flags = ["-P"] if sys.version_info >= (3, 11) else []
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        return subprocess.call([sys.executable, *flags, "-m", "pip", *args], env=env)
    except KeyboardInterrupt:
        return 130


def main(args=None):
    """pip's entry point: `install` and `uninstall` here, everything else to the real pip."""
    if args is None:
        args = sys.argv[1:]
    args = list(args)
    index = _subcommand(args)
    command = args[index] if index is not None else None
    if command == "install":
        return install(args[:index] + args[index + 1:], ["pip", *args])
    if command == "uninstall":
        return uninstall(args[index + 1:], args[:index])
    return run_real_pip(args)
