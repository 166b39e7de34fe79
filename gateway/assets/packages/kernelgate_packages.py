"""Packages on demand for a kernel with no network: the in-kernel half.

The gateway mounts two read-only directories into every kernel container:

- the wheelhouse tree synced for the kernel's image (``lock.json`` plus one unpacked wheel per
  directory, ``<name>-<version>/``), and
- the directory holding this module, ``sitecustomize.py``, a ``pip`` package that shadows the
  real pip, and ``allowed/<kernel spec>.json`` (this gateway's allowlist for the kernel spec).

"Installing" a package copies nothing: it records the package's tree directory in the
kernel's installed list, a JSON file in the home
(``{"installed": [{"name": ..., "version": ..., "dir": ...}]}``), written atomically. Every
Python in the container imports ``sitecustomize`` (the directory is on ``PYTHONPATH``), which
puts the recorded directories on ``sys.path`` and appends :class:`InstalledPackages` to
``sys.meta_path``. On an import that nothing else could satisfy, that finder re-reads the list
if it changed (another process installed something), appends the new directories to
``sys.path`` and retries; it also answers ``importlib.metadata`` queries for packages installed
since the interpreter started, so ``importlib.metadata.version(...)`` works before the first
import. Then ``sitecustomize`` runs the ``sitecustomize`` it shadows, if the image has one.

``python -m pip``, ``%pip`` and the venv's ``pip`` scripts reach ``kernelgate_pip.main``:

- ``pip install`` is handled here, offline, from the lock and the allowlist, all or nothing:
  a requirement already in the image is "already satisfied"; one that is not allowlisted, not
  synced, or whose locked version its specifier rejects refuses the whole command (exit 1);
  otherwise the locked closure is recorded. ``--report -`` prints one JSON line at the end for
  the gateway, and every install that installed or refused something appends a line to the
  report file, which the gateway audits as reported by the kernel.
- ``pip uninstall`` of a package installed here removes it from the list, without asking:
  interpreters started later do not see it; running ones keep its directory on ``sys.path``
  until they restart. Other packages go to the real pip.
- Any other command (``list``, ``show``, ``freeze``, ``--version``, ...) runs the real pip in a
  subprocess, ``python -P -m pip ...``, whose ``PYTHONPATH`` lacks this directory and has the
  installed tree directories instead, so it lists the image's packages and these alike.

Specifiers are checked with ``packaging`` when it can be imported; without it only the
package names are matched (and ``==`` pins compared as text).

Paths, and the environment variables that override them (for tests):

- the synced tree: ``/opt/kernelgate/packages``, ``KERNELGATE_PACKAGES_TREE``;
- the allowlist: ``KERNELGATE_PACKAGES_ALLOWED`` (set by the gateway; unset, nothing is
  allowed);
- the install report, JSON lines: ``/run/kernel/installs.jsonl``,
  ``KERNELGATE_PACKAGES_REPORT``;
- the installed list: ``$HOME/.kernelgate-packages.json`` (follows ``HOME``).

This module is imported at every interpreter start: it imports only ``os`` and ``sys`` at the
top and everything else where it is used.
"""

import os
import sys

TREE_VAR = "KERNELGATE_PACKAGES_TREE"
DEFAULT_TREE = "/opt/kernelgate/packages"
ALLOWED_VAR = "KERNELGATE_PACKAGES_ALLOWED"
REPORT_VAR = "KERNELGATE_PACKAGES_REPORT"
DEFAULT_REPORT = "/run/kernel/installs.jsonl"
LIST_NAME = ".kernelgate-packages.json"
# Set in the real pip's environment; seeing it here means the shim called itself.
REAL_PIP_VAR = "KERNELGATE_PIP_REAL"

SHIM_DIR = os.path.dirname(os.path.abspath(__file__))


def normalize(name):
    """The PEP 503 form of a project name, the key everywhere in lock and lists."""
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def tree_dir():
    return os.environ.get(TREE_VAR) or DEFAULT_TREE


def list_path():
    home = os.environ.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, LIST_NAME)


def _plain_name(value):
    """Whether `value` is one path component (a tree directory name from a file)."""
    return (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and "/" not in value
        and "\0" not in value
    )


def _read_json(path):
    import json

    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_installed(path):
    """The installed list at `path`; empty when missing or unreadable. Entries that are not
    name/version/plain dir are dropped; other fields are kept."""
    try:
        data = _read_json(path)
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("installed"), list):
        data = {} if not isinstance(data, dict) else data
        data["installed"] = []
    data["installed"] = [
        e
        for e in data["installed"]
        if isinstance(e, dict)
        and isinstance(e.get("name"), str)
        and isinstance(e.get("version"), str)
        and _plain_name(e.get("dir"))
    ]
    return data


def installed_dirs(path, tree):
    """The tree directories of the entries in the installed list at `path`, in its order."""
    dirs = []
    for entry in read_installed(path)["installed"]:
        d = os.path.join(tree, entry["dir"])
        if d not in dirs:
            dirs.append(d)
    return dirs


# ---------------------------------------------------------------------------------------
# The import hook


class InstalledPackages:
    """A `sys.meta_path` finder (last in line) for packages installed after this interpreter
    started. It is consulted only for imports nothing else found, so the common path costs
    one `stat` of the installed list per miss."""

    def __init__(self, list_file, tree):
        import _thread

        self._list_file = list_file
        self._tree = tree
        self._stamp = None
        self._dirs = []
        self._added = set()
        self._lock = _thread.allocate_lock()
        # Threads inside the hook: anything it imports itself must not come back here.
        self._busy = set()
        self._ident = _thread.get_ident

    def _refresh(self):
        try:
            st = os.stat(self._list_file)
            # The inode changes on every atomic rewrite, even within the mtime's granularity.
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp != self._stamp:
            # Read outside the lock: reading may import json, and an import in another
            # thread may be waiting for the lock.
            dirs = installed_dirs(self._list_file, self._tree) if stamp else []
            with self._lock:
                self._stamp, self._dirs = stamp, dirs

    def add_to_path(self):
        """Appends the directories of entries not seen yet to sys.path (each once, ever);
        returns the ones appended."""
        self._refresh()
        with self._lock:
            new = [d for d in self._dirs if d not in self._added]
            for d in new:
                self._added.add(d)
                if d not in sys.path:
                    sys.path.append(d)
            return new

    def find_spec(self, fullname, path=None, target=None):
        ident = self._ident()
        if ident in self._busy:
            return None
        self._busy.add(ident)
        try:
            if not self.add_to_path():
                return None
            import importlib
            import importlib.machinery

            importlib.invalidate_caches()
            return importlib.machinery.PathFinder.find_spec(fullname, path)
        except Exception:
            return None
        finally:
            self._busy.discard(ident)

    def find_distributions(self, context=None):
        """Distributions in installed tree directories that are not on sys.path yet, for a
        search of sys.path (a search of explicit paths gets nothing from here)."""
        ident = self._ident()
        if context is None or ident in self._busy:
            return iter(())
        if vars(context).get("path", sys.path) is not sys.path:
            return iter(())
        self._busy.add(ident)
        try:
            import importlib.metadata as metadata

            self._refresh()
            with self._lock:
                dirs = [d for d in self._dirs if d not in sys.path]
            if not dirs:
                return iter(())
            inner = metadata.DistributionFinder.Context(name=context.name, path=dirs)
            return iter(list(metadata.MetadataPathFinder.find_distributions(inner)))
        except Exception:
            return iter(())
        finally:
            self._busy.discard(ident)


def install_hook():
    """Puts already-installed packages on sys.path and appends the finder (once); makes a
    refused ``%pip install`` fail its cell."""
    for finder in sys.meta_path:
        if type(finder).__name__ == InstalledPackages.__name__:
            return finder
    finder = InstalledPackages(list_path(), tree_dir())
    finder.add_to_path()
    sys.meta_path.append(finder)
    sys.meta_path.insert(0, PipMagicPatch())
    return finder


class PipInstallRefused(Exception):
    """A ``%pip install`` that installed nothing: the refusal, as the cell's error."""


class PipMagicPatch:
    """A meta path finder that finds nothing itself: when IPython loads its packaging magics,
    it has ``%pip`` fail the cell (status ``error``, :class:`PipInstallRefused` with the
    refusal) when ``pip install`` exits non-zero, where IPython only prints what the command
    said and the cell succeeds: an agent reading the status would think it installed."""

    TARGET = "IPython.core.magics.packaging"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.TARGET:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(fullname, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            try:
                patch_pip_magic(module)
            except Exception:
                pass  # IPython changed: %pip works as it does there

        loader.exec_module = exec_and_patch
        return spec


def patch_pip_magic(module):
    """Wraps ``PackagingMagics.pip`` of IPython's packaging module ``module``."""
    import functools

    magics = module.PackagingMagics
    original = magics.pip

    @functools.wraps(original)
    def pip(self, line):
        __tracebackhide__ = True
        report = os.environ.get(REPORT_VAR) or DEFAULT_REPORT
        try:
            start = os.path.getsize(report)
        except OSError:
            start = 0
        original(self, line)
        status = self.shell.user_ns.get("_exit_code", 0)
        if status and _is_install(line):
            why = _refusals(report, start) or f"pip install exited with status {status}"
            raise PipInstallRefused(why)

    magics.pip = pip


def _is_install(line):
    import shlex

    from kernelgate_pip import _subcommand

    try:
        args = shlex.split(line)
    except ValueError:
        return False
    index = _subcommand(args)
    return index is not None and args[index] == "install"


def _refusals(report, start):
    """The reasons of what installs refused since byte ``start`` of the report file."""
    import json

    reasons = []
    try:
        with open(report, "rb") as f:
            f.seek(start)
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return ""
    for line in lines:
        try:
            refused = json.loads(line).get("refused") or []
        except (ValueError, AttributeError):
            continue
        for entry in refused:
            if isinstance(entry, dict) and entry.get("reason"):
                reasons.append(str(entry["reason"]))
    return "; ".join(dict.fromkeys(reasons))


def run_next_sitecustomize(own_file):
    """Runs the `sitecustomize` ours shadows (the image's or the base Python's), if any, the
    way site.py would: errors are reported on stderr and do not stop the interpreter."""
    # The PathFinder already on sys.meta_path: importing importlib.machinery (and
    # importlib.util) here would cost every interpreter a few milliseconds.
    finder = next((f for f in sys.meta_path if getattr(f, "__name__", "") == "PathFinder"), None)
    if finder is None:
        import importlib.machinery

        finder = importlib.machinery.PathFinder
    own = os.path.realpath(os.path.dirname(own_file))
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != own]
    spec = finder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or not spec.origin:
        return
    if os.path.realpath(spec.origin) == os.path.realpath(own_file):
        return
    module = type(sys)("sitecustomize")
    module.__file__ = spec.origin
    module.__spec__ = spec
    module.__loader__ = spec.loader
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.stderr.write(
            f"Error in sitecustomize ({spec.origin}); set PYTHONVERBOSE for traceback:\n"
            f"{type(err).__name__}: {err}\n"
        )
