"""The guest API's listeners: its endpoint (a new random port each start), the forward socket.

A new port means every running VM's agent knows an old one: recovery tells
each agent the new one (CONNECT) as it re-adopts its VM.
"""

from __future__ import annotations

import contextlib
import glob
import os
import socket

from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IProtocolFactory
from twisted.logger import Logger

from vmready.agentlink import HybridVSockAddress, HybridVSockServerEndpoint, PollIntervals
from vmready.domain import IVMReadyReactor
from vmready.lifecycle import GuestLink


class GuestListeners:
    """Where agents reach the guest API: its endpoint and the forward transport's socket.

    ``endpoint`` is vsock or hybrid vsock; ``forward_socket`` a unix socket
    (QEMU's guestfwd runs one socat per guest connection to it).
    """

    log = Logger()

    def __init__(self, reactor: IVMReadyReactor, endpoint: str, forward_socket: str) -> None:
        self.reactor = reactor
        self.endpoint = endpoint
        self.forward_socket = forward_socket
        self.port: IListeningPort | None = None
        self.forward_port: IListeningPort | None = None

    async def listen(
        self, factory: IProtocolFactory, server_cert_pem: bytes, intervals: PollIntervals
    ) -> GuestLink:
        """Listen on both with ``factory`` (the same TLS and identification); the agents' link."""
        self._remove_stale_guest_sockets()
        port = self.port = await serverFromString(self.reactor, self.endpoint).listen(factory)
        _remove_stale_socket(self.forward_socket)
        escaped = self.forward_socket.replace("\\", "\\\\").replace(":", "\\:")
        self.forward_port = await serverFromString(
            self.reactor, f"unix:{escaped}:mode=600"
        ).listen(factory)
        address = port.getHost()
        transport = (
            f"hvsock:{address.path}" if isinstance(address, HybridVSockAddress) else "vsock"
        )
        self.log.info(
            "guest API on {endpoint}: agents are told CONNECT 2:{port}",
            endpoint=self.endpoint,
            port=address.port,
        )
        return GuestLink(address.port, server_cert_pem, transport, intervals, self.forward_socket)

    async def stop(self) -> None:
        """Stop listening on both."""
        for port in (self.port, self.forward_port):
            if port is not None:
                stopped = port.stopListening()
                if stopped is not None:
                    await stopped

    def _remove_stale_guest_sockets(self) -> None:
        """Sockets of a daemon that was killed (one daemon per data dir holds the lock)."""
        endpoint = serverFromString(self.reactor, self.endpoint)
        if not isinstance(endpoint, HybridVSockServerEndpoint):
            return
        for path in glob.glob(glob.escape(endpoint.path) + "_*"):
            if not path.removeprefix(endpoint.path + "_").isdigit() or _answers(path):
                continue  # not a guest API socket, or a live one (another daemon's)
            try:
                os.unlink(path)
            except OSError as e:
                self.log.warn("cannot remove stale {path}: {error}", path=path, error=e)


def _remove_stale_socket(path: str) -> None:
    """A socket a killed daemon left behind (nobody answers on it) is removed."""
    if os.path.exists(path) and not _answers(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _answers(path: str) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True
