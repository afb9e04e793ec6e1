"""What QEMU says went wrong: its stderr and its ``-D`` log as the lines the user should see."""

from __future__ import annotations

from vmready.hypervisor.cmdline import VMSpec

# How much of the hypervisor's output vmready keeps.
OUTPUT_CAP = 64 * 1024


def error_lines(stderr: str) -> list[str]:
    """The hypervisor's stderr as the user should see it: every non-empty line but warnings."""
    lines = []
    for line in stderr.splitlines():
        if not line.strip():
            continue
        head, sep, rest = line.partition(": ")
        text = rest if sep and " " not in head else line
        if line.startswith("warning: ") or text.startswith("warning: "):
            continue
        lines.append(line)
    return lines


def read_log_lines(spec: VMSpec, limit: int = OUTPUT_CAP) -> list[str]:
    """What QEMU wrote to its ``-D`` log (where a daemonized QEMU reports errors), warnings out."""
    try:
        with open(spec.log_file, "rb") as f:
            data = f.read(limit)
    except OSError:
        return []
    return error_lines(data.decode("utf-8", "replace"))
