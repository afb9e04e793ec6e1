"""The agent as one file for real guests: ``vmready-agent.pyz``, a zipapp of stdlib-only code.

A real guest has a stock ``python3`` (3.9 or newer) and nothing else: no
Twisted, no pyOpenSSL, no network to fetch them.  The agent
(``vmready.agent``) and the two shared modules it needs are written for exactly
that, and this module packs them, and nothing else, into a zipapp the guest
runs as ``python3 -S -I vmready-agent.pyz``.

The archive is deterministic (the same sources give the same bytes): files in
sorted order, every entry dated 1980-01-01 with mode 0644, stored uncompressed
(so the guest's Python needs no zlib to import it).  Beside each module is its
bytecode (``module.pyc``, where zipimport looks first), compiled once here by
the daemon's own Python, hash-based and unchecked: a guest whose ``python3``
is the same version (a Debian guest of the host's release) imports it without
compiling the agent's sources at every boot, which under emulation costs
seconds; any other version finds the bytecode's magic number foreign and
compiles the source, as before.  It is written to a
temporary file beside the target and renamed into place, so nobody ever sees
half an archive.  ``python -m vmready.hypervisor.agentbundle PATH`` builds one;
``--list`` prints the bundled modules' paths (the Python 3.9 type check runs
over exactly those).
"""

from __future__ import annotations

import argparse
import io
import os
import py_compile
import tempfile
import zipapp
import zipfile
from collections.abc import Sequence

__all__ = ["ENTRY_POINT", "INTERPRETER", "ZIPAPP_NAME", "build_zipapp", "bundled_files"]

ZIPAPP_NAME = "vmready-agent.pyz"
ENTRY_POINT = "vmready.agent.main:main"
INTERPRETER = "/usr/bin/env python3"
# The shared modules the agent imports, besides its own package.
SHARED_MODULES = (
    "vmready/__init__.py",
    "vmready/protocols/__init__.py",
    "vmready/protocols/ringbuffer.py",
    "vmready/protocols/transcript.py",
)
AGENT_PACKAGE = "vmready/agent"
_EPOCH = (1980, 1, 1, 0, 0, 0)
_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What zipapp itself writes as __main__.py for an entry point "module:function".
_MAIN = "# -*- coding: utf-8 -*-\nimport {module}\n{module}.{function}()\n"


def bundled_files(root: str = _SOURCE_ROOT) -> list[str]:
    """The bundled modules, as paths relative to ``root`` (the checkout), sorted."""
    package = os.path.join(root, AGENT_PACKAGE)
    agent = [
        f"{AGENT_PACKAGE}/{name}"
        for name in os.listdir(package)
        if name.endswith(".py") and os.path.isfile(os.path.join(package, name))
    ]
    return sorted([*SHARED_MODULES, *agent])


def _entry(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o100644 << 16
    info.create_system = 3  # Unix, whatever builds it
    return info


def _archive(root: str) -> bytes:
    """The zip (without the interpreter line) of the bundled modules and ``__main__.py``."""
    module, _, function = ENTRY_POINT.partition(":")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(_entry("__main__.py"), _MAIN.format(module=module, function=function))
        for name in bundled_files(root):
            with open(os.path.join(root, name), "rb") as f:
                archive.writestr(_entry(name), f.read())
            archive.writestr(_entry(name[:-3] + ".pyc"), _bytecode(root, name))
    return buffer.getvalue()


def _bytecode(root: str, name: str) -> bytes:
    """``name``'s unchecked hash-based ``.pyc``, by this interpreter (tracebacks say ``name``)."""
    fd, compiled = tempfile.mkstemp(suffix=".pyc")
    os.close(fd)
    try:
        py_compile.compile(
            os.path.join(root, name),
            cfile=compiled,
            dfile=name,
            doraise=True,
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )
        with open(compiled, "rb") as f:
            return f.read()
    finally:
        os.unlink(compiled)


def build_zipapp(path: str, root: str = _SOURCE_ROOT) -> str:
    """Write the agent's zipapp to ``path`` (a directory: ``path/vmready-agent.pyz``); its path."""
    if os.path.isdir(path):
        path = os.path.join(path, ZIPAPP_NAME)
    directory = os.path.dirname(os.path.abspath(path))
    fd, partial = tempfile.mkstemp(dir=directory, prefix=".vmready-agent-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as target:
            zipapp.create_archive(io.BytesIO(_archive(root)), target, interpreter=INTERPRETER)
        os.chmod(partial, 0o755)
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise
    return path


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m vmready.hypervisor.agentbundle [--list] [PATH]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("path", nargs="?", default=ZIPAPP_NAME, help="where to write it")
    parser.add_argument("--list", action="store_true", help="print the bundled modules' paths")
    args = parser.parse_args(argv)
    if args.list:
        for name in bundled_files():
            print(name)
        return
    print(build_zipapp(args.path))


if __name__ == "__main__":
    main()
