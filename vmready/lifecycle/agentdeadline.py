"""When a real guest's agent is due to have connected, and the one fault that says it has not.

A VM of the ``qemu`` driver boots an image whose agent comes from cloud-init
or the vmready loader.  ``AGENT_EXPECTED_WITHIN`` seconds after the daemon
began following it, an agent that has not connected this boot is a fault,
``instance-agent-missing``, whose reason its console gives: why no agent
spoke, or, for an agent that started, its own last line.  The agent says
``STARTED`` before it reads its configuration, so one whose configuration is
refused says ``STARTED`` then ``STOPPED``, again and again under systemd's
``Restart=on-failure``: a STARTED is no sign that it will connect, and only
``CONNECTED`` clears the fault (``faults``).

An agent first heard late in that window (a slow first boot) is given
``AGENT_CONNECT_WITHIN`` seconds from its first line before it is judged, so
a healthy agent on its way to CONNECTED is not flagged.  The fault is said at
most twice a boot, never once per flap: when the window ends with no word
from any agent, and once more, in the agent's own words, when an agent heard
only after that has still not connected ``AGENT_CONNECT_WITHIN`` seconds on.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from vmready.hypervisor import AGENT_CONNECT_WITHIN, AGENT_EXPECTED_WITHIN, agent_absence
from vmready.lifecycle.events import EventBus
from vmready.protocols import AgentStatus


@attrs.define(eq=False)
class AgentDeadline:
    """One followed VM's agent this boot: judged when its time to connect is up."""

    log = Logger()

    name: str
    clock: IReactorTime
    events: EventBus
    console_log: str
    # Whether the VM still runs: the agent of a VM gone, stopped or paused is not judged.
    vm_runs: Callable[[], bool]
    _since: float = attrs.field(init=False, default=0.0)
    # When the agent's first status line this boot was read (None: not yet).
    _heard_at: float | None = attrs.field(init=False, default=None)
    _connected: bool = attrs.field(init=False, default=False)
    # Whether the fault was said for an agent never heard (one heard later is judged again).
    _said_unheard: bool = attrs.field(init=False, default=False)
    _timer: IDelayedCall | None = attrs.field(init=False, default=None)

    def start(self) -> None:
        """The daemon begins following the VM: its agent has ``AGENT_EXPECTED_WITHIN`` s."""
        self._since = self.clock.seconds()
        self._judge_at(self._since + AGENT_EXPECTED_WITHIN)

    def heard(self, status: AgentStatus) -> None:
        """The agent's status changed: CONNECTED ends the watch; a first line starts a grace."""
        if status is AgentStatus.CONNECTED:
            self._connected = True
            self.cancel()
        elif self._heard_at is None and not self._connected and status is not AgentStatus.UNKNOWN:
            self._heard_at = self.clock.seconds()
            if self._said_unheard:
                self._judge_at(self._heard_at + AGENT_CONNECT_WITHIN)

    def cancel(self) -> None:
        """Judge no more (the VM is no longer followed, or its agent connected)."""
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _judge_at(self, when: float) -> None:
        self.cancel()
        self._timer = self.clock.callLater(max(when - self.clock.seconds(), 0.0), self._judge)

    def _judge(self) -> None:
        """The agent's time is up: unless it connected, a fault says why, from the console."""
        self._timer = None
        if self._connected or not self.vm_runs():
            return
        now = self.clock.seconds()
        heard = self._heard_at is not None
        if self._heard_at is not None and now < self._heard_at + AGENT_CONNECT_WITHIN:
            # First heard late in the window: a healthy agent may still be on its way.
            self._judge_at(self._heard_at + AGENT_CONNECT_WITHIN)
            return
        if not heard:
            self._said_unheard = True
        reason = agent_absence(self.console_log, round(now - self._since), heard)
        self.log.warn("{name}: {reason}", name=self.name, reason=reason)
        self.events.lifecycle("instance-agent-missing", self.name, {"reason": reason})
