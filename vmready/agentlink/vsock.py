"""Twisted endpoints for kernel AF_VSOCK (QEMU with ``vhost-vsock-pci``).

Guests reach the daemon over vsock: a guest dials ``(cid 2, port P)`` and the
host, listening on an ``AF_VSOCK`` socket bound to port P, answers.  Addresses
are ``(cid, port)`` pairs of 32-bit integers.  Twisted knows nothing of
``AF_VSOCK`` (family 40): ``adoptStreamPort`` rejects the family, and
``tcp.Port`` / ``tcp.Client`` assume IP addresses, name resolution and IP
address objects.  So ``VSockServerEndpoint`` and ``VSockClientEndpoint`` reuse
Twisted's socket transport machinery (``tcp.Port``'s accept loop,
``tcp.Server`` and ``tcp.BaseClient``'s non-blocking connect, all
family-agnostic underneath) and replace only the parts that create, bind and
name the socket.  They need a reactor with ``IReactorFDSet`` (every POSIX
reactor).

Hybrid vsock (unix sockets standing in for vsock ports) is ``agentlink.hvsock``;
the ``vsock:`` endpoint strings are ``agentlink.endpointstrings``.
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Any, cast

import attrs
from twisted.internet import base, error, tcp
from twisted.internet.defer import Deferred, fail, maybeDeferred
from twisted.internet.endpoints import _WrappingFactory
from twisted.internet.interfaces import (
    IListeningPort,
    IProtocol,
    IProtocolFactory,
    IReactorFDSet,
    IStreamClientEndpoint,
    IStreamServerEndpoint,
)
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from vmready.agentlink.vsockaddress import (
    AF_VSOCK,
    VMADDR_CID_ANY,
    VMADDR_CID_LOCAL,
    VMADDR_PORT_ANY,
    VSockAddress,
    positive,
    u32,
)

__all__ = ["VSockClientEndpoint", "VSockServerEndpoint", "vsock_unavailable_reason"]

_LOOPBACK_PROBE_TIMEOUT = 0.5

_log = Logger()


def _new_vsock_socket() -> socket.socket:
    """A non-blocking AF_VSOCK stream socket; OSError where the kernel has no vsock."""
    skt = socket.socket(AF_VSOCK, socket.SOCK_STREAM)
    skt.setblocking(False)
    return skt


def _cid_text(cid: int) -> str:
    return "any" if cid == VMADDR_CID_ANY else str(cid)


def vsock_unavailable_reason() -> str | None:
    """None if AF_VSOCK loopback works here (so vsock can be tested); else why not."""
    try:
        listener = _new_vsock_socket()
    except OSError as e:
        return f"AF_VSOCK unavailable: {e} (needs a kernel with vsock)"
    with listener:
        try:
            listener.bind((VMADDR_CID_ANY, VMADDR_PORT_ANY))
            listener.listen(1)
            port = listener.getsockname()[1]
        except OSError as e:
            return f"AF_VSOCK unavailable: cannot listen: {e}"
        try:
            with socket.socket(AF_VSOCK, socket.SOCK_STREAM) as dialer:
                dialer.settimeout(_LOOPBACK_PROBE_TIMEOUT)
                dialer.connect((VMADDR_CID_LOCAL, port))
        except OSError as e:
            return (
                f"AF_VSOCK loopback unavailable: connecting to cid {VMADDR_CID_LOCAL}: "
                f"{e or type(e).__name__} (needs the vsock_loopback module)"
            )
    return None


class _VSockServerConnection(tcp.Server):
    """One accepted AF_VSOCK connection; tcp.Server with vsock addresses."""

    def getHost(self) -> VSockAddress:
        cid, port = self.socket.getsockname()
        return VSockAddress(cid, port)

    def getPeer(self) -> VSockAddress:
        cid, port = cast("tuple[int, int]", self.client)
        return VSockAddress(cid, port)


@implementer(IListeningPort)
class _VSockListeningPort(tcp.Port):
    """A listening AF_VSOCK socket; tcp.Port's accept loop with vsock binding and addresses."""

    transport = _VSockServerConnection
    _type = "VSOCK"

    def __init__(
        self,
        port: int,
        cid: int,
        factory: IProtocolFactory,
        backlog: int,
        reactor: IReactorFDSet,
    ) -> None:
        base.BasePort.__init__(self, reactor=reactor)
        self.port = port
        self.cid = cid
        # tcp.Port annotates factory as a Factory; any IProtocolFactory works.
        self.factory = factory  # type: ignore[assignment]  # see above
        self.backlog = backlog

    def createInternetSocket(self) -> socket.socket:
        return _new_vsock_socket()

    def startListening(self) -> None:
        """Bind and listen; raises CannotListenError naming vsock and the OS error."""
        skt: socket.socket | None = None
        try:
            skt = self.createInternetSocket()
            skt.bind((self.cid, self.port or VMADDR_PORT_ANY))
            skt.listen(self.backlog)
        except OSError as e:
            if skt is not None:
                skt.close()
            raise error.CannotListenError(f"vsock:{_cid_text(self.cid)}", self.port, e) from e
        self._realPortNumber = skt.getsockname()[1]
        _log.info(
            "{factory} listening on vsock cid {cid} port {port}",
            factory=self._getLogPrefix(self.factory),
            cid=_cid_text(self.cid),
            port=self._realPortNumber,
        )
        assert self.factory is not None
        self.factory.doStart()
        self.connected = True
        self.socket = skt
        self.fileno = skt.fileno  # type: ignore[method-assign]  # as tcp.Port does
        self.numberAccepts = 100
        self.startReading()

    def _buildAddr(self, address: tuple[int, int]) -> VSockAddress:
        return VSockAddress(*address)

    def _logConnectionLostMsg(self) -> None:
        _log.info("vsock port {port} closed", port=self._realPortNumber)

    def getHost(self) -> VSockAddress:
        cid, port = self.socket.getsockname()
        return VSockAddress(cid, port)


class _VSockClient(tcp.Client):
    """An outgoing AF_VSOCK connection; tcp.BaseClient's connect without name resolution."""

    def __init__(
        self, cid: int, port: int, connector: _VSockConnector, reactor: IReactorFDSet
    ) -> None:
        self.connector = connector
        self.addr = self.realAddress = (cid, port)
        try:
            skt = self.createInternetSocket()
        except OSError as e:
            reason = error.ConnectError(osError=e, string="cannot create an AF_VSOCK socket")
            self._finishInit(None, None, reason, reactor)
        else:
            self._finishInit(self.doConnect, skt, None, reactor)

    def createInternetSocket(self) -> socket.socket:
        return _new_vsock_socket()

    def connectionLost(self, reason: Failure) -> None:
        if not self.connected and hasattr(self, "socket"):
            # A failed vsock connect polls as EPOLLERR without EPOLLIN, which the reactor
            # reports as a clean close; the real reason is still in SO_ERROR.
            err = self.socket.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.failIfNotConnected(error.getConnectError((err, os.strerror(err))))
                return
        super().connectionLost(reason)

    def failIfNotConnected(self, err: Exception) -> None:
        # vsock answers a connect to a port nobody listens on with a reset.
        if type(err) is error.ConnectError and err.osError == errno.ECONNRESET:
            err = error.ConnectionRefusedError(err.osError, *err.args)
        super().failIfNotConnected(err)

    def getHost(self) -> VSockAddress:
        cid, port = self.socket.getsockname()
        return VSockAddress(cid, port)

    def getPeer(self) -> VSockAddress:
        cid, port = self.realAddress
        return VSockAddress(cid, port)

    def __repr__(self) -> str:
        cid, port = self.realAddress
        return f"<{self.__class__.__name__} to vsock {cid}:{port} at {id(self):x}>"


class _VSockConnector(base.BaseConnector):
    """Drives one AF_VSOCK connection attempt for a client factory (IConnector)."""

    def __init__(
        self, cid: int, port: int, factory: Any, timeout: float, reactor: IReactorFDSet
    ) -> None:
        self.cid = cid
        self.port = port
        # BaseConnector is typed for ReactorBase; it uses only what IReactorFDSet reactors have.
        base.BaseConnector.__init__(self, factory, timeout, cast(base.ReactorBase, reactor))

    def _makeTransport(self) -> _VSockClient:
        return _VSockClient(self.cid, self.port, self, cast(IReactorFDSet, self.reactor))

    def getDestination(self) -> VSockAddress:
        return VSockAddress(self.cid, self.port)


@implementer(IStreamServerEndpoint)
@attrs.frozen
class VSockServerEndpoint:
    """Listens on AF_VSOCK; port 0 lets the kernel choose a port (see ``getHost()``)."""

    _reactor: IReactorFDSet = attrs.field(eq=False, repr=False)
    port: int = attrs.field(default=0, validator=u32("vsock port"))
    cid: int = attrs.field(default=VMADDR_CID_ANY, validator=u32("vsock cid"))
    backlog: int = attrs.field(default=50, validator=positive("vsock backlog"))

    def listen(self, protocolFactory: IProtocolFactory) -> Deferred[IListeningPort]:
        """Listen; fails with CannotListenError if the kernel refuses."""

        def start() -> IListeningPort:
            port = _VSockListeningPort(
                self.port, self.cid, protocolFactory, self.backlog, self._reactor
            )
            port.startListening()
            return port

        return maybeDeferred(start)


@implementer(IStreamClientEndpoint)
@attrs.frozen
class VSockClientEndpoint:
    """Connects to an AF_VSOCK ``(cid, port)``; fails with a ConnectError carrying the OS error."""

    _reactor: IReactorFDSet = attrs.field(eq=False, repr=False)
    cid: int = attrs.field(validator=u32("vsock cid"))
    port: int = attrs.field(validator=u32("vsock port"))
    timeout: float = attrs.field(default=30.0, validator=positive("vsock timeout"))

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[IProtocol]:
        """Connect; cancelling the Deferred abandons the attempt."""
        try:
            wrapping = _WrappingFactory(protocolFactory)
            connector = _VSockConnector(self.cid, self.port, wrapping, self.timeout, self._reactor)
            connector.connect()
        except BaseException:
            return fail()
        return wrapping._onConnection
