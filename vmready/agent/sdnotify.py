"""Telling systemd that the agent serves: ``READY=1`` over ``$NOTIFY_SOCKET``, stdlib only.

The loader's unit is ``Type=notify``: systemd counts the agent as started, and
only then starts what is ordered after it (cloud-init's local stage, whose LXD
datasource looks at ``/dev/lxd/sock`` once), when the agent sends ``READY=1``.
The agent sends it once its socket accepts and answers, ``STOPPING=1`` when it
stops.  The protocol is one unix datagram of ``KEY=value`` lines to the socket
``$NOTIFY_SOCKET`` names (a path, or ``@name`` in the abstract namespace).
Without ``$NOTIFY_SOCKET`` (the agent run by hand, a fakeqemu guest) nothing
is sent; a manager that cannot be reached is said once in the log, never
raised: the agent serves all the same.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping
from typing import Union

from vmready.agent.logs import logger

NOTIFY_SOCKET = "NOTIFY_SOCKET"

log = logger(__name__)

Address = Union[str, bytes]


def notify_address(value: str | None) -> Address | None:
    """The socket ``$NOTIFY_SOCKET`` names: a path, ``@name`` (abstract), or None for none."""
    if not value:
        return None
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # systemd 254's vsock: form is for a manager outside the VM


def datagram(fields: Mapping[str, str]) -> bytes:
    """One notification: ``KEY=value`` lines, each value on one line."""
    return "\n".join(
        f"{key}={' '.join(value.splitlines())}" for key, value in fields.items()
    ).encode()


class ServiceManager:
    """The service manager that started the agent, told how it is doing (nothing without one)."""

    def __init__(self, address: Address | None = None) -> None:
        self.address = address
        self._warned = False

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str]) -> ServiceManager:
        """The manager ``$NOTIFY_SOCKET`` names, the variable dropped: children must not use it."""
        return cls(notify_address(environ.pop(NOTIFY_SOCKET, None)))

    def ready(self, status: str) -> None:
        """The agent serves its socket: systemd may start what waits for it."""
        self.send({"READY": "1", "STATUS": status})

    def stopping(self, status: str) -> None:
        """The agent began to stop."""
        self.send({"STOPPING": "1", "STATUS": status})

    def send(self, fields: Mapping[str, str]) -> None:
        """One datagram to the manager, if there is one."""
        if self.address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)
                sock.sendto(datagram(fields), self.address)
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning(
                    "cannot notify the service manager at %r: %s", self.address, e.strerror or e
                )


def from_os_environment() -> ServiceManager:
    """``ServiceManager.from_environment`` on this process's environment."""
    return ServiceManager.from_environment(os.environ)
