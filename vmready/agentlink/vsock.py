"""Twisted endpoints for kernel AF_VSOCK (QEMU with ``vhost-vsock-pci``).

Guests reach the daemon over vsock: a guest dials ``(cid 2, port P)`` and the
host, listening on an ``AF_VSOCK`` socket bound to port P, answers.  Addresses
are ``(cid, port)`` pairs of 32-bit integers.  Twisted knows nothing of
``AF_VSOCK`` (family 40): ``adoptStreamPort`` rejects the family, and its TCP
classes assume IP addresses.  So the transport here is built on Twisted's
public ``FileDescriptor`` (a selectable the reactor watches through
``IReactorFDSet``, buffering writes, pausing producers): ``_Connection``
moves the bytes of a connected stream socket, ``_ListeningPort`` accepts,
``_Connecting`` connects without blocking.  Only a ``_Family`` says which
sockets they make and how addresses are named, so the tests run the same
classes over unix and TCP sockets where the kernel has no vsock loopback.

Hybrid vsock (unix sockets standing in for vsock ports) is ``agentlink.hvsock``;
the ``vsock:`` endpoint strings are ``agentlink.endpointstrings``.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet import error
from twisted.internet.abstract import FileDescriptor
from twisted.internet.defer import Deferred, fail, maybeDeferred
from twisted.internet.interfaces import (
    IAddress,
    IDelayedCall,
    IListeningPort,
    IProtocol,
    IProtocolFactory,
    IReactorFDSet,
    IReactorTime,
    IStreamClientEndpoint,
    IStreamServerEndpoint,
)
from twisted.logger import Logger
from twisted.python.compat import lazyByteSlice
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

_LOOPBACK_PROBE_TIMEOUT = 0.5
# Connections accepted at most per readable event of a listening socket.
_ACCEPTS_PER_READ = 100
# accept() errors that leave the listening socket usable: the next event tries again.
_ACCEPT_LATER = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED)

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


@attrs.frozen
class _Family:
    """What differs between socket families here: the (non-blocking) socket made, the
    addresses named."""

    name: str
    new_socket: Callable[[], socket.socket]
    address: Callable[[Any], IAddress]


# _new_vsock_socket looked up at each call: a test may replace it.
_VSOCK = _Family("AF_VSOCK", lambda: _new_vsock_socket(), lambda pair: VSockAddress(*pair))


class _Connection(FileDescriptor):
    """A connected stream socket as a transport for ``protocol``; it reads at once."""

    def __init__(
        self,
        skt: socket.socket,
        protocol: IProtocol,
        reactor: IReactorFDSet,
        family: _Family,
        factory: IProtocolFactory | None = None,
    ) -> None:
        super().__init__(reactor)
        self.socket = skt
        self.protocol = protocol
        self._family = family
        self._host = family.address(skt.getsockname())
        self._peer = family.address(skt.getpeername())
        # A client's factory, stopped when the connection ends (as Twisted's connectors do).
        self._client_factory = factory
        self.connected = 1
        self.startReading()
        protocol.makeConnection(self)

    def fileno(self) -> int:
        return self.socket.fileno()

    def getHost(self) -> IAddress:
        return self._host

    def getPeer(self) -> IAddress:
        return self._peer

    def logPrefix(self) -> str:
        return f"{self._family.name} {type(self.protocol).__name__}"

    def doRead(self) -> Exception | None:
        try:
            data = self.socket.recv(self.bufferSize)
        except BlockingIOError:
            return None
        except OSError:
            return error.ConnectionLost()
        if not data:
            return error.ConnectionDone()
        self.protocol.dataReceived(data)
        return None

    def writeSomeData(self, data: bytes) -> int | BaseException:
        try:
            return self.socket.send(lazyByteSlice(data, 0, self.SEND_LIMIT))
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as e:
            return 0 if e.errno == errno.ENOBUFS else error.ConnectionLost()

    def abortConnection(self) -> None:
        """Close at once, dropping what is not yet written (``connectionLost`` comes next)."""
        if not self.connected:
            return
        self.connected = 0  # nothing more is written
        self.stopReading()
        self.stopWriting()
        IReactorTime(self.reactor).callLater(
            0, self.connectionLost, Failure(error.ConnectionAborted())
        )

    def connectionLost(self, reason: Failure) -> None:
        if self.disconnected:
            return
        super().connectionLost(reason)  # stops watching the socket before it is closed
        self.socket.close()
        self.protocol.connectionLost(reason)
        if self._client_factory is not None:
            self._client_factory.doStop()


@implementer(IListeningPort)
class _ListeningPort(FileDescriptor):
    """A listening socket of ``family`` bound to ``address``; each accepted connection
    gets a protocol of ``factory``."""

    def __init__(
        self,
        family: _Family,
        address: Any,
        factory: IProtocolFactory,
        backlog: int,
        reactor: IReactorFDSet,
    ) -> None:
        super().__init__(reactor)
        self._family = family
        self._address = address
        self.factory = factory
        self._backlog = backlog
        self.socket: socket.socket | None = None

    def fileno(self) -> int:
        return -1 if self.socket is None else self.socket.fileno()

    def startListening(self) -> None:
        """Bind and listen; CannotListenError naming the family, the address and the OS error."""
        try:
            skt = self._family.new_socket()
        except OSError as e:
            raise self._cannot_listen(e) from e
        try:
            skt.bind(self._address)
            skt.listen(self._backlog)
        except OSError as e:
            skt.close()
            raise self._cannot_listen(e) from e
        self.socket = skt
        self.factory.doStart()
        self.connected = 1
        self.startReading()
        _log.info(
            "{factory} listening on {address}",
            factory=type(self.factory).__name__,
            address=self.getHost(),
        )

    def _cannot_listen(self, e: OSError) -> error.CannotListenError:
        if self._family is _VSOCK:
            cid, port = self._address
            return error.CannotListenError(f"vsock:{_cid_text(cid)}", port, e)
        return error.CannotListenError(self._family.name, str(self._address), e)

    def getHost(self) -> IAddress:
        assert self.socket is not None
        return self._family.address(self.socket.getsockname())

    def doRead(self) -> None:
        assert self.socket is not None
        for _ in range(_ACCEPTS_PER_READ):
            try:
                skt, _peer = self.socket.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in _ACCEPT_LATER:
                    _log.warn("could not accept a connection: {error}", error=e)
                    return
                raise
            try:
                self._serve(skt)
            except Exception:
                skt.close()
                _log.failure("serving a connection accepted on {address}", address=self.getHost())

    def _serve(self, skt: socket.socket) -> None:
        skt.setblocking(False)
        protocol = self.factory.buildProtocol(self._family.address(skt.getpeername()))
        if protocol is None:
            skt.close()
            return
        _Connection(skt, protocol, self.reactor, self._family)

    def stopListening(self) -> None:
        """Stop accepting and close the socket; connections already accepted go on."""
        self.connectionLost(Failure(error.ConnectionDone()))

    def connectionLost(self, reason: Failure) -> None:
        if self.socket is None or self.disconnected:
            return
        host = self.getHost()
        super().connectionLost(reason)
        self.socket.close()
        self.factory.doStop()
        _log.info("{address} closed", address=host)

    def logPrefix(self) -> str:
        return f"{self._family.name} {type(self.factory).__name__}"


class _Connecting(FileDescriptor):
    """One non-blocking connect of a ``family`` socket to ``address``, for ``factory``.

    ``result`` fires with the protocol once connected, or fails with a
    ConnectError (refused, timed out, the OS's error); cancelling it abandons
    the attempt (``ConnectingCancelledError``).
    """

    def __init__(
        self,
        skt: socket.socket,
        family: _Family,
        address: Any,
        factory: IProtocolFactory,
        timeout: float,
        reactor: IReactorFDSet,
    ) -> None:
        super().__init__(reactor)
        self.socket = skt
        self._family = family
        self._address = address
        self._factory = factory
        self.result: Deferred[IProtocol] = Deferred(self._cancel)
        self._timer: IDelayedCall | None = None
        factory.doStart()
        try:
            code = skt.connect_ex(address)
        except OSError as e:
            code = e.errno or errno.EINVAL
        if code in (errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            self._timer = IReactorTime(reactor).callLater(
                timeout, self._fail, error.TimeoutError()
            )
            self.startWriting()  # writable once connected, or once it failed
        else:
            self._finish(code)

    def fileno(self) -> int:
        return self.socket.fileno()

    def logPrefix(self) -> str:
        return f"{self._family.name} connecting"

    def doWrite(self) -> None:
        self._finish(self.socket.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))

    def connectionLost(self, reason: Failure) -> None:
        # A failed vsock connect polls as EPOLLERR without EPOLLIN, which the reactor
        # reports as a lost connection; the real reason is still in SO_ERROR.
        code = self.socket.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            self._finish(code)
        else:
            self._fail(error.ConnectError(string=reason.getErrorMessage()))

    def _finish(self, code: int) -> None:
        if code:
            self._fail(self._connect_error(code))
            return
        self._stop()
        try:
            peer = self._family.address(self.socket.getpeername())
            protocol = self._factory.buildProtocol(peer)
        except Exception:
            self.socket.close()
            self._factory.doStop()
            self.result.errback()
            return
        if protocol is None:
            self.socket.close()
            self._factory.doStop()
            self.result.errback(error.NoProtocol())
            return
        _Connection(self.socket, protocol, self.reactor, self._family, self._factory)
        self.result.callback(protocol)

    def _connect_error(self, code: int) -> error.ConnectError:
        if code == errno.ECONNRESET:
            # vsock answers a connect to a port nobody listens on with a reset.
            return error.ConnectionRefusedError(code, os.strerror(code))
        refusal: error.ConnectError = error.getConnectError((code, os.strerror(code)))
        return refusal

    def _fail(self, reason: Exception) -> None:
        if self.result.called:
            return
        self._stop()
        self.socket.close()
        self._factory.doStop()
        self.result.errback(reason)

    def _stop(self) -> None:
        self.stopWriting()
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _cancel(self, result: Deferred[IProtocol]) -> None:
        address = self._family.address(self._address)
        self._fail(error.ConnectingCancelledError(address))


def _listen(
    family: _Family,
    address: Any,
    factory: IProtocolFactory,
    backlog: int,
    reactor: IReactorFDSet,
) -> Deferred[IListeningPort]:
    """Listen on ``address``: the listening port, or the CannotListenError it failed with."""

    def start() -> IListeningPort:
        port = _ListeningPort(family, address, factory, backlog, reactor)
        port.startListening()
        return port

    return maybeDeferred(start)


def _connect(
    family: _Family,
    address: Any,
    factory: IProtocolFactory,
    timeout: float,
    reactor: IReactorFDSet,
) -> Deferred[IProtocol]:
    """Connect to ``address``: the connected protocol, or the ConnectError it failed with."""
    try:
        skt = family.new_socket()
    except OSError as e:
        return fail(error.ConnectError(osError=e, string=f"cannot create an {family.name} socket"))
    return _Connecting(skt, family, address, factory, timeout, reactor).result


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
        address = (self.cid, self.port or VMADDR_PORT_ANY)
        return _listen(_VSOCK, address, protocolFactory, self.backlog, self._reactor)


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
        address = (self.cid, self.port)
        return _connect(_VSOCK, address, protocolFactory, self.timeout, self._reactor)
