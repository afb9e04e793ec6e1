"""Each instance's recent agent-link changes: when, to what, and why if the daemon knows.

One agent status (``unknown``, ``started``…) says how the link stands now,
not how it got there: an agent that fell silent a minute ago and came back
looks the same as one that never left.  The daemon announces each change on
the event stream (``instance-agent-started``/``-connected``/``-stopped``) and
records it here at the same time, with the event's timestamp and, where it
knows, why the agent did not say so itself (``lost: the agent said nothing
for 15.0s (no heartbeat)``, ``its VM stopped``, ``the VM was adopted; CONNECT
advertised again``), so ``vmready info`` shows how the link behaved lately.
The reasons stay out of the events, whose contexts recorded sessions replay
key for key.  Bounded per instance, forgotten with the instance, kept in
memory only: a restarted daemon starts each history afresh.
"""

from __future__ import annotations

from collections import deque

import attrs

# How many changes each instance keeps: enough to see a flapping link, small enough
# that a link flapping for days costs nothing.
DEFAULT_HISTORY_LENGTH = 10


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

    def record(self, name: str, change: LinkChange) -> None:
        """The instance's agent link changed (the oldest change goes once the history is full)."""
        changes = self._instances.get(name)
        if changes is None:
            changes = self._instances[name] = deque(maxlen=self._length)
        changes.append(change)

    def forget(self, name: str) -> None:
        """The instance is deleted: a new one of the same name starts afresh."""
        self._instances.pop(name, None)
