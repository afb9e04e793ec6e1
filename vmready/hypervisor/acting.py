"""Whether this daemon may act on its host's VMs now: the hook a cluster member's lease fills.

Every step that changes a VM from the host (starting its process, a QMP
command that is not a read, a SIGKILL) first awaits ``before_acting``.  A
daemon alone on its host may always act (``ALWAYS``); a cluster member may
act only while its lease is known to hold (``vmready.lifecycle.leaseguard``), so
a daemon frozen past its lease does not act on instances another daemon may
hold by then.
"""

from __future__ import annotations

from typing import Protocol

# QMP commands that do not change the VM, allowed whatever the guard says: reads, and the
# agent link's own traffic on its ring buffer.
READS = frozenset({"query-status", "query-migrate", "ringbuf-read", "ringbuf-write"})


class ActingGuard(Protocol):
    """Says whether a step on a VM of this host may run now."""

    async def before_acting(self, vm: str, what: str) -> None:
        """Return once ``what`` (``start``, ``quit``, ``SIGKILL``…) may be done to VM ``vm``;
        raise a VMReadyError saying why when it may not."""


class _Always:
    """A daemon alone on its host: its VMs are its own."""

    async def before_acting(self, vm: str, what: str) -> None:
        return None


ALWAYS: ActingGuard = _Always()
