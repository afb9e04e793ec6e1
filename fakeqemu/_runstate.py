"""A machine's run state as QMP names it, and the error a command refused in it raises."""

from __future__ import annotations

import enum


class RunState(enum.Enum):
    """QEMU's run states, as ``query-status`` names them."""

    PRELAUNCH = "prelaunch"
    RUNNING = "running"
    PAUSED = "paused"
    SHUTDOWN = "shutdown"
    INMIGRATE = "inmigrate"
    POSTMIGRATE = "postmigrate"
    GUEST_PANICKED = "guest-panicked"


class MachineError(Exception):
    """A command failed; the QMP layer reports it as ``GenericError`` with this text."""
