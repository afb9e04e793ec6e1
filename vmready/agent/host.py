"""The host's guest API as the agent reaches it: mutual TLS to the advertised address.

Every request gets a new connection (``HostConnector.agent``), as LXD's agent
does; the one long-lived connection is the link watch, a held
``GET /1.0/events`` whose end tells the agent the host went away.  The
transport is real vsock (``<cid>:<port>``) or hybrid vsock, where the host
listens on the unix socket ``<path>_<port>`` and the cid is ignored.
"""

from __future__ import annotations

import json
from typing import Any, cast

from OpenSSL import SSL
from twisted.internet import error as net_error
from twisted.internet.defer import CancelledError, Deferred, TimeoutError, succeed
from twisted.internet.endpoints import wrapClientTLS
from twisted.internet.interfaces import IConsumer, IPushProducer, IStreamClientEndpoint
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import (
    Agent,
    ResponseDone,
    ResponseFailed,
    ResponseNeverReceived,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IAgentEndpointFactory, IBodyProducer, IResponse
from zope.interface import implementer

from vmready.agent.config import Transport
from vmready.agent.core import HostAddress
from vmready.certs import CertificatePair
from vmready.tls import PinnedServerTLS
from vmready.vsock import HybridVSockClientEndpoint, VSockClientEndpoint

__all__ = [
    "API_VERSION",
    "MAX_ANSWER_BYTES",
    "AnswerTooLarge",
    "BytesProducer",
    "HostConnector",
    "HostRefused",
    "LinkWatch",
    "OneEndpoint",
    "describe_failure",
    "envelope_metadata",
    "host_url",
    "open_link",
    "patch_state",
    "read_body",
    "send_request",
]

API_VERSION = "1.0"
# The host is trusted, but an answer is held in memory: bound it anyway.
MAX_ANSWER_BYTES = 16 * 1024 * 1024
_BASE_URL = b"http://vmready-host"


class HostRefused(Exception):
    """The host answered, but not as a vmready guest API should; the message says how."""


class AnswerTooLarge(Exception):
    """The host's answer passed the size limit."""


def host_url(path: str) -> bytes:
    """The URL to request ``path`` (with its query) from the host."""
    return _BASE_URL + path.encode("utf-8")


@implementer(IAgentEndpointFactory)
class OneEndpoint:
    """Every URL goes to the same endpoint: the host at one address."""

    def __init__(self, endpoint: IStreamClientEndpoint) -> None:
        self._endpoint = endpoint

    def endpointForURI(self, uri: Any) -> IStreamClientEndpoint:
        return self._endpoint


class HostConnector:
    """Connections to the host's guest API at an advertised address, with pinned mutual TLS."""

    def __init__(
        self,
        reactor: Any,
        transport: Transport,
        identity: CertificatePair,
        server_cert_pem: bytes,
        connect_timeout: float = 10.0,
    ) -> None:
        self.reactor = reactor
        self.transport = transport
        self.connect_timeout = connect_timeout
        # One creator for every connection: its OpenSSL context is configured once.
        self._tls = PinnedServerTLS(identity, server_cert_pem)

    def describe(self, address: HostAddress) -> str:
        """How an operator would name the host's address: ``vsock 2:1234``, a socket path."""
        if self.transport.kind == "vsock":
            return f"vsock {address}"
        return f"{self.transport.path}_{address.port}"

    def endpoint(self, address: HostAddress) -> IStreamClientEndpoint:
        """A TLS endpoint to the host at ``address``."""
        inner: IStreamClientEndpoint
        if self.transport.kind == "vsock":
            inner = VSockClientEndpoint(
                self.reactor, address.cid, address.port, timeout=self.connect_timeout
            )
        else:
            inner = HybridVSockClientEndpoint(
                self.reactor, self.transport.path, address.port, timeout=self.connect_timeout
            )
        return wrapClientTLS(self._tls, inner)

    def agent(self, address: HostAddress) -> IAgent:
        """An HTTP client whose every request is a new TLS connection to ``address``."""
        agent: IAgent = Agent.usingEndpointFactory(
            self.reactor, OneEndpoint(self.endpoint(address))
        )
        return agent


class _LimitedBody(Protocol):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.done: Deferred[bytes] = Deferred()
        self._chunks: list[bytes] = []
        self._size = 0

    def dataReceived(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self.limit:
            self._chunks.clear()
            if not self.done.called:
                self.done.errback(AnswerTooLarge(f"answer larger than {self.limit} bytes"))
            cast(IPushProducer, self.transport).stopProducing()
            return
        self._chunks.append(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        if self.done.called:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(b"".join(self._chunks))
        else:
            self.done.errback(reason)


def read_body(response: IResponse, limit: int = MAX_ANSWER_BYTES) -> Deferred[bytes]:
    """The whole body of ``response``; AnswerTooLarge past ``limit`` bytes."""
    reader = _LimitedBody(limit)
    response.deliverBody(reader)
    return reader.done


@implementer(IBodyProducer)
class BytesProducer:
    """A request body already in memory, written in one go (no cooperator, no reactor)."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.length = len(body)

    def startProducing(self, consumer: IConsumer) -> Deferred[None]:
        consumer.write(self.body)
        return succeed(None)

    def pauseProducing(self) -> None:
        """Nothing to pause: the whole body was written at once."""

    def resumeProducing(self) -> None:
        """Nothing to resume: the whole body was written at once."""

    def stopProducing(self) -> None:
        """Nothing to stop: the whole body was written at once."""


def send_request(
    agent: IAgent, method: bytes, path: str, body: bytes | None = None, content_type: bytes = b""
) -> Deferred[IResponse]:
    """Send one request to the host; a body is sent with its length."""
    headers = Headers({b"User-Agent": [b"vmready-agent"]})
    if content_type:
        headers.addRawHeader(b"Content-Type", content_type)
    producer = None
    if body is not None:
        producer = BytesProducer(body)
    return agent.request(method, host_url(path), headers, producer)


class LinkWatch(Protocol):
    """The held event stream: the link is up while it lasts; ``lost`` fires with why it ended."""

    def __init__(self) -> None:
        self.lost: Deferred[str] = Deferred()
        self._closing = False
        self._ended = False
        self._waiters: list[Deferred[None]] = []

    def when_closed(self) -> Deferred[None]:
        """Fires once the stream's connection is gone."""
        waiter: Deferred[None] = Deferred()
        if self._ended:
            waiter.callback(None)
        else:
            self._waiters.append(waiter)
        return waiter

    def dataReceived(self, data: bytes) -> None:
        """Events are not the agent's business; the stream only shows the host is there."""

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        if self._closing:
            text = "closed by the agent"
        elif reason.check(ResponseDone, PotentialDataLoss):
            text = "the host ended the event stream"
        else:
            text = describe_failure(reason)
        self._ended = True
        self.lost.callback(text)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def close(self) -> None:
        """Drop the stream (the agent dials elsewhere or stops)."""
        self._closing = True
        if self.transport is not None:
            cast(IPushProducer, self.transport).stopProducing()


def envelope_metadata(code: int, raw: bytes) -> Any:
    """The metadata of a success envelope; HostRefused for anything else."""
    try:
        envelope = json.loads(raw)
    except ValueError:
        envelope = None
    if not isinstance(envelope, dict):
        raise HostRefused(f"HTTP {code} without a JSON envelope")
    if envelope.get("type") == "error" or code >= 400:
        raise HostRefused(f"HTTP {code}: {envelope.get('error') or 'error'}")
    return envelope.get("metadata")


async def open_link(agent: IAgent) -> LinkWatch:
    """Validate the host (``GET /1.0`` answers api_version 1.0) and hold its event stream."""
    response = await send_request(agent, b"GET", "/1.0")
    metadata = envelope_metadata(response.code, await read_body(response))
    version = metadata.get("api_version") if isinstance(metadata, dict) else None
    if response.code != 200 or version != API_VERSION:
        raise HostRefused(f"GET /1.0 answered api_version {version!r}, not {API_VERSION!r}")
    response = await send_request(agent, b"GET", "/1.0/events")
    if response.code != 200:
        try:
            envelope_metadata(response.code, await read_body(response))
        except HostRefused as e:
            raise HostRefused(f"GET /1.0/events: {e}") from None
        raise HostRefused(f"GET /1.0/events answered HTTP {response.code}")
    watch = LinkWatch()
    response.deliverBody(watch)
    return watch


async def patch_state(agent: IAgent, state: str) -> None:
    """``PATCH /1.0 {"state": state}``; HostRefused if the host does not accept it."""
    body = json.dumps({"state": state}).encode("utf-8")
    response = await send_request(agent, b"PATCH", "/1.0", body, b"application/json")
    envelope_metadata(response.code, await read_body(response))


def _tls_reason(e: SSL.Error) -> str:
    details = [entry[-1] for entry in e.args[0] if entry] if e.args and e.args[0] else []
    return "TLS handshake failed" + (f" ({details[-1]})" if details else "")


def describe_failure(failure: Failure | BaseException) -> str:
    """One line saying why talking to the host failed, for logs and 503 answers."""
    e = failure.value if isinstance(failure, Failure) else failure
    if isinstance(e, ResponseNeverReceived | ResponseFailed) and e.reasons:
        return describe_failure(e.reasons[0])
    if isinstance(e, SSL.Error):
        return _tls_reason(e)
    if isinstance(e, net_error.ConnectingCancelledError | CancelledError):
        return "cancelled"
    if isinstance(e, net_error.TimeoutError | TimeoutError):
        return "timed out"
    if isinstance(e, net_error.ConnectError):
        # Twisted puts the OS's words in args; else the class's docstring says what happened.
        detail = e.args[0] if e.args and e.args[0] else (e.__doc__ or type(e).__name__)
        return f"cannot connect: {detail.strip().rstrip('.')}"
    if isinstance(e, net_error.ConnectionDone | ResponseDone):
        return "the host closed the connection"
    if isinstance(e, net_error.ConnectionLost):
        return "the connection to the host was lost"
    if isinstance(e, HostRefused | AnswerTooLarge):
        return str(e)
    return str(e) or type(e).__name__
