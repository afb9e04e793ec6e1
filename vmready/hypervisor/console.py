"""Each VM's serial console log: appended by QEMU, capped and rotated by the daemon.

QEMU appends everything the guest writes to its ttyS0 to ``console.log`` in
the VM's run directory (``-chardev file,…,append=on``), whether or not the
daemon runs.  The daemon marks every boot with a line of its own, and keeps
the file under its cap by copying it to ``console.log.1`` and truncating it
(QEMU writes with O_APPEND, so it carries on at the new end).  Bytes the
guest writes between the copy and the truncation are lost; while the daemon
is stopped the file may pass its cap until the daemon returns.
"""

from __future__ import annotations

import contextlib
import os
import shutil

DEFAULT_CONSOLE_MAX_BYTES = 1024 * 1024
ROTATED_SUFFIX = ".1"


def console_size(path: str) -> int:
    """How many bytes the log holds now (0 when it does not exist)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def mark_boot(path: str, line: str) -> int:
    """Append ``--- vmready: <line> ---`` before a boot; returns the log's size after it."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "ab") as f:
        f.write(f"\n--- vmready: {line} ---\n".encode())
        return f.tell()


def rotate_console(path: str, max_bytes: int) -> bool:
    """Once the log passed ``max_bytes``, keep its last ``max_bytes`` in ``<path>.1`` and empty it.

    Only the tail is kept, so a log that grew far past its cap while the
    daemon was stopped does not live on, whole, as ``<path>.1``.  True if it
    rotated.
    """
    if console_size(path) <= max_bytes:
        return False
    rotated = path + ROTATED_SUFFIX
    with open(path, "rb") as source, open(rotated + ".tmp", "wb") as target:
        source.seek(max(0, os.fstat(source.fileno()).st_size - max_bytes))
        shutil.copyfileobj(source, target)
    os.replace(rotated + ".tmp", rotated)
    with open(path, "r+b") as f:
        f.truncate(0)
    return True


def read_console(path: str, limit: int) -> bytes:
    """The last ``limit`` bytes of console output, the rotated part first."""
    chunks = []
    for part in (path + ROTATED_SUFFIX, path):
        with contextlib.suppress(FileNotFoundError), open(part, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - limit))
            chunks.append(f.read(limit))
    return b"".join(chunks)[-limit:]
