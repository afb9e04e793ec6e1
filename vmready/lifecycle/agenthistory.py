"""Each instance's recent agent-link changes, as the event stream announced them.

One agent status (``unknown``, ``started``…) says how the link stands now,
not how it got there: an agent that fell silent a minute ago and came back
looks the same as one that never left.  The ``AgentHistory`` reads the
``instance-agent-started``/``-connected``/``-stopped`` events the daemon
publishes and keeps, per instance, the last few with their times and, where
the daemon knows it, why (``lost: the agent said nothing for 15.0s (no
heartbeat)``, ``its VM stopped``, ``the VM was adopted; CONNECT advertised
again``), so ``vmready info`` shows how the link behaved lately.  Bounded per
instance, dropped with the instance, kept in memory only: a restarted daemon
starts each history afresh (its first entry is the agent's status once it is
heard again).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs

__all__ = ["DEFAULT_HISTORY_LENGTH", "AgentHistory", "LinkChange"]

# How many changes each instance keeps: enough to see a flapping link, small enough
# that a link flapping for days costs nothing.
DEFAULT_HISTORY_LENGTH = 10

_INSTANCE_SOURCE = "/1.0/instances/"
_AGENT_ACTION = "instance-agent-"


@attrs.frozen
class LinkChange:
    """The agent's link took ``status`` at ``at`` (Unix time); ``reason``: why, if known."""

    status: str
    at: float
    reason: str | None = None


class AgentHistory:
    """The last ``length`` agent-link changes of every instance, oldest first."""

    def __init__(self, length: int = DEFAULT_HISTORY_LENGTH) -> None:
        if length < 1:
            raise ValueError(f"an agent history keeps at least one change, not {length}")
        self._length = length
        self._instances: dict[str, deque[LinkChange]] = {}

    def of(self, name: str) -> list[LinkChange]:
        """The instance's recent changes, oldest first (empty: none since the daemon started)."""
        return list(self._instances.get(name, ()))

    def observe(self, type: str, timestamp: float, metadata: dict[str, Any]) -> None:
        """Read one event (its type, time and metadata) as the bus publishes it."""
        action = metadata.get("action")
        source = metadata.get("source")
        if type != "lifecycle" or not isinstance(action, str) or not isinstance(source, str):
            return
        if not source.startswith(_INSTANCE_SOURCE):
            return
        name = source[len(_INSTANCE_SOURCE) :]
        if action == "instance-deleted":
            self._instances.pop(name, None)
            return
        if not action.startswith(_AGENT_ACTION):
            return
        context = metadata.get("context") or {}
        status = context.get("status")
        if not isinstance(status, str):
            status = action[len(_AGENT_ACTION) :]
        reason = context.get("reason")
        changes = self._instances.get(name)
        if changes is None:
            changes = self._instances[name] = deque(maxlen=self._length)
        changes.append(LinkChange(status, timestamp, reason if isinstance(reason, str) else None))
