"""Twisted endpoints for hybrid vsock (Firecracker, Cloud Hypervisor): vsock ports as unix sockets.

The VMM backs the guest's vsock device with unix sockets.  When the guest
dials ``(2, P)`` the VMM connects to the unix socket ``<path>_<P>``, where
``path`` is the device's ``uds_path``; a host service "listening on vsock port
P" therefore listens on that file.  ``HybridVSockServerEndpoint`` does exactly
that, picks a random free port when asked for port 0, replaces a stale socket
file nothing answers on, and reports the port through ``getHost()`` as a
``HybridVSockAddress`` so the daemon can tell guests where to dial.
``HybridVSockClientEndpoint`` connects to ``<path>_<P>`` directly, which is
what fakeqemu guests (host processes) listen on.  A real Firecracker guest is
reached differently, through ``<path>`` itself and a ``CONNECT <port>``
handshake, which this module does not speak.

The ``hvsock:`` endpoint strings are ``agentlink.endpointstrings``.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import random
import socket
import stat

import attrs
from twisted.internet import error
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.interfaces import (
    IListeningPort,
    IProtocol,
    IProtocolFactory,
    IReactorUNIX,
    IStreamClientEndpoint,
    IStreamServerEndpoint,
)
from twisted.logger import Logger
from zope.interface import implementer

from vmready.agentlink.vsockaddress import HybridVSockAddress, positive, u32

# Where a hybrid port 0 lands: above the privileged range, below the sign bit
# (some VMMs keep ports in signed ints).
_RANDOM_PORT_RANGE = (1024, 2**31)
_RANDOM_PORT_ATTEMPTS = 64

_log = Logger()


def _check_mode(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= 0o7777:
        raise ValueError(f"hvsock mode must be permission bits from 0 to 7777, got {value:o}")


def _check_path(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value:
        raise ValueError("hvsock path must not be empty")


class _PathState(enum.Enum):
    """What is at a hybrid socket path before we listen there."""

    ABSENT = "absent"
    LISTENING = "listening"
    STALE = "stale"
    OTHER = "other"


def _probe_socket_path(path: str) -> _PathState:
    """Whether ``path`` is free, a live unix socket, a dead one, or something else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return _PathState.ABSENT
    except OSError:
        return _PathState.OTHER
    if not stat.S_ISSOCK(mode):
        return _PathState.OTHER
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return _PathState.STALE
        except BlockingIOError:
            # A full backlog: someone is listening, just busy.
            return _PathState.LISTENING
        except OSError:
            return _PathState.OTHER
    return _PathState.LISTENING


def _random_hybrid_port() -> int:
    """A candidate for hybrid port 0 (tests replace this to force collisions)."""
    return random.randrange(*_RANDOM_PORT_RANGE)


def _address_in_use(socket_path: str) -> error.CannotListenError:
    reason = OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
    return error.CannotListenError("hvsock", socket_path, reason)


@implementer(IListeningPort)
class HybridVSockListeningPort:
    """A listening hybrid vsock port: a unix listening port that reports its vsock address."""

    def __init__(self, port: IListeningPort, address: HybridVSockAddress) -> None:
        self._port = port
        self._address = address

    def startListening(self) -> None:
        """Listen again after ``stopListening``."""
        self._port.startListening()

    def stopListening(self) -> Deferred[None] | None:
        """Stop listening and remove the socket file."""
        return self._port.stopListening()

    def getHost(self) -> HybridVSockAddress:
        """The hybrid vsock address guests dial (cid 2, ``port``)."""
        return self._address

    def __repr__(self) -> str:
        return f"<{self.__class__.__name__} on {self._address.socket_path}>"


@implementer(IStreamServerEndpoint)
@attrs.frozen
class HybridVSockServerEndpoint:
    """Listens on hybrid vsock port ``port`` of ``path`` (the unix socket ``<path>_<port>``).

    Port 0 picks a random port from 1024 to 2**31 - 1 whose socket file does not
    exist.  For a given port, a stale socket file (nothing accepts on it) is
    replaced; a live one fails with EADDRINUSE.  The socket file gets ``mode``
    before it starts accepting connections.
    """

    _reactor: IReactorUNIX = attrs.field(eq=False, repr=False)
    path: str = attrs.field(validator=_check_path)
    port: int = attrs.field(default=0, validator=u32("hvsock port"))
    mode: int = attrs.field(default=0o600, validator=_check_mode)
    backlog: int = attrs.field(default=50, validator=positive("hvsock backlog"))

    def listen(self, protocolFactory: IProtocolFactory) -> Deferred[IListeningPort]:
        """Listen; fails with CannotListenError naming the socket path and OS error."""
        return maybeDeferred(self._listen, protocolFactory)

    def _listen(self, factory: IProtocolFactory) -> IListeningPort:
        if self.port != 0:
            return self._listen_at(self.port, factory)
        for _ in range(_RANDOM_PORT_ATTEMPTS):
            port = _random_hybrid_port()
            # Whatever is there belongs to someone else: pick again rather than probe it.
            if os.path.lexists(HybridVSockAddress(self.path, port).socket_path):
                continue
            try:
                return self._listen_at(port, factory)
            except error.CannotListenError as e:
                if getattr(e.socketError, "errno", None) != errno.EADDRINUSE:
                    raise
        raise error.CannotListenError(
            "hvsock",
            f"{self.path}_<port>",
            OSError(errno.EADDRINUSE, f"no free port after {_RANDOM_PORT_ATTEMPTS} tries"),
        )

    def _listen_at(self, port: int, factory: IProtocolFactory) -> IListeningPort:
        address = HybridVSockAddress(self.path, port)
        socket_path = address.socket_path
        state = _probe_socket_path(socket_path)
        if state is _PathState.LISTENING:
            raise _address_in_use(socket_path)
        if state is _PathState.STALE:
            _log.info("replacing stale hybrid vsock socket {path}", path=socket_path)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(socket_path)
            except OSError as e:
                raise error.CannotListenError("hvsock", socket_path, e) from e
        try:
            listening = self._reactor.listenUNIX(
                socket_path,
                factory,  # type: ignore[arg-type]  # the stub wants a Factory; any IProtocolFactory listens
                backlog=self.backlog,
                mode=self.mode,
                wantPID=False,
            )
        except error.CannotListenError as e:
            # Twisted's unix port starts the factory before it binds, and does not undo
            # that when the bind fails: stop it, or it keeps running (Site's log timer).
            if getattr(factory, "numPorts", 0) > 0:
                factory.doStop()
            # Twisted's message reads "any:<path>"; say which transport this was.
            raise error.CannotListenError("hvsock", socket_path, e.socketError) from e
        return HybridVSockListeningPort(listening, address)


@implementer(IStreamClientEndpoint)
@attrs.frozen
class HybridVSockClientEndpoint:
    """Connects to hybrid vsock port ``port`` of ``path`` (the unix socket ``<path>_<port>``)."""

    _reactor: IReactorUNIX = attrs.field(eq=False, repr=False)
    path: str = attrs.field(validator=_check_path)
    port: int = attrs.field(validator=u32("hvsock port"))
    timeout: float = attrs.field(default=30.0, validator=positive("hvsock timeout"))

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[IProtocol]:
        """Connect; fails with a ConnectError carrying the OS error."""
        socket_path = HybridVSockAddress(self.path, self.port).socket_path
        endpoint = UNIXClientEndpoint(self._reactor, socket_path, timeout=self.timeout)
        connecting: Deferred[IProtocol] = endpoint.connect(protocolFactory)
        return connecting
