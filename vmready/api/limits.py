"""What one HTTP connection may cost vmready: body size, time, and how many connections.

twisted.web reads a whole body before the resource sees the request, and its
only timer is an idle timeout every byte resets.  ``LimitedChannel`` refuses
an over-long body as soon as its headers say so (413), a request not whole
within ``REQUEST_DEADLINE`` of its first byte (408) and closes an idle
keep-alive connection after ``IDLE_TIMEOUT``; ``LimitedSite`` bounds the
connections open at once, in total (503) and per peer (429).  Each refusal is
an answer in the server's own envelope, then the connection closes.  The
limits are in docs/api.md and docs/reliability.md.

A site may also leave its successful reads out of the access log
(``log_reads``): the operator API does (LXD does not log them either);
under 200 clients a line per read was 6 % of a cluster member's time.

A ``LimitedChannel`` reads a new connection as it accepts it and writes each
answer as it is finished, in that turn of the reactor (``api.promptio``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IDelayedCall, IHandshakeListener, IReactorTime
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import Site
from zope.interface import implementer

from vmready.api.promptio import read_now, write_now
from vmready.api.requestbody import MAX_BODY_BYTES

# Methods that change nothing: their successful requests are reads.
_READS = frozenset({b"GET", b"HEAD"})
# Seconds from a request's first byte until all of it (line, headers, body) must be in.
REQUEST_DEADLINE = 30.0
# Seconds a keep-alive connection may stay silent between requests.
IDLE_TIMEOUT = 60.0
# Guest API connections one guest may hold open at once.
MAX_GUEST_CONNECTIONS = 16
# Operator API connections open at once, all clients together.
MAX_OPERATOR_CONNECTIONS = 256
# Connections the kernel holds for the operator API until they are accepted: as many as it
# serves, so a burst waits its turn (or gets the 503 past the bound) instead of being hung up
# on by the kernel while the daemon is busy (a unix socket's default queue of 50 was).
OPERATOR_LISTEN_BACKLOG = MAX_OPERATOR_CONNECTIONS

# An error response body for (status, message): the server's own envelope.
Envelope = Callable[[int, str], Any]
# Who is at the other end of a transport, for the per-peer bound (None: not counted).
PeerKey = Callable[[Any], str | None]


def body_overflowed(request: IRequest) -> bool:
    """Whether the request's body passed the cap and was dropped (``api.web.LocalRequest``)."""
    return bool(getattr(request, "body_overflowed", False))


def _error_bytes(envelope: Envelope, code: int, message: str) -> bytes:
    """A whole ``Connection: close`` response carrying ``envelope(code, message)``."""
    body = json.dumps(envelope(code, message)).encode("utf-8") + b"\n"
    reason = http.RESPONSES.get(code, b"Error")
    head = (
        b"HTTP/1.1 %d %s\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: %d\r\n"
        b"Connection: close\r\n"
        b"\r\n"
    ) % (code, reason, len(body))
    return head + body


@implementer(IHandshakeListener)
class LimitedChannel(http.HTTPChannel):
    """An HTTP/1.1 channel that keeps its ``LimitedSite``'s limits (see the module).

    HTTPChannel's overridable steps (``allHeadersReceived``, ``rawDataReceived``,
    ``allContentReceived``, ``requestDone``) are the one place a request's
    progress shows: a ``Site`` sees a request only once all of it is in.
    """

    site: LimitedSite
    # Whether a refusal was answered: everything the peer sends after it is ignored.
    refused = False
    # Whether a whole request is in and not yet answered (later bytes are the next request's).
    answering = False
    _deadline: IDelayedCall | None = None
    _abort: IDelayedCall | None = None
    _peer: str | None = None
    _peer_checked = False
    _counted = False

    def connectionMade(self) -> None:
        super().connectionMade()
        if not self.site.admit():
            self.refuse(503, f"Too many connections (limit {self.site.max_connections})")
            return
        self._counted = True
        read_now(self.transport)  # what the client sent already, in this turn (api.promptio)

    def dataReceived(self, data: bytes) -> None:
        if self.refused:
            return
        if not self._peer_checked:
            self._peer_checked = True
            if not self._admit_peer():
                return
        if self._deadline is None and not self.answering and data:
            self._deadline = self.callLater(self.site.request_deadline, self._too_slow)
        super().dataReceived(data)

    def handshakeCompleted(self) -> None:
        """Under TLS: the peer is known now, so it is counted now, before it sends anything
        (a guest opening connections and saying nothing is held to its bound too)."""
        if not self.refused and not self._peer_checked:
            self._peer_checked = True
            self._admit_peer()

    def _admit_peer(self) -> bool:
        """Count this connection against its peer's bound: at its TLS handshake's end, or at
        its first byte where there is no TLS layer to say so."""
        peer = self.site.peer_key(self.transport) if self.site.peer_key else None
        if peer is None:
            return True
        if not self.site.admit_peer(peer):
            self.refuse(
                429, f"Too many connections from this instance (limit {self.site.max_per_peer})"
            )
            return False
        self._peer = peer
        return True

    def allHeadersReceived(self) -> None:
        # Before twisted.web would answer "Expect: 100-continue" and read the body.
        if self.length is not None and self.length > self.site.max_body_bytes:
            self._body_too_large()
            return
        super().allHeadersReceived()

    def rawDataReceived(self, data: bytes) -> None:
        if self.refused:
            return
        super().rawDataReceived(data)
        # Not answering, in raw mode: a body is coming in.
        if not self.answering and self.requests and body_overflowed(self.requests[-1]):
            self._body_too_large()  # a chunked body that passed the cap

    def allContentReceived(self) -> None:
        if self.refused:
            return
        self._cancel_deadline()
        if self.requests and body_overflowed(self.requests[-1]):
            self._body_too_large()  # it passed the cap in its last chunks
            return
        self.answering = True
        super().allContentReceived()

    def requestDone(self, request: http.Request) -> None:
        if self.persistent:
            self.answering = False  # before HTTPChannel reads what the peer sent meanwhile
        super().requestDone(request)
        write_now(self.transport)  # the answer out in this turn, not the next (api.promptio)

    def timeoutConnection(self) -> None:
        """Idle too long: in the middle of a request that is a 408, else just a close."""
        if self._deadline is not None:
            self._too_slow()
            return
        super().timeoutConnection()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel_deadline()
        if self._abort is not None and self._abort.active():
            self._abort.cancel()
        if self._counted:
            self._counted = False
            self.site.release()
        if self._peer is not None:
            self.site.release_peer(self._peer)
            self._peer = None
        super().connectionLost(reason)

    def _body_too_large(self) -> None:
        self.refuse(413, f"Request body too large (limit {self.site.max_body_bytes} bytes)")

    def _too_slow(self) -> None:
        self._deadline = None
        self.refuse(408, f"Request not received within {self.site.request_deadline:g} seconds")

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            if self._deadline.active():
                self._deadline.cancel()
            self._deadline = None

    def refuse(self, code: int, message: str) -> None:
        """Answer ``code`` with the site's error envelope and close, reading nothing more."""
        if self.refused:
            return
        self.refused = True
        self._cancel_deadline()
        self.setTimeout(None)
        assert self.transport is not None
        self.transport.write(_error_bytes(self.site.envelope, code, message))
        if self.abortTimeout is not None:
            # As HTTPChannel.timeoutConnection: a peer that does not read this is cut off.
            self._abort = self.callLater(self.abortTimeout, self.forceAbortClient)
        self.loseConnection()
        write_now(self.transport)


class LimitedSite(Site):
    """A Site whose channels keep vmready's limits (``LimitedChannel``).

    ``envelope`` words a refusal (the server's error envelope).  ``label``
    names the server in log lines.  ``max_connections`` bounds the connections
    open at once (None: no bound); ``peer_key`` says who a connection comes
    from once it sends its first byte, and ``max_per_peer`` bounds each one's.
    ``log_reads``: a successful ``GET`` or ``HEAD`` gets its access-log line
    too (otherwise only changes and refused or failed requests do).
    """

    protocol = LimitedChannel  # type: ignore[assignment]  # typed as Twisted's private wrapper
    _limits_log = Logger()

    def __init__(
        self,
        resource: IResource,
        envelope: Envelope,
        *,
        label: str,
        requestFactory: Any = None,
        max_connections: int | None = None,
        peer_key: PeerKey | None = None,
        max_per_peer: int | None = None,
        request_deadline: float = REQUEST_DEADLINE,
        idle_timeout: float = IDLE_TIMEOUT,
        max_body_bytes: int = MAX_BODY_BYTES,
        log_reads: bool = True,
        reactor: IReactorTime | None = None,
    ) -> None:
        super().__init__(resource, requestFactory, timeout=idle_timeout, reactor=reactor)
        self.log_reads = log_reads
        self.envelope = envelope
        self.label = label
        self.max_connections = max_connections
        self.peer_key = peer_key
        self.max_per_peer = max_per_peer
        self.request_deadline = request_deadline
        self.max_body_bytes = max_body_bytes
        self.connections = 0
        self.per_peer: Counter[str] = Counter()

    def log(self, request: http.Request) -> None:
        """The access-log line of ``request``, unless it is a successful read not to log."""
        if not self.log_reads and request.method in _READS and request.code < 400:
            return
        super().log(request)

    def admit(self) -> bool:
        """Whether a new connection may be served (then it holds a slot until it closes)."""
        if self.max_connections is not None and self.connections >= self.max_connections:
            self._limits_log.warn(
                "{label}: {limit} connections already open; refusing a new one",
                label=self.label,
                limit=self.max_connections,
            )
            return False
        self.connections += 1
        return True

    def release(self) -> None:
        """An admitted connection closed: its slot is free."""
        self.connections -= 1

    def admit_peer(self, peer: str) -> bool:
        """Whether ``peer`` may have one more connection (then it holds it until it closes)."""
        if self.max_per_peer is not None and self.per_peer[peer] >= self.max_per_peer:
            self._limits_log.warn(
                "{label}: {peer} already has {limit} connections open; refusing another",
                label=self.label,
                peer=peer,
                limit=self.max_per_peer,
            )
            return False
        self.per_peer[peer] += 1
        return True

    def release_peer(self, peer: str) -> None:
        """One of ``peer``'s connections closed."""
        self.per_peer[peer] -= 1
        if self.per_peer[peer] <= 0:
            del self.per_peer[peer]
