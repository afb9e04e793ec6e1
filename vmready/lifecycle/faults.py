"""What is wrong right now, per instance and daemon-wide, as the event stream said it.

Every fault vmready detects is announced on the event stream first (an
``instance-error``, an ``agent-link-lost``, a ``store-write-failed``…); the
``FaultLog`` reads those same events and keeps, for each instance, the faults
still standing and since when, so ``vmready info`` shows exactly what a
watcher of ``/1.0/events`` saw, and a fault disappears with the event that
says its cause went away.  Nothing here is stored: a restarted daemon puts
back each instance's persisted error (its ``error`` field) with the time its
action history gives it (``error_time``), so ``Last error: … (at …)`` stays
true across restarts; the other faults are found again as they recur.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from vmready.domain import ActionRecord

# The source of events about the daemon itself rather than one instance.
SERVER_SOURCE = "/1.0"
_INSTANCE_SOURCE = "/1.0/instances/"

# Which event raises which fault (kind, the context key holding its message) ...
_RAISED_BY = {
    "instance-error": ("error", "error"),
    "instance-monitor-lost": ("monitor", "reason"),
    "agent-link-lost": ("agent", "reason"),
    "instance-agent-missing": ("agent-missing", "reason"),
    "instance-certificate-error": ("certificate", "error"),
    "instance-snapshot-failed": ("snapshot", "error"),
    "store-write-failed": ("store", "error"),
}
# ... and which events say its cause went away.  An agent's STARTED does not end a missing
# one: it says so before reading its configuration, and one refused says STOPPED next.
_CLEARED_BY = {
    "instance-monitor-restored": ("monitor",),
    "instance-agent-started": ("agent",),
    "instance-agent-connected": ("agent", "agent-missing"),
    "instance-certificate-restored": ("certificate",),
    "instance-snapshot-created": ("snapshot",),
    "store-write-recovered": ("store",),
}
# An instance no longer running has no monitor or agent to lose.
_NOT_RUNNING = frozenset({"stopped", "deleted"})
_VM_ENDED = frozenset({"shutdown", "crashed"})


@attrs.frozen
class Fault:
    """One standing fault: what kind, what the event said, since when (Unix time)."""

    kind: str
    message: str
    since: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "since": self.since}


class FaultLog:
    """The faults still standing, per instance and for the daemon as a whole."""

    def __init__(self) -> None:
        self._instances: dict[str, dict[str, Fault]] = {}
        self._server: dict[str, Fault] = {}

    def of(self, name: str, server: Sequence[Fault] | None = None) -> list[Fault]:
        """The instance's standing faults, then the daemon's (the store's affect it too).

        ``server``: the daemon's faults as already read (``server()``), by a
        reader of many instances at once.
        """
        return [*self.own(name), *(self.server() if server is None else server)]

    def own(self, name: str) -> list[Fault]:
        """The instance's own standing faults, oldest first."""
        faults = self._instances.get(name)
        return sorted(faults.values(), key=_order) if faults else []

    def server(self) -> list[Fault]:
        """The daemon's standing faults (its store's), oldest first."""
        return sorted(self._server.values(), key=_order)

    def restore(self, name: str, fault: Fault) -> None:
        """Put back a fault the store kept (at daemon start), unless one of its kind stands."""
        self._instances.setdefault(name, {}).setdefault(fault.kind, fault)

    def observe(self, type: str, timestamp: float, metadata: dict[str, Any]) -> None:
        """Read one event (its type, time and metadata) as the bus publishes it."""
        action = metadata.get("action")
        source = metadata.get("source")
        if type != "lifecycle" or not isinstance(action, str):
            return
        if source == SERVER_SOURCE:
            faults = self._server
        elif isinstance(source, str) and source.startswith(_INSTANCE_SOURCE):
            name = source[len(_INSTANCE_SOURCE) :]
            if action == "instance-deleted":
                self._instances.pop(name, None)
                return
            if action == "instance-renamed":
                # Its standing faults are still its own, under its new name.
                old_name = (metadata.get("context") or {}).get("old_name")
                moved = self._instances.pop(str(old_name), None)
                if moved:
                    self._instances[name] = moved
                return
            faults = self._instances.setdefault(name, {})
        else:
            return
        context = metadata.get("context") or {}
        raised = _RAISED_BY.get(action)
        if raised is not None:
            kind, key = raised
            faults[kind] = Fault(kind, str(context.get(key, "")), timestamp)
        for kind in _CLEARED_BY.get(action, ()):
            faults.pop(kind, None)
        if action == "instance-state":
            vm_state = context.get("vm_state")
            if vm_state != "error":
                faults.pop("error", None)
            if vm_state in _NOT_RUNNING or context.get("power_state") in _VM_ENDED:
                faults.pop("monitor", None)
                faults.pop("agent", None)
                faults.pop("agent-missing", None)


def error_time(error: str, actions: Iterable[ActionRecord]) -> float | None:
    """When the instance's stored ``error`` happened, from its action history (newest first).

    Every way into error writes a failed action first (a failed action, a
    ``vm-exited``, ``guest-panicked``, ``power-sync`` or ``recover`` entry)
    whose error the instance's error begins with (a panic adds where to look);
    the newest such action's end is the error's time.  None: no action tells.
    """
    for action in actions:
        if action.result != "error" or not action.error or not error.startswith(action.error):
            continue
        return action.finished_at if action.finished_at is not None else action.started_at
    return None


def _order(fault: Fault) -> tuple[float, str]:
    return (fault.since, fault.kind)
