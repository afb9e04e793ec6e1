"""The agent's memory that the workload declared Ready, for the rest of this boot.

The host forgets Ready when its daemon restarts (it cannot know the guest's
state), so the agent remembers it and reasserts it on every new link.  The
memory is one file in the state dir, which in a real guest is on a tmpfs
(``/run/vmready-agent``): it survives an agent restart but not a reboot, as a
workload's Ready should not.
"""

from __future__ import annotations

import contextlib
import os

READY_FILE = "ready"
# A state the workload declared while the host was unreachable, to deliver on the next link.
PENDING_FILE = "pending"
_STATES = ("Ready", "Started")


class ReadyMemory:
    """Whether the workload's last successful state PATCH was Ready."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, READY_FILE)

    def is_ready(self) -> bool:
        """The workload declared Ready (and has not declared Started since)."""
        return os.path.exists(self.path)

    def remember(self, ready: bool) -> None:
        """Record the state the host accepted: Ready writes the file, Started removes it.

        A state the host accepted supersedes one held for it (``hold``).
        """
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.state_dir, PENDING_FILE))
        if not ready:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        self._write(self.path, b"Ready\n")

    def hold(self, state: str) -> None:
        """The workload declared ``state`` while the host was unreachable: keep it for later."""
        if state not in _STATES:
            raise ValueError(f"not a state the workload declares: {state!r}")
        self._write(os.path.join(self.state_dir, PENDING_FILE), state.encode("ascii") + b"\n")

    def pending(self) -> str | None:
        """The state held for the host, if any (a damaged file is none)."""
        try:
            with open(os.path.join(self.state_dir, PENDING_FILE), "rb") as f:
                state = f.read(16).decode("ascii", "replace").strip()
        except FileNotFoundError:
            return None
        return state if state in _STATES else None

    def _write(self, path: str, data: bytes) -> None:
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        # Written whole or not at all: a crash mid-write must not leave a half-made file.
        # The temporary name is this process's (not tempfile's: its import, with shutil's
        # and random's, took 60 ms of the agent's start in a TCG guest).
        temporary = os.path.join(self.state_dir, f".ready-{os.getpid()}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temporary, flags, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temporary, path)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
