"""``/1.0/events`` as a WebSocket, as LXD and Incus serve it (the form their clients speak).

A ``GET /1.0/events`` that asks to upgrade (``Upgrade: websocket``) is
answered by autobahn: ``event_socket`` makes a ``WebSocketResource`` for
the request, which takes the connection over from twisted.web.  Once the
handshake is done the client is subscribed; each event is one text message,
its JSON envelope, as LXD sends them.  What the client sends is ignored
(LXD's clients send nothing but pings, which autobahn answers).

The client's buffer is bounded as the NDJSON form's is (``api.eventstream``):
its feed is the transport's producer, in place of the HTTP channel that
registered itself there; a client that stops reading is disconnected with a
logged reason.  When the connection closes, the HTTP channel it came from is
told too, so the site's connection count (``api.limits``) stays true.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from autobahn.twisted.resource import WebSocketResource
from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from twisted.internet.interfaces import IConsumer, IPushProducer
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource

from vmready.api.eventstream import BoundedFeed, encode_event
from vmready.lifecycle import Event, EventBus

# The close code of a consumer cut off for not reading (RFC 6455: "policy violation").
CLOSE_TOO_SLOW = 1008


class EventSocketProtocol(WebSocketServerProtocol):
    """One WebSocket consumer of the event bus."""

    factory: EventSocketFactory
    feed: BoundedFeed | None = None
    _unsubscribe: Callable[[], None] | None = None

    def onOpen(self) -> None:
        """Handshake done: subscribe, with the feed as the transport's producer."""
        factory = self.factory
        feed = self.feed = BoundedFeed(
            lambda message: self.sendMessage(message, isBinary=False),
            self._cut_off,
            f"a WebSocket client ({factory.consumer})",
            factory.limit,
        )
        # A TCP, unix or TLS transport: a consumer, whose producer twisted.web's channel was.
        transport = cast(IConsumer, self.transport)
        transport.unregisterProducer()
        transport.registerProducer(cast(IPushProducer, feed), True)
        factory.feeds.add(feed)
        self._unsubscribe = factory.bus.subscribe(self._deliver, factory.types)

    def _deliver(self, event: Event) -> None:
        if self.feed is not None:
            self.feed.offer(encode_event(event))

    def _cut_off(self, reason: str) -> None:
        """The feed gave up on a client that stopped reading: close, then drop."""
        self._forget()
        self.dropConnection(abort=True)

    def _forget(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self.feed is not None:
            self.factory.feeds.discard(self.feed)

    def onClose(self, wasClean: bool, code: Any, reason: Any) -> None:
        """The WebSocket closed (either side): no more events."""
        self._forget()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        """Gone: the HTTP channel the connection came from hears it too."""
        self._forget()
        try:
            super().connectionLost(reason)
        finally:
            self.factory.channel_lost(reason)


class EventSocketFactory(WebSocketServerFactory):
    """The WebSocket of one ``/1.0/events`` request: its bus, types and feed limit."""

    protocol = EventSocketProtocol  # type: ignore[assignment]  # autobahn types it as its base protocol

    def __init__(
        self,
        bus: EventBus,
        types: frozenset[str] | None,
        feeds: set[BoundedFeed],
        limit: int,
        consumer: str,
        channel_lost: Callable[[Failure], None],
    ) -> None:
        super().__init__()
        self.bus = bus
        self.types = types
        self.feeds = feeds
        self.limit = limit
        self.consumer = consumer
        self.channel_lost = channel_lost


def _plain_host(request: IRequest) -> None:
    """A Host header whose port is not a number loses it (autobahn would refuse it).

    Over a unix socket there is no port, and pylxd's WebSocket client
    (ws4py) says ``Host: localhost:None``; LXD ignores the Host header.
    """
    host = request.getHeader(b"Host")
    if host is None:
        return
    name, colon, port = host.rpartition(b":")
    if colon and not port.isdigit() and not name.endswith(b"]") and b"]" not in port:
        request.requestHeaders.setRawHeaders(b"Host", [name])


def event_socket(
    request: IRequest,
    bus: EventBus,
    types: frozenset[str] | None,
    feeds: set[BoundedFeed],
    limit: int,
) -> IResource:
    """The resource that upgrades ``request`` to an event WebSocket (``feeds``: the live ones)."""
    # Klein hands us twisted.web's Request, whose channel autobahn takes the transport from.
    channel = cast(http.Request, request).channel
    _plain_host(request)
    peer = request.getClientAddress()
    consumer = str(getattr(peer, "host", None) or getattr(peer, "name", None) or "local")
    factory = EventSocketFactory(bus, types, feeds, limit, consumer, channel.connectionLost)
    return cast(IResource, WebSocketResource(factory))
