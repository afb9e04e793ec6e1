"""When the host fence kills: the rule, without I/O.

Times are the system's monotonic clock (``time.monotonic``), which the daemon
and the fence share on one host.  The daemon says until when its lease
surely holds (``hold``); the fence is *armed* (kills every VM it finds) once
that time passed, or once the lease is lost (``lose``, for good).  A later
``hold`` disarms it: the daemon renewed its lease, and nobody else took the
name meanwhile.  Once the daemon is gone (its pipe closed: ``close``) no
``hold`` comes any more: the fence waits for the last one to pass, kills,
and ends.
"""

from __future__ import annotations

# While armed and the daemon is still there: how often the fence looks for VMs to kill
# (a VM the daemon started just before it learnt, or one a step began before a freeze).
ARMED_POLL_SECONDS = 0.2


class FenceRule:
    """Whether the VMs must die now, and how long the fence may wait before it looks again."""

    def __init__(self, until: float) -> None:
        self.until = until
        self.lost = False
        self.daemon_gone = False

    def hold(self, until: float) -> None:
        """The lease surely holds until ``until``: a later time than known moves the end."""
        if not self.lost and until > self.until:
            self.until = until

    def lose(self) -> None:
        """The lease is another daemon's: kill now and from now on."""
        self.lost = True

    def close(self) -> None:
        """The daemon is gone: nothing will move the end any more."""
        self.daemon_gone = True

    def armed(self, now: float) -> bool:
        """Whether every VM must be killed at ``now``."""
        return self.lost or now >= self.until

    def finished(self, now: float) -> bool:
        """Whether the fence ends after one more kill: armed, with nobody left to disarm it."""
        return self.daemon_gone and self.armed(now)

    def wait(self, now: float) -> float:
        """Seconds the fence may wait for a line before it must look again."""
        if self.armed(now):
            return ARMED_POLL_SECONDS
        return self.until - now
