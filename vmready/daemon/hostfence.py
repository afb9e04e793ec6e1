"""The daemon's end of the host fence (``--fence vms``): the fence's process, kept told.

Once the member holds its lease the fence starts (``start``), holding until
the lease guard's end (``LeaseGuard.until``), and each renewal that confirms
the lease moves that end (``hold``); a lost lease kills at once (``lose``).
The fence is a process of its own (``vmready.fence``): a daemon frozen,
killed or cut off from the store cannot tell it anything, so its last word
stands, and the VMs die when it passes.  A clean stop leaves it holding
(``leave``): a daemon started again on the same data dir before the lease
ends starts a fence that relieves it, and the VMs run on.

A fence that ends while the daemon still needs it (it crashed, or was
killed) is started again a second later, holding until the same end, and
said so in the log: until then the VMs are not fenced.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from twisted.internet.error import ProcessDone
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain import IVMReadyReactor
from vmready.fence import LOST_LINE, fence_command, hold_line

FENCE_LOG_NAME = "fence.log"
RESTART_DELAY_SECONDS = 1.0


class _FenceProcess(ProcessProtocol):
    """One run of the fence: what it writes on its stderr is logged; its end is reported."""

    log = Logger()

    def __init__(self, ended: Callable[[Failure], None]) -> None:
        self._ended = ended

    def errReceived(self, data: bytes) -> None:
        for line in data.decode("utf-8", "replace").splitlines():
            if line.strip():
                self.log.warn("the host fence said: {line}", line=line)

    def processEnded(self, reason: Failure) -> None:
        self._ended(reason)


class HostFence:
    """Member ``member``'s fence over the VMs under ``run_root`` (its log in ``data_dir``).

    ``until`` is when the lease guard stops acting (``LeaseGuard.until``); a
    None means the lease is lost.
    """

    log = Logger()

    def __init__(
        self, reactor: IVMReadyReactor, run_root: str, data_dir: str, member: str
    ) -> None:
        self.reactor = reactor
        self.run_root = run_root
        self.log_path = os.path.join(data_dir, FENCE_LOG_NAME)
        self.member = member
        self._process: _FenceProcess | None = None
        self._until: float | None = None
        self._lost = False
        self._leaving = False
        self._restart: IDelayedCall | None = None

    def start(self, until: float) -> None:
        """Start fencing: the VMs may run until ``until`` (the monotonic clock)."""
        self._until = until
        self._spawn()
        self.log.info(
            "the host fence of member {member} kills its VMs once its lease may have run "
            "out (log: {path})",
            member=self.member,
            path=self.log_path,
        )

    def _spawn(self) -> None:
        assert self._until is not None
        protocol = _FenceProcess(self._ended)
        command = fence_command(self.run_root, self.member, self._until, self.log_path)
        self.reactor.spawnProcess(protocol, command[0], command, env=dict(os.environ))
        self._process = protocol
        if self._lost:
            self._write(LOST_LINE)

    def hold(self, until: float | None) -> None:
        """The lease was confirmed: the VMs may run until ``until``."""
        if until is None or self._lost:
            return
        self._until = until
        self._write(hold_line(until))

    def lose(self) -> None:
        """The lease is another daemon's: the fence kills the VMs now."""
        self._lost = True
        self._write(LOST_LINE)

    def leave(self) -> None:
        """The daemon stops: the fence keeps its last end, for a daemon started again."""
        self._leaving = True
        if self._restart is not None and self._restart.active():
            self._restart.cancel()
        process, self._process = self._process, None
        if process is not None and process.transport is not None:
            process.transport.closeStdin()

    def _write(self, line: bytes) -> None:
        process = self._process
        if process is not None and process.transport is not None:
            process.transport.write(line)

    def _ended(self, reason: Failure) -> None:
        self._process = None
        if self._leaving:
            return
        how = "" if reason.check(ProcessDone) else f": {reason.getErrorMessage()}"
        self.log.critical(
            "the host fence of member {member} ended{how}; its VMs are not fenced until it "
            "starts again in {delay:g}s",
            member=self.member,
            how=how,
            delay=RESTART_DELAY_SECONDS,
        )
        self._restart = self.reactor.callLater(RESTART_DELAY_SECONDS, self._spawn)
