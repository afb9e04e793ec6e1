"""A small blocking client for a fakeqemu host's control socket (for CLIs and tests)."""

from __future__ import annotations

import json
import socket
from typing import Any


class HostRequestError(Exception):
    """The host refused a request."""

    def __init__(self, error_class: str, desc: str) -> None:
        super().__init__(desc)
        self.error_class = error_class
        self.desc = desc


class HostUnreachable(Exception):
    """Nothing answers on the control socket."""


class HostClient:
    """One connection to a host; requests are answered in order."""

    def __init__(self, control_path: str, timeout: float | None = 30.0) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.settimeout(timeout)
        try:
            self._socket.connect(control_path)
        except OSError as e:
            self._socket.close()
            raise HostUnreachable(
                f"no fakeqemu host at {control_path}: {e.strerror or e}"
            ) from None
        self._reader = self._socket.makefile("rb")
        self._next_id = 0

    def settimeout(self, timeout: float | None) -> None:
        """How long later calls may wait for their reply; None waits for ever."""
        self._socket.settimeout(timeout)

    def call(self, command: str, **arguments: Any) -> Any:
        """Send one request and return its result, or raise HostRequestError."""
        self._next_id += 1
        request = {"execute": command, "arguments": arguments, "id": self._next_id}
        self._socket.sendall(json.dumps(request).encode() + b"\n")
        line = self._reader.readline()
        if not line:
            raise HostUnreachable("the fakeqemu host closed the control connection")
        reply = json.loads(line)
        if "error" in reply:
            raise HostRequestError(reply["error"]["class"], reply["error"]["desc"])
        return reply["return"]

    def close(self) -> None:
        """Close the connection."""
        self._reader.close()
        self._socket.close()

    def __enter__(self) -> HostClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
