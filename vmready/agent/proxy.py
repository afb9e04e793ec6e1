"""The guest's devlxd socket: every request forwarded to the host, answered as LXD answers.

A guest program talks plain HTTP to the agent's unix socket (``/dev/lxd/sock``);
the agent sends each request over a new mutual-TLS connection to the host and
unwraps the host's LXD envelope into devlxd's unix-socket format:

- success: the metadata as JSON (``application/json``, with a trailing newline
  as LXD's encoder writes it), except string metadata (a config value, the
  meta-data), which is sent raw (``application/octet-stream``, as LXD does);
- error: ``<error>\\n`` as plain text, with the host's HTTP status;
- ``/1.0/events``: the host's stream relayed as it arrives, until either side ends.

While the link to the host is down, or when the host fails mid-request, the
answer is 503 ``host not reachable: <reason>``.  Request bodies are capped at
1 MiB (413), held in memory, never spilled to disk.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from io import BytesIO
from typing import Any, cast
from urllib.parse import urlsplit

import attrs
from OpenSSL import SSL
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.error import ConnectError, ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone, ResponseFailed, ResponseNeverReceived
from twisted.web.iweb import IAgent, IResponse
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from vmready.agent.host import (
    AnswerTooLarge,
    HostRefused,
    describe_failure,
    read_body,
    send_request,
)
from vmready.web import LocalRequest

__all__ = [
    "MAX_REQUEST_BODY",
    "Answer",
    "CappedRequest",
    "GuestAPIProxy",
    "HostRoute",
    "HostUnreachable",
    "devlxd_answer",
    "proxy_site",
]

MAX_REQUEST_BODY = 1024 * 1024
EVENTS_PATH = "/1.0/events"
STATE_PATH = "/1.0"
JSON = b"application/json"
RAW = b"application/octet-stream"
TEXT = b"text/plain; charset=utf-8"


# Failures that mean the host went away mid-request (anything else is the agent's bug).
_LINK_FAILURES = (
    ConnectError,
    ConnectionDone,
    ConnectionLost,
    ResponseFailed,
    ResponseNeverReceived,
    SSL.Error,
    HostRefused,
)


class HostUnreachable(Exception):
    """No link to the host now; the message says why, for the 503 answer."""


@attrs.frozen
class HostRoute:
    """How to reach the host right now: an HTTP client for it, and its name for messages."""

    agent: IAgent
    label: str


@attrs.frozen
class Answer:
    """What the guest program receives."""

    code: int
    content_type: bytes
    body: bytes


def plain(code: int, message: str) -> Answer:
    """An error as LXD's devlxd writes it: plain text, one line."""
    return Answer(code, TEXT, message.encode("utf-8") + b"\n")


def devlxd_answer(code: int, raw: bytes) -> Answer:
    """The host's enveloped answer, unwrapped into devlxd's unix-socket format."""
    try:
        envelope = json.loads(raw)
    except ValueError:
        envelope = None
    if not isinstance(envelope, dict) or envelope.get("type") not in ("sync", "error"):
        return plain(502, f"host sent an invalid answer (HTTP {code}, not an LXD envelope)")
    if envelope["type"] == "error" or code >= 400:
        error = envelope.get("error") or f"HTTP {code}"
        return plain(code if code >= 400 else 500, str(error))
    metadata = envelope.get("metadata")
    if isinstance(metadata, str):
        return Answer(code, RAW, metadata.encode("utf-8"))
    return Answer(code, JSON, json.dumps(metadata).encode("utf-8") + b"\n")


def _target(uri: bytes) -> tuple[str, str]:
    """The path, and the path with its query, of a request target (origin or absolute form)."""
    text = uri.decode("utf-8", "surrogateescape")
    if not text.startswith("/"):
        parts = urlsplit(text)
        text = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    path = text.partition("?")[0]
    return path, text


def _declared_state(body: bytes) -> str | None:
    """The state a ``PATCH /1.0`` body asks for, if it is a well-formed one."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    state = parsed.get("state") if isinstance(parsed, dict) else None
    return state if state in ("Ready", "Started") else None


class CappedRequest(LocalRequest):
    """A request that keeps at most ``max_body`` bytes of body in memory, and notes any excess."""

    max_body = MAX_REQUEST_BODY
    body_too_large = False
    _body_size = 0

    def gotLength(self, length: int | None) -> None:
        self.content = BytesIO()
        self.body_too_large = length is not None and length > self.max_body

    def handleContentChunk(self, data: bytes) -> None:
        self._body_size += len(data)
        if self._body_size > self.max_body:
            self.body_too_large = True
        if self.body_too_large:
            self.content = BytesIO()  # let go of what was kept
            return
        assert self.content is not None
        self.content.write(data)


class _Relay(Protocol):
    """Copies the host's event stream to the guest program as it arrives."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.done: Deferred[None] = Deferred(lambda _: self._stop())

    def _stop(self) -> None:
        if self.transport is not None:
            cast(IPushProducer, self.transport).stopProducing()

    def dataReceived(self, data: bytes) -> None:
        self.request.write(data)

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008
        if not self.done.called:
            self.done.callback(None)


class GuestAPIProxy(Resource):
    """Every path, every method: forwarded to the host over a new TLS connection."""

    isLeaf = True
    log = Logger()

    def __init__(
        self,
        route: Callable[[], HostRoute],
        remember_state: Callable[[str], None],
        clock: IReactorTime,
        timeout: float = 30.0,
    ) -> None:
        """``route`` raises HostUnreachable while the link is down.

        ``remember_state`` is told ``"Ready"`` or ``"Started"`` after the host
        accepted a guest program's ``PATCH /1.0`` to that state.
        """
        super().__init__()
        self.route = route
        self.remember_state = remember_state
        self.clock = clock
        self.timeout = timeout

    def render(self, request: Request) -> Any:
        if getattr(request, "body_too_large", False):  # only a CappedRequest knows
            return self._answer(
                request,
                plain(413, f"Request body too large (limit {MAX_REQUEST_BODY} bytes)"),
            )
        try:
            route = self.route()
        except HostUnreachable as e:
            return self._answer(request, plain(503, f"host not reachable: {e}"))
        forwarding = Deferred.fromCoroutine(self._forward(request, route))
        forwarding.addErrback(self._failed, request, route)
        request.notifyFinish().addErrback(lambda _: forwarding.cancel())
        return NOT_DONE_YET

    async def _forward(self, request: Request, route: HostRoute) -> None:
        path, full_path = _target(request.uri)
        assert request.content is not None
        request.content.seek(0)
        body = request.content.read()
        method = request.method
        content_type = request.getHeader(b"content-type") or b""
        # A body only when there is one: a GET stays bodiless.
        sending = send_request(route.agent, method, full_path, body or None, content_type)
        response = await sending.addTimeout(self.timeout, self.clock)
        if path == EVENTS_PATH and response.code == 200:
            await self._relay(request, response)
            return
        raw = await read_body(response).addTimeout(self.timeout, self.clock)
        answer = devlxd_answer(response.code, raw)
        if method == b"PATCH" and path == STATE_PATH and 200 <= answer.code < 300:
            state = _declared_state(body)
            if state is not None:
                self._remember(state)
        self._finish(request, answer)

    def _remember(self, state: str) -> None:
        try:
            self.remember_state(state)
        except OSError as e:
            # The host has the state; only a later reconnect's reassertion is at risk.
            self.log.error(
                "cannot remember the workload's state {state}: {error}",
                state=state,
                error=e.strerror or e,
            )

    async def _relay(self, request: Request, response: IResponse) -> None:
        request.setResponseCode(200)
        content_type = response.headers.getRawHeaders(b"content-type", [JSON])[0]
        request.setHeader(b"content-type", content_type)
        request.write(b"")  # the headers now: an event may be long in coming
        relay = _Relay(request)
        response.deliverBody(relay)
        await relay.done
        if not request.finished and not request._disconnected:
            request.finish()

    def _failed(self, failure: Failure, request: Request, route: HostRoute) -> None:
        """The one place a failed forward becomes an HTTP answer."""
        if request.finished or request._disconnected or failure.check(CancelledError):
            return None  # the guest program went away: nobody to answer
        if failure.check(TimeoutError):
            answer = plain(
                503, f"host not reachable: no answer from {route.label} within {self.timeout:g}s"
            )
        elif failure.check(AnswerTooLarge):
            answer = plain(502, f"host sent an answer too large to relay ({failure.value})")
        elif failure.check(*_LINK_FAILURES):
            reason = describe_failure(failure)
            answer = plain(503, f"host not reachable: {route.label}: {reason}")
        else:  # a bug in the agent: the operator needs its traceback, the caller one line
            self.log.failure("forwarding {uri!r} failed", failure, uri=request.uri)
            answer = plain(500, f"vmready-agent internal error: {failure.getErrorMessage()}")
        if request.startedWriting:  # mid-stream: nothing more can be said
            request.finish()
            return None
        self._finish(request, answer)
        return None

    def _answer(self, request: Request, answer: Answer) -> bytes:
        request.setResponseCode(answer.code)
        request.setHeader(b"content-type", answer.content_type)
        request.setHeader(b"x-content-type-options", b"nosniff")
        return answer.body

    def _finish(self, request: Request, answer: Answer) -> None:
        if request.finished or request._disconnected:
            return
        request.write(self._answer(request, answer))
        request.finish()


def proxy_site(proxy: GuestAPIProxy) -> Site:
    """The HTTP server for the devlxd socket: capped bodies, no tracebacks to callers."""
    site = Site(proxy, requestFactory=CappedRequest)
    site.displayTracebacks = False
    site.noisy = False
    return site
