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
import tempfile

__all__ = ["READY_FILE", "ReadyMemory"]

READY_FILE = "ready"


class ReadyMemory:
    """Whether the workload's last successful state PATCH was Ready."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, READY_FILE)

    def is_ready(self) -> bool:
        """The workload declared Ready (and has not declared Started since)."""
        return os.path.exists(self.path)

    def remember(self, ready: bool) -> None:
        """Record the state the host accepted: Ready writes the file, Started removes it."""
        if not ready:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        # Written whole or not at all: a crash mid-write must not leave a half-made file.
        fd, temporary = tempfile.mkstemp(dir=self.state_dir, prefix=".ready-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"Ready\n")
            os.replace(temporary, self.path)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
