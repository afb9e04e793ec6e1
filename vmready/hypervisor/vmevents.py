"""What happens to a running VM: QMP events and run states as VMEvents and power states."""

from __future__ import annotations

import enum

import attrs

from vmready.domain import PowerState
from vmready.protocols.qmp import QMPEvent

UNEXPECTED_EXIT = (
    "QEMU process exited unexpectedly (QMP monitor disconnected without a SHUTDOWN event)"
)
# How long a QMP command may go unanswered before vmready gives up on it.


class VMEventKind(enum.StrEnum):
    """What happened to a VM, as vmready tells its listeners."""

    STOP = "stop"
    RESUME = "resume"
    SHUTDOWN = "shutdown"
    RESET = "reset"
    POWERDOWN = "powerdown"
    PANICKED = "panicked"
    GONE = "gone"


@attrs.frozen
class VMEvent:
    """One VM event: its kind, a sentence for people, and the power state it implies (or None)."""

    kind: VMEventKind
    detail: str
    power_state: PowerState | None


_RUN_STATES = {
    "running": PowerState.RUNNING,
    "colo": PowerState.RUNNING,
    "paused": PowerState.PAUSED,
    "prelaunch": PowerState.PAUSED,
    "postmigrate": PowerState.PAUSED,
    "inmigrate": PowerState.PAUSED,
    "finish-migrate": PowerState.PAUSED,
    "restore-vm": PowerState.PAUSED,
    "save-vm": PowerState.PAUSED,
    "suspended": PowerState.PAUSED,
    "debug": PowerState.PAUSED,
    "shutdown": PowerState.SHUTDOWN,
    "guest-panicked": PowerState.CRASHED,
    "internal-error": PowerState.CRASHED,
    "io-error": PowerState.CRASHED,
    "watchdog": PowerState.CRASHED,
}


def power_state_for(run_state: str) -> PowerState:
    """The power state for a ``query-status`` run state (NOSTATE for one vmready does not know)."""
    return _RUN_STATES.get(run_state, PowerState.NOSTATE)


def _initiator(event: QMPEvent) -> str:
    return "guest" if event.data.get("guest") else "host"


def vm_event_for(event: QMPEvent) -> VMEvent | None:
    """The VMEvent a QMP event stands for, or None for events vmready does not follow."""
    reason = str(event.data.get("reason", "unknown"))
    if event.name == "STOP":
        return VMEvent(VMEventKind.STOP, "paused", PowerState.PAUSED)
    if event.name == "RESUME":
        return VMEvent(VMEventKind.RESUME, "running", PowerState.RUNNING)
    if event.name == "SHUTDOWN":
        detail = f"shut down by the {_initiator(event)} ({reason})"
        return VMEvent(VMEventKind.SHUTDOWN, detail, PowerState.SHUTDOWN)
    if event.name == "RESET":
        return VMEvent(VMEventKind.RESET, f"reset by the {_initiator(event)} ({reason})", None)
    if event.name == "POWERDOWN":
        return VMEvent(VMEventKind.POWERDOWN, "ACPI power button pressed", None)
    if event.name == "GUEST_PANICKED":
        action = str(event.data.get("action", "unknown"))
        detail = f"guest kernel panicked (action: {action})"
        return VMEvent(VMEventKind.PANICKED, detail, PowerState.CRASHED)
    return None


def gone_event(
    shutdown: QMPEvent | None, killed: str | None = None, fenced: str | None = None
) -> VMEvent:
    """The ``gone`` event for a VM whose monitor closed and whose process ended.

    ``shutdown`` is the SHUTDOWN event QEMU announced first, if any; ``killed``
    says why vmready itself killed the process, if it did; ``fenced`` why the
    member's host fence did (``vmready.fence``).
    """
    if shutdown is not None:
        reason = str(shutdown.data.get("reason", "unknown"))
        power = PowerState.CRASHED if reason == "guest-panic" else PowerState.SHUTDOWN
        return VMEvent(VMEventKind.GONE, f"shut down ({reason})", power)
    if killed is not None:
        return VMEvent(
            VMEventKind.GONE, f"killed by vmready with SIGKILL ({killed})", PowerState.SHUTDOWN
        )
    if fenced is not None:
        return VMEvent(VMEventKind.GONE, fenced, PowerState.CRASHED)
    return VMEvent(VMEventKind.GONE, UNEXPECTED_EXIT, PowerState.CRASHED)
