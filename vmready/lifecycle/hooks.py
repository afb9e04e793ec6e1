"""What the lifecycle tells a session recorder, as interfaces (``vmready.record`` implements them).

The lifecycle sits below record and replay: it knows only these protocols,
and the daemon (or a replay) hands it something that provides them.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["RECORD_KEY", "RecorderLookup", "SessionHooks"]

# The per-instance config key that switches recording on or off ("true"/"false").
RECORD_KEY = "vmready.record"


class SessionHooks(Protocol):
    """What the core tells about a recorded instance as it happens (``InstanceRecorder``)."""

    def ring_read(self, chunk: bytes) -> None:
        """A drained ``ringbuf-read``."""

    def ring_write(self, data: bytes) -> None:
        """A ``ringbuf-write`` QEMU accepted."""

    def qmp_event(self, name: str, data: dict[str, Any]) -> None:
        """An asynchronous QMP event."""

    def operator_action(self, action: str, params: dict[str, Any]) -> None:
        """An operator's action (start, stop, restart …) claimed the instance's task."""


class RecorderLookup(Protocol):
    """Hands out the hooks of recorded instances (``Recorders``; the replay has its own)."""

    def recorder_for(self, name: str) -> SessionHooks | None:
        """The instance's hooks, or None when nothing about it is recorded."""
