"""The host fence: a process of its own that kills a cluster member's VMs once its lease
may have run out.

A member's daemon renews its lease in the shared store; another daemon may
take the member's name over once the lease ran out, and then runs its
instances.  The daemon itself refuses to act on a VM past its lease, but it
cannot stop a VM it started before a freeze (SIGSTOP, a stalled host) from
running on: only something that does not freeze with it can.  With ``twistd
vmready --fence vms`` the daemon starts this fence (``python -m
vmready.fence``), tells it on its standard input until when the lease surely
holds (``hold`` lines, on the system's monotonic clock), and the fence
SIGKILLs every VM process under the member's run directory when that time
passes without a newer one, or at once when told the lease is lost.

The rule is ``rule`` (no I/O), the VM processes ``victims``, the program
``program``.  This face is what the daemon and the benchmarks use; it, and
everything the fence runs, needs nothing but the standard library, so the
fence starts in a few hundredths of a second.
"""

from __future__ import annotations

import sys

from vmready.fence.victims import FENCED_MARKER, VMProcess, fenced_reason, kill_vms, vm_processes

__all__ = [
    "FENCED_MARKER",
    "FENCE_MODULE",
    "LOST_LINE",
    "VMProcess",
    "fence_command",
    "fence_margin",
    "fenced_reason",
    "hold_line",
    "kill_vms",
    "vm_processes",
]

FENCE_MODULE = "vmready.fence"
LOST_LINE = b"lost\n"
# The part of a lease the fence fires before it ends: the time to find and kill the VMs.
MAX_MARGIN_SECONDS = 1.0


def fence_margin(lease_seconds: float) -> float:
    """Seconds before the lease's end at which the fence kills: a tenth, at most a second.

    The daemon stops acting on VMs at the same moment, so a VM it starts is
    never one the fence has just killed.
    """
    return min(lease_seconds / 10, MAX_MARGIN_SECONDS)


def hold_line(until: float) -> bytes:
    """The line telling the fence the lease surely holds until ``until`` (monotonic clock)."""
    return f"hold {until!r}\n".encode("ascii")


def fence_command(run_root: str, member: str, until: float, log_path: str) -> list[str]:
    """The fence's command line: this interpreter, for member ``member``'s VMs under
    ``run_root``, holding until ``until``, logging to ``log_path``."""
    return [
        sys.executable,
        "-m",
        FENCE_MODULE,
        "--run-root",
        run_root,
        "--member",
        member,
        "--until",
        repr(until),
        "--log",
        log_path,
    ]
