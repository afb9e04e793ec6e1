"""A connection's socket reads and writes in the reactor turn they are due, not the next one.

Twisted's TCP and UNIX transports touch their socket only when the reactor's
poll says it is ready: a connection accepted in one turn is read in the next,
and what a protocol writes goes out in the turn after the one that wrote it.
Each turn first does the work of every other connection that was ready with
it and, on a busy host, waits for a CPU between them: with 200 clients on
three cluster members sharing two cores, an instance ``GET`` (under 2 ms of
its own work) waited tens of milliseconds at each of its three turns
(docs/benchmarks.md).  ``LimitedChannel`` therefore reads what a connection
it has just accepted already sent (``read_now``) and writes an answer as soon
as it is finished (``write_now``): the request is read, answered and, without
keep-alive, closed in the turn that accepted it.

Both do exactly what the reactor would do a turn later: the descriptor's own
``doRead``/``doWrite`` (``IReadDescriptor``, ``IWriteDescriptor``), then,
when either says the connection is over (or raises), the same disconnection
the reactor makes, so a protocol sees nothing it would not see otherwise.
Only the reactor's own socket connections (``twisted.internet.tcp``, of which
UNIX connections are a kind) are read at once; a write also reaches the socket
under a TLS connection (its ciphertext goes out at once).  Anything else, such
as a test's ``StringTransport``, is left to its own ways.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from twisted.internet import tcp
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IHalfCloseableDescriptor, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

_log = Logger()

# How many wrappers (TLS, protocol wrappers) may stand between a protocol and its socket.
_MAX_WRAPPERS = 4


def socket_connection(transport: object) -> tcp.Connection | None:
    """The reactor's socket connection ``transport`` is or writes through, if any."""
    for _ in range(_MAX_WRAPPERS + 1):
        if isinstance(transport, tcp.Connection):
            return transport
        transport = getattr(transport, "transport", None)
        if transport is None:
            return None
    return None


def read_now(transport: object) -> None:
    """Read what the peer already sent to ``transport`` now (a plain socket connection only)."""
    if isinstance(transport, tcp.Connection) and _open(transport):
        _settle(transport, _attempt(transport.doRead), reading=True)


def write_now(transport: object) -> None:
    """Write what is waiting in ``transport``'s socket connection now, as much as the socket takes.

    What the socket does not take stays buffered for the reactor.  A
    connection whose close waited for its last bytes is closed at the start of
    the reactor's next turn, not inside this call: a protocol may be writing
    from within the connection's own ``doRead``, after which the reactor may
    still hand it a write event of the same poll.
    """
    connection = socket_connection(transport)
    if connection is None or not _open(connection):
        return
    why = _attempt(connection.doWrite)
    if why:
        later = cast(IReactorTime, connection.reactor)  # every reactor with sockets has a clock
        later.callLater(0, _settle_if_open, connection, why)


def _settle_if_open(connection: tcp.Connection, why: object) -> None:
    if _open(connection):
        _settle(connection, why, reading=False)


def _open(connection: tcp.Connection) -> bool:
    return bool(connection.connected) and not connection.disconnected


def _attempt(step: Callable[[], object]) -> object:
    """``step()``'s verdict; an exception ends the connection, logged, as the reactor does."""
    try:
        return step()
    except Exception as raised:
        _log.failure("a connection's socket I/O failed; closing it")
        return raised


def _settle(connection: tcp.Connection, why: object, *, reading: bool) -> None:
    """Disconnect ``connection`` if ``why`` says it is over, as the reactor would have."""
    if not why:
        return
    reason = why if isinstance(why, BaseException) else ConnectionLost()
    reactor = connection.reactor
    reactor.removeReader(connection)
    if (
        reading
        and type(reason) is ConnectionDone
        and IHalfCloseableDescriptor.providedBy(connection)
    ):
        connection.readConnectionLost(Failure(reason))
    else:
        reactor.removeWriter(connection)
        connection.connectionLost(Failure(reason))
