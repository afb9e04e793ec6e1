"""The builder's seam to the world: running commands (blocking), and a failed step as one line."""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Callable, Sequence

import attrs

# How long an interrupted command gets to clean up after SIGTERM.
STOP_GRACE = 60.0


# What a missing command is installed with on Debian.
_DEBIAN_PACKAGE_OF = {
    "apt-cache": "apt",
    "apt-get": "apt",
    "dpkg": "dpkg",
    "mmdebstrap": "mmdebstrap",
    "mkfs.ext4": "e2fsprogs",
    "qemu-img": "qemu-utils",
    "sh": "dash",
}


class GuestImageError(Exception):
    """The demo guest could not be built or found: one line naming the failed step and why."""


@attrs.frozen
class CommandResult:
    """What a finished command left: its exit status and its output."""

    returncode: int
    stdout: bytes
    stderr: bytes


# The seam to the world: runs argv (in cwd) to completion. OSError if it cannot start.
CommandRunner = Callable[[Sequence[str], str | None], CommandResult]


def run_command(argv: Sequence[str], cwd: str | None = None) -> CommandResult:
    """Run ``argv`` to completion with no input, capturing its output.

    Interrupted (Ctrl-C, an exception in another thread's signal handler), it
    asks the command to stop with SIGTERM and waits for it: mmdebstrap then
    unmounts what it mounted in the tree before the tree is removed.
    """
    env = dict(os.environ, LC_ALL="C.UTF-8", DEBIAN_FRONTEND="noninteractive")
    process = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        stdout, stderr = process.communicate()
    except BaseException:
        process.terminate()
        try:
            process.communicate(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
        raise
    return CommandResult(process.returncode, stdout, stderr)


def _tail(output: bytes, lines: int = 3, limit: int = 400) -> str:
    """The last few non-empty lines of ``output`` on one line."""
    text = output.decode("utf-8", "replace")
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    joined = " / ".join(kept)
    return joined if len(joined) <= limit else "…" + joined[-limit:]


def run_step(run: CommandRunner, step: str, argv: Sequence[str], cwd: str | None = None) -> bytes:
    """Run one build step's command; its stdout, or GuestImageError naming ``step``."""
    try:
        result = run(argv, cwd)
    except OSError as e:
        package = _DEBIAN_PACKAGE_OF.get(argv[0])
        hint = f" (Debian: apt-get install {package})" if package else ""
        raise GuestImageError(f"{step} failed: cannot run {argv[0]}: {e.strerror}{hint}") from e
    if result.returncode != 0:
        why = _tail(result.stderr) or _tail(result.stdout) or "no output"
        raise GuestImageError(
            f"{step} failed: {shlex.join(argv[:2])} exited with status {result.returncode}: {why}"
        )
    return result.stdout
