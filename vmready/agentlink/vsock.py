"""Twisted endpoints for the guest API's transports: kernel AF_VSOCK and hybrid vsock.

Guests reach the daemon over vsock: a guest dials ``(cid 2, port P)`` and the
host answers.  There are two ways a host can be on the other end.

**Kernel vsock** (QEMU with ``vhost-vsock-pci``): the host listens on an
``AF_VSOCK`` socket bound to port P.  Addresses are ``(cid, port)`` pairs of
32-bit integers.  Twisted knows nothing of ``AF_VSOCK`` (family 40):
``adoptStreamPort`` rejects the family, and ``tcp.Port`` / ``tcp.Client``
assume IP addresses, name resolution and IP address objects.  So
``VSockServerEndpoint`` and ``VSockClientEndpoint`` reuse Twisted's socket
transport machinery (``tcp.Port``'s accept loop, ``tcp.Server`` and
``tcp.BaseClient``'s non-blocking connect, all family-agnostic underneath) and
replace only the parts that create, bind and name the socket.  They need a
reactor with ``IReactorFDSet`` (every POSIX reactor).

**Hybrid vsock** (Firecracker, Cloud Hypervisor): the VMM backs the guest's
vsock device with unix sockets.  When the guest dials ``(2, P)`` the VMM
connects to the unix socket ``<path>_<P>``, where ``path`` is the device's
``uds_path``; a host service "listening on vsock port P" therefore listens on
that file.  ``HybridVSockServerEndpoint`` does exactly that, picks a random
free port when asked for port 0, replaces a stale socket file nothing answers
on, and reports the port through ``getHost()`` as a ``HybridVSockAddress`` so
the daemon can tell guests where to dial.  ``HybridVSockClientEndpoint``
connects to ``<path>_<P>`` directly, which is what fakeqemu guests (host
processes) listen on.  A real Firecracker guest is reached differently, through
``<path>`` itself and a ``CONNECT <port>`` handshake, which this module does not
speak.

Both kinds are also available as endpoint strings through the plugins in
``twisted/plugins/vmready_endpoints.py``: ``vsock:port=0:cid=any`` and
``hvsock:path=/run/vm/v.sock:port=0:mode=600`` for servers,
``vsock:cid=2:port=1234`` and ``hvsock:path=/run/vm/v.sock:port=1234`` for
clients.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import random
import socket
import stat
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import attrs
from twisted.internet import base, error, tcp
from twisted.internet.defer import Deferred, fail, maybeDeferred
from twisted.internet.endpoints import UNIXClientEndpoint, _WrappingFactory
from twisted.internet.interfaces import (
    IAddress,
    IListeningPort,
    IProtocol,
    IProtocolFactory,
    IStreamClientEndpoint,
    IStreamClientEndpointStringParserWithReactor,
    IStreamServerEndpoint,
    IStreamServerEndpointStringParser,
)
from twisted.logger import Logger
from twisted.plugin import IPlugin
from twisted.python.failure import Failure
from zope.interface import implementer

__all__ = [
    "AF_VSOCK",
    "VMADDR_CID_ANY",
    "VMADDR_CID_HOST",
    "VMADDR_CID_LOCAL",
    "VMADDR_PORT_ANY",
    "HybridVSockAddress",
    "HybridVSockClientEndpoint",
    "HybridVSockClientParser",
    "HybridVSockListeningPort",
    "HybridVSockServerEndpoint",
    "HybridVSockServerParser",
    "VSockAddress",
    "VSockClientEndpoint",
    "VSockClientParser",
    "VSockServerEndpoint",
    "VSockServerParser",
    "vsock_unavailable_reason",
]

AF_VSOCK: int = getattr(socket, "AF_VSOCK", 40)
VMADDR_CID_ANY: int = getattr(socket, "VMADDR_CID_ANY", 0xFFFFFFFF)
VMADDR_CID_LOCAL: int = getattr(socket, "VMADDR_CID_LOCAL", 1)
VMADDR_CID_HOST = 2
VMADDR_PORT_ANY: int = getattr(socket, "VMADDR_PORT_ANY", 0xFFFFFFFF)

_U32_MAX = 2**32 - 1
# Where a hybrid port 0 lands: above the privileged range, below the sign bit
# (some VMMs keep ports in signed ints).
_RANDOM_PORT_RANGE = (1024, 2**31)
_RANDOM_PORT_ATTEMPTS = 64
_LOOPBACK_PROBE_TIMEOUT = 0.5

_log = Logger()


@implementer(IAddress)
@attrs.frozen
class VSockAddress:
    """An AF_VSOCK address: a context id (the machine) and a port."""

    cid: int
    port: int


@implementer(IAddress)
@attrs.frozen
class HybridVSockAddress:
    """A hybrid vsock port: vsock port ``port`` of the device backed by ``path``."""

    path: str
    port: int

    @property
    def socket_path(self) -> str:
        """The unix socket the VMM connects to when the guest dials this port."""
        return f"{self.path}_{self.port}"


def _u32(what: str) -> Callable[[object, attrs.Attribute[int], int], None]:
    """An attrs validator for a 32-bit unsigned vsock number, named ``what`` in errors."""

    def validate(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
        if not 0 <= value <= _U32_MAX:
            raise ValueError(f"{what} must be from 0 to {_U32_MAX}, got {value}")

    return validate


def _positive(what: str) -> Callable[[object, attrs.Attribute[Any], float], None]:
    """An attrs validator for a number that must be above zero."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
        if not value > 0:
            raise ValueError(f"{what} must be greater than 0, got {value}")

    return validate


def _check_mode(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= 0o7777:
        raise ValueError(f"hvsock mode must be permission bits from 0 to 7777, got {value:o}")


def _check_path(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value:
        raise ValueError("hvsock path must not be empty")


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


# -- kernel AF_VSOCK -------------------------------------------------------------------


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
        self, port: int, cid: int, factory: IProtocolFactory, backlog: int, reactor: Any
    ) -> None:
        base.BasePort.__init__(self, reactor=reactor)
        self.port = port
        self.cid = cid
        # tcp.Port annotates factory as a Factory; any IProtocolFactory works.
        self.factory = factory  # type: ignore[assignment]
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
        self.fileno = skt.fileno  # type: ignore[method-assign]
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

    def __init__(self, cid: int, port: int, connector: _VSockConnector, reactor: Any) -> None:
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

    def __init__(self, cid: int, port: int, factory: Any, timeout: float, reactor: Any) -> None:
        self.cid = cid
        self.port = port
        base.BaseConnector.__init__(self, factory, timeout, reactor)

    def _makeTransport(self) -> _VSockClient:
        return _VSockClient(self.cid, self.port, self, self.reactor)

    def getDestination(self) -> VSockAddress:
        return VSockAddress(self.cid, self.port)


@implementer(IStreamServerEndpoint)
@attrs.frozen
class VSockServerEndpoint:
    """Listens on AF_VSOCK; port 0 lets the kernel choose a port (see ``getHost()``)."""

    _reactor: Any = attrs.field(eq=False, repr=False)
    port: int = attrs.field(default=0, validator=_u32("vsock port"))
    cid: int = attrs.field(default=VMADDR_CID_ANY, validator=_u32("vsock cid"))
    backlog: int = attrs.field(default=50, validator=_positive("vsock backlog"))

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

    _reactor: Any = attrs.field(eq=False, repr=False)
    cid: int = attrs.field(validator=_u32("vsock cid"))
    port: int = attrs.field(validator=_u32("vsock port"))
    timeout: float = attrs.field(default=30.0, validator=_positive("vsock timeout"))

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[IProtocol]:
        """Connect; cancelling the Deferred abandons the attempt."""
        try:
            wrapping = _WrappingFactory(protocolFactory)
            connector = _VSockConnector(self.cid, self.port, wrapping, self.timeout, self._reactor)
            connector.connect()
        except BaseException:
            return fail()
        return wrapping._onConnection


# -- hybrid vsock ----------------------------------------------------------------------


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

    _reactor: Any = attrs.field(eq=False, repr=False)
    path: str = attrs.field(validator=_check_path)
    port: int = attrs.field(default=0, validator=_u32("hvsock port"))
    mode: int = attrs.field(default=0o600, validator=_check_mode)
    backlog: int = attrs.field(default=50, validator=_positive("hvsock backlog"))

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
                socket_path, factory, backlog=self.backlog, mode=self.mode, wantPID=False
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

    _reactor: Any = attrs.field(eq=False, repr=False)
    path: str = attrs.field(validator=_check_path)
    port: int = attrs.field(validator=_u32("hvsock port"))
    timeout: float = attrs.field(default=30.0, validator=_positive("hvsock timeout"))

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[IProtocol]:
        """Connect; fails with a ConnectError carrying the OS error."""
        socket_path = HybridVSockAddress(self.path, self.port).socket_path
        endpoint = UNIXClientEndpoint(self._reactor, socket_path, timeout=self.timeout)
        connecting: Deferred[IProtocol] = endpoint.connect(protocolFactory)
        return connecting


# -- endpoint string parsers (registered in twisted/plugins/vmready_endpoints.py) -----


def _arguments(
    prefix: str, args: Iterable[object], kwargs: Mapping[str, object], names: tuple[str, ...]
) -> dict[str, str]:
    """Positional and keyword description arguments as one dict keyed by ``names``."""
    given: dict[str, str] = {}
    positional = list(args)
    if len(positional) > len(names):
        raise ValueError(
            f"{prefix}: too many positional arguments {positional!r} "
            f"(in order they are {', '.join(names)})"
        )
    for name, value in zip(names, positional, strict=False):
        if value != "":  # "vsock:" has one empty positional argument
            given[name] = str(value)
    for name, value in kwargs.items():
        if name not in names:
            raise ValueError(f"{prefix}: unknown parameter {name!r}; known: {', '.join(names)}")
        if name in given:
            raise ValueError(f"{prefix}: {name} given twice")
        given[name] = str(value)
    return given


def _integer(prefix: str, name: str, text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise ValueError(f"{prefix} {name} must be an integer, got {text!r}") from None


def _u32_argument(prefix: str, name: str, text: str) -> int:
    value = _integer(prefix, name, text)
    if not 0 <= value <= _U32_MAX:
        raise ValueError(f"{prefix} {name} must be from 0 to {_U32_MAX}, got {text!r}")
    return value


def _cid_argument(prefix: str, text: str, words: Mapping[str, int]) -> int:
    word = text.strip().lower()
    if word in words:
        return words[word]
    if not word.isdigit():
        raise ValueError(
            f"{prefix} cid must be an integer or one of {', '.join(words)}, got {text!r}"
        )
    return _u32_argument(prefix, "cid", text)


def _positive_argument(prefix: str, name: str, text: str) -> int:
    value = _integer(prefix, name, text)
    if value <= 0:
        raise ValueError(f"{prefix} {name} must be greater than 0, got {text!r}")
    return value


def _timeout_argument(prefix: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{prefix} timeout must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"{prefix} timeout must be greater than 0, got {text!r}")
    return value


def _mode_argument(text: str) -> int:
    try:
        value = int(text, 8)
    except ValueError:
        raise ValueError(f"hvsock mode must be octal like 600, got {text!r}") from None
    if not 0 <= value <= 0o7777:
        raise ValueError(f"hvsock mode must be octal from 0 to 7777, got {text!r}")
    return value


def _required(prefix: str, given: Mapping[str, str], name: str, example: str) -> str:
    if not given.get(name):
        raise ValueError(f"{prefix}: missing {name}= (for example {example})")
    return given[name]


_SERVER_CIDS = {"any": VMADDR_CID_ANY, "local": VMADDR_CID_LOCAL, "host": VMADDR_CID_HOST}
_CLIENT_CIDS = {"local": VMADDR_CID_LOCAL, "host": VMADDR_CID_HOST}


@implementer(IPlugin, IStreamServerEndpointStringParser)
class VSockServerParser:
    """``vsock:port=0:cid=any:backlog=50`` (or ``vsock:<port>``) → VSockServerEndpoint."""

    prefix = "vsock"

    def parseStreamServer(
        self, reactor: Any, *args: object, **kwargs: object
    ) -> VSockServerEndpoint:
        given = _arguments("vsock", args, kwargs, ("port", "cid", "backlog"))
        return VSockServerEndpoint(
            reactor,
            port=_u32_argument("vsock", "port", given.get("port", "0")),
            cid=_cid_argument("vsock", given.get("cid", "any"), _SERVER_CIDS),
            backlog=_positive_argument("vsock", "backlog", given.get("backlog", "50")),
        )


@implementer(IPlugin, IStreamClientEndpointStringParserWithReactor)
class VSockClientParser:
    """``vsock:cid=2:port=1234:timeout=30`` (or ``vsock:<cid>:<port>``) → VSockClientEndpoint."""

    prefix = "vsock"

    def parseStreamClient(
        self, reactor: Any, *args: object, **kwargs: object
    ) -> VSockClientEndpoint:
        given = _arguments("vsock", args, kwargs, ("cid", "port", "timeout"))
        example = "vsock:cid=2:port=1234"
        return VSockClientEndpoint(
            reactor,
            cid=_cid_argument("vsock", _required("vsock", given, "cid", example), _CLIENT_CIDS),
            port=_u32_argument("vsock", "port", _required("vsock", given, "port", example)),
            timeout=_timeout_argument("vsock", given.get("timeout", "30")),
        )


@implementer(IPlugin, IStreamServerEndpointStringParser)
class HybridVSockServerParser:
    """``hvsock:path=<base>:port=0:mode=600:backlog=50`` (or ``hvsock:<base>``)."""

    prefix = "hvsock"

    def parseStreamServer(
        self, reactor: Any, *args: object, **kwargs: object
    ) -> HybridVSockServerEndpoint:
        given = _arguments("hvsock", args, kwargs, ("path", "port", "mode", "backlog"))
        return HybridVSockServerEndpoint(
            reactor,
            path=_required("hvsock", given, "path", "hvsock:path=/run/vm/v.sock"),
            port=_u32_argument("hvsock", "port", given.get("port", "0")),
            mode=_mode_argument(given.get("mode", "600")),
            backlog=_positive_argument("hvsock", "backlog", given.get("backlog", "50")),
        )


@implementer(IPlugin, IStreamClientEndpointStringParserWithReactor)
class HybridVSockClientParser:
    """``hvsock:path=<base>:port=1234:timeout=30`` (or ``hvsock:<base>:<port>``)."""

    prefix = "hvsock"

    def parseStreamClient(
        self, reactor: Any, *args: object, **kwargs: object
    ) -> HybridVSockClientEndpoint:
        given = _arguments("hvsock", args, kwargs, ("path", "port", "timeout"))
        example = "hvsock:path=/run/vm/v.sock:port=1234"
        return HybridVSockClientEndpoint(
            reactor,
            path=_required("hvsock", given, "path", example),
            port=_u32_argument("hvsock", "port", _required("hvsock", given, "port", example)),
            timeout=_timeout_argument("hvsock", given.get("timeout", "30")),
        )
