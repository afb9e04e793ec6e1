"""Open files bound a fleet: whether the next step fits each process's limit, and the limit
raised for N VMs before any child starts (every child inherits it)."""

from __future__ import annotations

import contextlib
import resource
from collections import Counter
from collections.abc import Sequence

from benchmarks._fleet import Fleet
from benchmarks._measure import open_files
from vmready.domain import raise_file_limit

# Open files each VM may cost the process that holds most of them (fakeqemu-host: 9), and
# a margin.
FILES_PER_VM = 12
FILES_MARGIN = 4096


def raise_files_for(vms: int) -> tuple[int, int]:
    """Lift this process's open-file limits for ``vms`` VMs (children inherit them).

    The soft limit goes to the hard one, as ``raise_file_limit`` does; the hard
    one too, up to ``fs.nr_open``, when this process may (root): each VM costs
    the fakeqemu-host, the daemon and the agent workers several descriptors.
    """
    raise_file_limit()
    wanted = FILES_PER_VM * vms + FILES_MARGIN
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard < wanted:
        # Not allowed (no CAP_SYS_RESOURCE): the children live with the hard limit there is.
        with contextlib.suppress(OSError, ValueError):
            with open("/proc/sys/fs/nr_open") as f:
                ceiling = int(f.read())
            target = min(wanted, ceiling)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, target))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class FileBudget:
    """Whether the next step fits each process's open-file limit, at the cost seen so far.

    fakeqemu-host holds about 9 descriptors per VM, the daemon about 3, an agent
    worker about 3 per agent: past the limit a process fails in ways that tell
    nothing about the agent link, so the fleet stops growing first.
    """

    # Stop short of the limit by this share: sockets come and go (event streams, PATCHes).
    HEADROOM = 0.05

    def __init__(self, fleet: Fleet) -> None:
        self.limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.base = {pid: open_files(pid) for pid in self._pids(fleet)}

    def _pids(self, fleet: Fleet) -> list[int]:
        return [fleet.host.pid, fleet.daemon.pid, *(worker.pid for worker in fleet.workers)]

    def short_of(
        self,
        fleet: Fleet,
        vms: int,
        with_agent: Sequence[str],
        batch: Sequence[str],
        without: set[str],
    ) -> str | None:
        """Why ``batch`` would not fit (the first process short of descriptors), or None.

        ``vms`` run so far, ``with_agent`` of them with an agent; ``without`` never get one.
        """
        held = Counter(fleet.worker_of[name].pid for name in with_agent)
        coming = Counter(
            fleet.workers[index % len(fleet.workers)].pid
            for index, name in enumerate(n for n in batch if n not in without)
        )
        units = {fleet.host.pid: (vms, len(batch)), fleet.daemon.pid: (vms, len(batch))}
        for worker in fleet.workers:
            units[worker.pid] = (held[worker.pid], coming[worker.pid])
        labels = {fleet.host.pid: "fakeqemu-host", fleet.daemon.pid: "the daemon"}
        for pid, (now, more) in units.items():
            if now == 0:
                continue
            current = open_files(pid)
            each = (current - self.base[pid]) / now
            expected = current + each * more
            if expected > (1 - self.HEADROOM) * self.limit:
                label = labels.get(pid, f"agent worker {pid}")
                return (
                    f"{label} holds {current} files ({each:.1f} per "
                    f"{'VM' if pid in labels else 'agent'}); {len(batch)} more VMs would take it "
                    f"to about {expected:.0f} of its limit of {self.limit}"
                )
        return None
