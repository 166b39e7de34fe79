"""Saves and restores the user namespace of the IPython kernel this module is imported into,
for hibernation.

The gateway runs, as silent execute requests (no execution count, no history):

    __import__('kernelgate_state').save('/home/kernel/.kernelgate-state', lossy=False, max_bytes=N)

in the kernel it is about to remove, takes the kernel's home out as a tar, and later runs

    __import__('kernelgate_state').load('/home/kernel/.kernelgate-state')

in the fresh kernel that takes its place, before anything a client sent.

What survives:

* every variable the user defined: the names in the namespace that do not start with `_`,
  other than In, Out, exit, quit, get_ipython and the other names IPython put there itself
  (`shell.user_ns_hidden`, unless the user bound the name to something else). Each is
  pickled with cloudpickle into a file of its own: numbers, strings, containers, numpy
  arrays, pandas objects, matplotlib figures, and functions, lambdas and classes defined in
  cells (by value). Functions defined in cells get the live namespace back as their globals,
  so they see what later cells assign; instances of a class defined in a cell are instances
  of the restored class (cloudpickle tracks dynamic classes across pickles); a reference to
  the shell (get_ipython()) is the new kernel's shell;
* closed files (what `with open(...) as f:` leaves behind) come back closed;
* imported modules (`import numpy as np`): only the name and the module's name are kept,
  and the module is imported again at load;
* the execution count, the input history (In, _ih, _i, _ii, _iii, _i<n>, %history), the
  working directory and os.environ, restored exactly (HOSTNAME included, although the new
  container has another).

What does not:

* objects that hold an operating-system resource or a running computation: generators and
  coroutines, database connections (sqlite3.Connection), locks, threads, open files (read
  or write, named with their path and mode), sockets, subprocesses; and anything that
  refers to one. `save` refuses, naming every such variable (HibernateBlocked), unless
  `lossy`, which saves the rest. An open file's buffered writes are flushed to the file
  first, so the file in the home holds them either way. The names of what was lost, and of
  variables that fail to load, are printed on stderr when the first cell after the wake
  runs;
* module-level state of imported modules: attributes set on a module, its caches, random
  number generator states, matplotlib's rcParams and pyplot's list of open figures start
  afresh, as after a new import;
* shared references between variables: each variable is pickled on its own, so after
  `a = [1]; b = a` the restored `a` and `b` are two equal lists, and changing one no longer
  changes the other (within one variable, sharing and cycles are kept);
* Out, the `_<n>` output variables and every other name starting with `_`.

save() fails with HibernateBlocked (str() is one line to show the user) when

* variables cannot be pickled and not lossy:
  `cannot be saved: conn (sqlite3.Connection), gen (generator); delete them or hibernate with --hibernate-lossy`
  (an open file reads `f (open file 'data.csv' in mode 'r')`);
* the save is interrupted (the gateway does so past --hibernate-save-timeout):
  `pickling slow (Slow) was interrupted: it took too long; delete it or make it quicker to pickle`;
* max_bytes > 0 and the pickled variables take more:
  `the state would be 12.5 MiB, more than the 10 MiB allowed (--hibernate-max-mb)`
  (both reasons joined by "; " when both hold);
* the state cannot be written: `cannot write the state to DIR: No space left on device`.
It then leaves no state directory behind.

The state directory (mode 0700) holds manifest.json and vars/<n>.pkl, one pickle per
variable, in the namespace's order. manifest.json: {"version": 1, "execution_count",
"cwd", "environ", "history" (In[1:]), "history_raw" (the raw inputs, for %history),
"variables": [{"name", "file"}], "modules": [{"name", "module"}], "dropped":
[{"name", "type"}], "bytes"}. Pickles of functions defined in cells name functions of this
module, so they load where `kernelgate_state` can be imported.
"""

from __future__ import annotations

import importlib
import io
import json
import math
import os
import pickle
import shutil
import sys
import types

import cloudpickle

__all__ = ["HibernateBlocked", "save", "load"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
VARS = "vars"
# IPython's own names, never the user's data even when rebound.
IPYTHON_NAMES = frozenset({"In", "Out", "exit", "quit", "get_ipython"})
NOTICE = "Kernelgate: the kernel hibernated and these variables could not be kept: "
LOST = "Kernelgate: the kernel hibernated, but its saved state could not be loaded, so it starts afresh: "
MIB = 1 << 20
_MISSING = object()


class HibernateBlocked(Exception):
    """The state cannot be saved as asked; str() is one line to show the user."""


def save(state_dir: str, lossy: bool = False, max_bytes: int = 0) -> None:
    """Writes the kernel's user namespace into `state_dir` (removed first, then created with
    mode 0700). Raises HibernateBlocked, leaving no `state_dir`, when variables cannot be
    pickled (unless `lossy`, which leaves them out) or when the pickles pass `max_bytes`
    (if > 0)."""
    shell = _shell()
    _remove(state_dir)
    os.makedirs(os.path.join(state_dir, VARS), mode=0o700)
    try:
        # The umask may have widened makedirs' modes (and it leaves state_dir's own alone).
        os.chmod(state_dir, 0o700)
        os.chmod(os.path.join(state_dir, VARS), 0o700)
        _write_state(shell, state_dir, lossy, max_bytes)
    except BaseException:
        _remove(state_dir, quiet=True)
        raise


def load(state_dir: str) -> None:
    """Restores what `save` wrote into `state_dir` into this kernel, then removes
    `state_dir`. A variable that fails to load is left out and named, with the other lost
    ones, on stderr when the next cell runs."""
    shell = _shell()
    try:
        with open(os.path.join(state_dir, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{state_dir} holds state format {manifest.get('version')!r}; this kernel reads {FORMAT_VERSION}"
            )
    except KeyboardInterrupt:
        raise
    except BaseException as err:
        # Nothing can be restored: the user hears it at the next cell, not only the log.
        _tell_next_cell(shell, LOST + _error_text(err))
        raise
    if manifest.get("cwd"):
        try:
            os.chdir(manifest["cwd"])
        except OSError:
            pass
    _restore_environ(manifest["environ"])

    ns = shell.user_ns
    dropped = list(manifest.get("dropped", []))
    for entry in manifest["modules"]:
        try:
            ns[entry["name"]] = importlib.import_module(entry["module"])
        except KeyboardInterrupt:
            raise
        except BaseException as err:
            dropped.append({"name": entry["name"], "error": _error_text(err)})
    for entry in manifest["variables"]:
        try:
            with open(os.path.join(state_dir, entry["file"]), "rb") as f:
                ns[entry["name"]] = pickle.load(f)
        except KeyboardInterrupt:
            raise
        except BaseException as err:
            dropped.append({"name": entry["name"], "error": _error_text(err)})

    shell.execution_count = manifest["execution_count"]
    _restore_history(shell, manifest["history"], manifest.get("history_raw"))
    if dropped:
        _announce(shell, dropped)
    shutil.rmtree(state_dir)


# --- saving ---------------------------------------------------------------------------------


class _WriteFailed(Exception):
    """Writing the state failed, which is no fault of the variable being pickled."""


class _Sink:
    """The file object every variable is pickled through. It counts the bytes of the whole
    state and stops writing (counting on) once the save cannot succeed: past `limit`, or
    after `doom()`. The count goes on so that the refusal can say how large the state is and
    name every variable that cannot be pickled."""

    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0
        self.doomed = False
        self.file = None

    def doom(self) -> None:
        self.doomed = True

    def open(self, path: str) -> None:
        try:
            self.file = open(path, "xb", opener=_private)
        except OSError as err:
            raise _WriteFailed(err) from err

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        self.total += size
        if self.limit > 0 and self.total > self.limit:
            self.doomed = True
        if not self.doomed:
            try:
                self.file.write(data)
            except OSError as err:
                raise _WriteFailed(err) from err
        return size

    def close(self) -> None:
        file, self.file = self.file, None
        try:
            file.close()
        except OSError as err:
            raise _WriteFailed(err) from err

    def discard(self, path: str, total_before: int) -> None:
        """Forgets the variable being written: its file and its bytes."""
        self.total = total_before
        file, self.file = self.file, None
        try:
            file.close()
        except OSError:
            pass
        try:
            os.remove(path)
        except OSError:
            pass


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler with two changes for a kernel's namespace: the shell pickles as
    "the shell of the kernel that loads it", and functions defined in cells are rebuilt with
    the live namespace as their globals (cloudpickle would give each a private copy holding
    the globals it used at save time, so later assignments would not reach it)."""

    def __init__(self, file, shell):
        super().__init__(file, protocol=5)
        self._shell = shell
        # The open file that made this pickle fail, if one did.
        self.open_file = None

    def reducer_override(self, obj):
        if obj is self._shell:
            return _current_shell, ()
        if isinstance(obj, io.IOBase) and not _standard_stream(obj):
            # `with open(...) as f:` leaves a closed file in the namespace: nothing of it is
            # lost, so it comes back closed instead of blocking the hibernation.
            if obj.closed:
                return _closed_file, (isinstance(obj, io.TextIOBase),)
            # An open one cannot come back as it was (cloudpickle would make a read-mode
            # file an io.StringIO of its contents): it is refused, named, and what it
            # buffered reaches the file in the home.
            self.open_file = obj
            try:
                if obj.writable():
                    obj.flush()
            except (OSError, ValueError):
                pass
            raise pickle.PicklingError("an open file cannot be saved")
        return super().reducer_override(obj)

    def _dynamic_function_reduce(self, func):
        reduced = super()._dynamic_function_reduce(func)
        if func.__globals__ is not self._shell.user_ns:
            return reduced
        code, _, name, argdefs, closure = reduced[1]
        args = (code, _USER_NAMESPACE, name, argdefs, closure)
        return _make_cell_function, args, reduced[2], None, None, _set_cell_function_state


class _UserNamespace:
    """Stands for the namespace of the kernel that loads a pickle."""

    def __reduce__(self):
        return _current_namespace, ()


_USER_NAMESPACE = _UserNamespace()


def _current_shell():
    return _shell()


def _standard_stream(obj) -> bool:
    """sys.stdout and the like, which cloudpickle pickles as themselves."""
    return any(obj is stream for stream in (sys.stdout, sys.stderr, sys.stdin, sys.__stdout__, sys.__stderr__, sys.__stdin__))


def _open_file_text(f) -> str:
    name = getattr(f, "name", None)
    mode = getattr(f, "mode", None)
    shown = f"open file {name!r}" if isinstance(name, str) else "open file"
    return f"{shown} in mode {mode!r}" if isinstance(mode, str) else shown


def _closed_file(text: bool):
    f = open(os.devnull, "r" if text else "rb")
    f.close()
    return f


def _current_namespace() -> dict:
    return _shell().user_ns


def _make_cell_function(code, namespace, name, argdefs, closure):
    return types.FunctionType(code, namespace, name, argdefs, closure)


def _set_cell_function_state(func, state) -> None:
    """cloudpickle's _function_setstate, except that the globals the function used at save
    time only fill names the namespace lacks: a variable restored under that name (before
    or after this function) is the one the function sees."""
    state, slotstate = state
    func.__dict__.update(state)
    namespace = func.__globals__
    for key, value in slotstate.pop("__globals__").items():
        namespace.setdefault(key, value)
    closure = slotstate.pop("__closure__")
    # Only there to import the submodules the function uses, which unpickling it did.
    slotstate.pop("_cloudpickle_submodules", None)
    if closure is not None:
        for i, cell in enumerate(closure):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            func.__closure__[i].cell_contents = value
    for key, value in slotstate.items():
        setattr(func, key, value)


def _write_state(shell, state_dir: str, lossy: bool, max_bytes: int) -> None:
    sink = _Sink(max_bytes)
    variables: list[dict] = []
    modules: list[dict] = []
    failed: list[dict] = []
    hidden = shell.user_ns_hidden
    try:
        for name, value in list(shell.user_ns.items()):
            if (
                not isinstance(name, str)
                or name.startswith("_")
                or name in IPYTHON_NAMES
                or hidden.get(name, _MISSING) is value
            ):
                continue
            if isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) is value:
                modules.append({"name": name, "module": value.__name__})
                continue
            file = f"{VARS}/{len(variables)}.pkl"
            path = os.path.join(state_dir, file)
            total_before = sink.total
            sink.open(path)
            pickler = _Pickler(sink, shell)
            try:
                pickler.dump(value)
            except KeyboardInterrupt:
                sink.discard(path, total_before)
                raise HibernateBlocked(
                    f"pickling {name} ({_type_name(value)}) was interrupted: it took too long; delete it or make it quicker to pickle"
                ) from None
            except _WriteFailed:
                raise
            except BaseException:
                sink.discard(path, total_before)
                kind = _open_file_text(pickler.open_file) if pickler.open_file is not None else _type_name(value)
                failed.append({"name": name, "type": kind})
                if not lossy:
                    sink.doom()
                continue
            sink.close()
            variables.append({"name": name, "file": file})
    except _WriteFailed as err:
        raise HibernateBlocked(f"cannot write the state to {state_dir}: {_os_error_text(err)}") from None

    failed.sort(key=lambda entry: entry["name"])
    reasons = []
    if failed and not lossy:
        named = ", ".join(f"{entry['name']} ({entry['type']})" for entry in failed)
        reasons.append(f"cannot be saved: {named}; delete them or hibernate with --hibernate-lossy")
    if max_bytes > 0 and sink.total > max_bytes:
        reasons.append(_size_refusal(sink.total, max_bytes))
    if reasons:
        raise HibernateBlocked("; ".join(reasons))

    history = shell.history_manager
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was deleted
        cwd = None
    manifest = {
        "version": FORMAT_VERSION,
        "execution_count": shell.execution_count,
        "cwd": cwd,
        "environ": dict(os.environ),
        "history": list(history.input_hist_parsed[1:]),
        "history_raw": list(history.input_hist_raw[1:]),
        "variables": variables,
        "modules": modules,
        "dropped": failed,
        "bytes": sink.total,
    }
    # Written last: a state directory with a manifest is complete.
    try:
        with open(os.path.join(state_dir, MANIFEST), "x", encoding="utf-8", opener=_private) as f:
            json.dump(manifest, f)
    except OSError as err:
        raise HibernateBlocked(f"cannot write the state to {state_dir}: {_os_error_text(err)}") from None


# --- loading --------------------------------------------------------------------------------


def _restore_environ(saved: dict) -> None:
    for key in list(os.environ):
        if key not in saved:
            del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _restore_history(shell, parsed: list, raw: list | None) -> None:
    """In[n] (and _ih, %history) is the nth input again, and _i, _ii, _iii, _i<n> are what
    IPython had set after the last one; the next cell continues from there."""
    if raw is None or len(raw) != len(parsed):
        raw = parsed
    history = shell.history_manager
    # In place: In and _ih are the same list object as input_hist_parsed.
    history.input_hist_parsed[1:] = parsed
    history.input_hist_raw[1:] = raw
    if not raw:
        return
    inputs = [""] + list(raw)
    last = len(raw)

    def before(k: int) -> str:
        return inputs[last - k] if last - k >= 1 else ""

    history._i00, history._i, history._ii, history._iii = before(0), before(1), before(2), before(3)
    shell.user_ns.update({"_i": history._i, "_ii": history._ii, "_iii": history._iii})
    shell.user_ns.update({f"_i{n}": inputs[n] for n in range(1, last + 1)})


def _announce(shell, dropped: list[dict]) -> None:
    """Prints, once, on stderr of the next cell the user runs, which variables were lost."""
    listed = ", ".join(
        f"{entry['name']} ({entry.get('type') or entry.get('error')})"
        for entry in sorted(dropped, key=lambda entry: entry["name"])
    )
    _tell_next_cell(shell, NOTICE + listed)


def _tell_next_cell(shell, line: str) -> None:
    """Prints `line` once, on stderr of the next cell the user runs."""

    def notice(*_):
        shell.events.unregister("pre_run_cell", notice)
        print(line, file=sys.stderr, flush=True)

    shell.events.register("pre_run_cell", notice)


# --- shared ---------------------------------------------------------------------------------


def _shell():
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("kernelgate_state works inside an IPython kernel (get_ipython() is None)")
    return shell


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def _remove(path: str, quiet: bool = False) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass
    except OSError:
        if not quiet:
            raise


def _type_name(value) -> str:
    kind = type(value)
    module = getattr(kind, "__module__", None)
    name = getattr(kind, "__qualname__", kind.__name__)
    return name if module in (None, "builtins") else f"{module}.{name}"


def _error_text(err: BaseException) -> str:
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= 200 else text[:197] + "..."


def _os_error_text(err: Exception) -> str:
    cause = err.__cause__ if isinstance(err, _WriteFailed) else err
    return getattr(cause, "strerror", None) or str(cause)


def _mib(size: int) -> str:
    """`size` in MiB, to a tenth."""
    value = size / MIB
    if value < 0.05:
        return f"{value:.2g}"
    return f"{round(value, 1):.1f}".removesuffix(".0")


def _size_refusal(size: int, limit: int) -> str:
    shown, allowed = _mib(size), _mib(limit)
    if shown == allowed:
        # A state just over the limit must not read as the limit itself.
        shown = f"{math.ceil(size / MIB * 10) / 10:.1f}"
    return f"the state would be {shown} MiB, more than the {allowed} MiB allowed (--hibernate-max-mb)"
