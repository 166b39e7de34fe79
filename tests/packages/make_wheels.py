"""Builds the packages tests' fixture wheels, offline, into the directory given as argv[1].

- kgfix-hello 1.0: one pure-Python module.
- kgfix-app 2.0: needs kgfix-dep (>=0.3), which comes along.
- kgfix-dep 0.3: the dependency.
- kgfix-denied 1.0: a good wheel that no allowlist names.
- kgfix-pth 1.0: carries a .pth file (code run at interpreter start): sync refuses it.
- kgfix-usesnumpy 1.0: needs numpy>=2, which the image has (nothing to fetch for it).
- kgfix-oldnumpy 1.0: needs numpy<2, which the image cannot have beside its own numpy.
- kgfix-native 1.0: a C extension compiled here for CPython 3.11 on x86_64 Linux (only when
  gcc and Python 3.11's headers are installed; the script says when it skips it).

Each wheel is a zip with the module, METADATA, WHEEL and RECORD, as pip expects.
"""

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile


def record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def wheel(out: str, name: str, version: str, files: dict, requires=(), summary="", tag="py3-none-any"):
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    meta = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        f"Summary: {summary or name + ' (a Kernelgate test fixture)'}",
    ] + [f"Requires-Dist: {r}" for r in requires]
    contents = dict(files)
    contents[f"{info}/METADATA"] = ("\n".join(meta) + "\n").encode()
    contents[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: kernelgate-tests\n"
        f"Root-Is-Purelib: {'true' if tag.endswith('none-any') else 'false'}\nTag: {tag}\n"
    ).encode()
    lines = [record_line(p, d) for p, d in contents.items()] + [f"{info}/RECORD,,"]
    contents[f"{info}/RECORD"] = ("\n".join(lines) + "\n").encode()
    path = os.path.join(out, f"{dist}-{version}-{tag}.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, d in contents.items():
            z.writestr(p, d)
    return path


NATIVE_C = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *add(PyObject *self, PyObject *args) {
    long a, b;
    if (!PyArg_ParseTuple(args, "ll", &a, &b)) return NULL;
    return PyLong_FromLong(a + b);
}
static PyMethodDef methods[] = {{"add", add, METH_VARARGS, "a + b, in C"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_speed", NULL, -1, methods};
PyMODINIT_FUNC PyInit__speed(void) { return PyModule_Create(&module); }
"""


def native(out: str) -> None:
    include = "/usr/include/python3.11"
    if shutil.which("gcc") is None or not os.path.exists(os.path.join(include, "Python.h")):
        print("skipping kgfix-native: needs gcc and Python 3.11's headers (python3-dev)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "speed.c")
        so = os.path.join(tmp, "_speed.so")
        with open(src, "w") as f:
            f.write(NATIVE_C)
        subprocess.run(
            ["gcc", "-shared", "-fPIC", "-O2", f"-I{include}", src, "-o", so], check=True
        )
        with open(so, "rb") as f:
            data = f.read()
    wheel(
        out, "kgfix-native", "1.0",
        {
            "kgfix_native/__init__.py": b"from ._speed import add\n",
            "kgfix_native/_speed.cpython-311-x86_64-linux-gnu.so": data,
        },
        summary="Adds in C",
        tag="cp311-cp311-linux_x86_64",
    )


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    wheel(out, "kgfix-hello", "1.0",
          {"kgfix_hello/__init__.py": b"def greet():\n    return 'hello from the wheelhouse'\n"},
          summary="Says hello")
    wheel(out, "kgfix-app", "2.0",
          {"kgfix_app/__init__.py": b"import kgfix_dep\nVALUE = kgfix_dep.BASE * 2\n"},
          requires=["kgfix-dep>=0.3"], summary="Needs kgfix-dep")
    wheel(out, "kgfix-dep", "0.3", {"kgfix_dep/__init__.py": b"BASE = 21\n"})
    wheel(out, "kgfix-denied", "1.0", {"kgfix_denied/__init__.py": b"X = 1\n"})
    wheel(out, "kgfix-pth", "1.0",
          {"kgfix_pth/__init__.py": b"X = 1\n", "kgfix_pth.pth": b"import os\n"})
    wheel(out, "kgfix-oldnumpy", "1.0", {"kgfix_oldnumpy/__init__.py": b"X = 1\n"},
          requires=["numpy<2"])
    wheel(out, "kgfix-usesnumpy", "1.0",
          {"kgfix_usesnumpy/__init__.py": b"import numpy\nTOTAL = int(numpy.arange(5).sum())\n"},
          requires=["numpy>=2"], summary="Uses the image's numpy")
    native(out)


if __name__ == "__main__":
    main()
