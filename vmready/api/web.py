"""What vmready's HTTP servers share: their Request class, LXD's envelopes, one error handler.

The Request class is fit for unix sockets and vsock.

``Request.getRequestHostname`` falls back to ``getHost().host`` when a client
sends no ``Host`` header (valid HTTP/1.0, e.g. ``nc -U``), and a unix or vsock
address has no host: Klein then fails with a 500 and a traceback.  Here such a
request is answered as addressed to ``localhost``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
from klein import Klein
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IConsumer, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IBodyProducer, IRequest
from twisted.web.resource import IResource
from twisted.web.server import Request
from werkzeug.exceptions import HTTPException, MethodNotAllowed
from zope.interface import implementer

from vmready.api.limits import LimitedSite, PeerKey
from vmready.api.requestbody import MAX_BODY_BYTES
from vmready.domain import BadRequest, StatusCode, VMReadyError

KleinT = TypeVar("KleinT", bound=Klein)


class LocalRequest(Request):
    """A request whose host name is ``localhost`` when neither header nor address has one.

    Its body is kept only up to ``MAX_BODY_BYTES``: a larger one (declared by its
    Content-Length, or found so while it arrives in chunks) is counted and
    dropped as it comes, never buffered (twisted.web would spool it to a
    temporary file), and ``body_overflowed`` says so: served by a
    ``local_site``, the channel then answers 413 at once and reads no more
    (``api.limits``); elsewhere the handler answers 413 (``read_body``).
    """

    body_overflowed = False
    # Called with each piece of the response body before it is written (a recorder's tap).
    body_observer: Callable[[bytes], None] | None = None

    def write(self, data: bytes) -> None:
        """Write part of the response body, shown to ``body_observer`` first."""
        if self.body_observer is not None:
            self.body_observer(data)
        super().write(data)

    def gotLength(self, length: int | None) -> None:
        """The declared length: beyond the cap, keep nothing."""
        if length is not None and length > MAX_BODY_BYTES:
            self.body_overflowed = True
            length = 0
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        """Part of the body: kept while within the cap, else everything is dropped."""
        if self.body_overflowed:
            return
        assert self.content is not None
        if self.content.tell() + len(data) > MAX_BODY_BYTES:
            self.body_overflowed = True
            self.content.seek(0)
            self.content.truncate()
            return
        super().handleContentChunk(data)

    def getRequestHostname(self) -> bytes:
        """The Host header's host, else the listening address's, else ``localhost``."""
        if self.getHeader(b"Host") is None and not hasattr(self.getHost(), "host"):
            return b"localhost"
        hostname: bytes = super().getRequestHostname()
        return hostname


def local_site(
    resource: IResource,
    errors: ErrorStyle,
    *,
    label: str,
    max_connections: int | None = None,
    peer_key: PeerKey | None = None,
    max_per_peer: int | None = None,
    log_reads: bool = True,
    reactor: IReactorTime | None = None,
) -> LimitedSite:
    """A Site for ``resource`` that answers requests without a Host header, within limits.

    Its refusals (413, 408, 429, 503: ``api.limits``) are worded in ``errors``'s
    envelope; ``label`` names the server in log lines; the connection bounds,
    whether successful reads are logged and the reactor (its clock) are
    ``LimitedSite``'s.
    """
    return LimitedSite(
        TextURLGuard(resource, errors),
        errors.envelope,
        label=label,
        requestFactory=LocalRequest,
        max_connections=max_connections,
        peer_key=peer_key,
        max_per_peer=max_per_peer,
        log_reads=log_reads,
        reactor=reactor,
    )


@implementer(IResource)
class TextURLGuard:
    """Answers, in the server's own envelope, a request whose URL is not UTF-8 text.

    A path that is not UTF-8 once percent-decoded (``/1.0/instances/%ff``), or
    such a ``Host``, cannot name anything here; Klein would answer it before
    any handler, as an HTML 400 with a traceback in the log. Here it is a 400
    like any other refusal, and the wrapped resource is not asked.
    """

    isLeaf = True

    def __init__(self, wrapped: IResource, errors: ErrorStyle) -> None:
        self._wrapped = wrapped
        self._errors = errors

    def render(self, request: IRequest) -> Any:
        """The wrapped resource's answer, or a 400 naming what is not text."""
        what = _undecodable_url_part(request)
        if what is not None:
            refusal = BadRequest(f"Invalid URL: its {what} is not UTF-8 text")
            return handle_error(request, Failure(refusal), self._errors, _log)
        return self._wrapped.render(request)

    def getChildWithDefault(self, name: bytes, request: IRequest) -> IResource:
        """Never asked: this resource is a leaf, as the Klein resource it guards."""
        child: IResource = self._wrapped.getChildWithDefault(name, request)
        return child

    def putChild(self, path: bytes, child: IResource) -> None:
        """Children belong to the wrapped resource."""
        self._wrapped.putChild(path, child)


_log = Logger()


def _undecodable_url_part(request: IRequest) -> str | None:
    """Which part of the request's URL is not UTF-8 (``path``, ``host``), or None."""
    parts: list[tuple[str, bytes]] = [
        ("path", b"/".join([*request.prepath, *request.postpath])),
        ("host", request.getRequestHostname()),
    ]
    for what, raw in parts:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return what
    return None


def literal_paths(app: KleinT) -> KleinT:
    """``app`` matching paths as they are written: ``//`` is not merged into ``/``.

    werkzeug merges repeated slashes by answering a 308 redirect to the merged
    path, which an API client does not follow and which said "permanent
    redirect" in an error envelope; here such a path is simply no route (404),
    or a config key that starts with ``/``. Call it before any route is added.
    """
    app.url_map.merge_slashes = False
    return app


def json_response(request: IRequest, code: int, body: Any) -> bytes:
    """The one place a response body is serialised (Klein would send a dict as nothing)."""
    return encoded_response(request, code, json.dumps(body).encode("utf-8"))


def encoded_response(request: IRequest, code: int, encoded: bytes) -> bytes:
    """A response of a JSON body already encoded, with its Content-Length.

    As Go's net/http sends a small answer: twisted.web then writes head and
    body at once, where a chunked answer (Klein sets no length) costs a
    second write for its last chunk.
    """
    encoded += b"\n"
    _json_head(request, code, len(encoded))
    return encoded


def _json_head(request: IRequest, code: int, length: int) -> None:
    """The status and headers of a JSON answer of ``length`` bytes."""
    request.setResponseCode(code)
    request.setHeader(b"Content-Type", b"application/json")
    request.setHeader(b"Content-Length", b"%d" % length)


# LXD's synchronous success envelope, up to its ``metadata`` (the last key json.dumps writes).
_SYNC_ENVELOPE = {
    "type": "sync",
    "status": "Success",
    "status_code": int(StatusCode.SUCCESS),
    "operation": "",
    "error_code": 0,
    "error": "",
}
_SYNC_HEAD = json.dumps(_SYNC_ENVELOPE).encode("utf-8")[:-1] + b', "metadata": '


def sync_response(request: IRequest, metadata: Any) -> bytes:
    """LXD's synchronous success envelope around ``metadata``."""
    return sync_response_encoded(request, json.dumps(metadata).encode("utf-8"))


def sync_response_encoded(request: IRequest, metadata: bytes) -> bytes:
    """``sync_response`` of metadata already encoded (``json.dumps``), byte for byte the same."""
    return encoded_response(request, 200, _SYNC_HEAD + metadata + b"}")


def sync_response_array(request: IRequest, items: Sequence[bytes]) -> bytes:
    """``sync_response`` of a list whose items are already encoded, byte for byte the same.

    Joined in one copy: a list of 1,000 instances is a megabyte, and each
    copy of it (the array, then the envelope around it, then its newline)
    was about 8 % of a cluster member's busy time under load
    (``benchmarks/api_load.py``).
    """
    parts = [_SYNC_HEAD, b"["]
    for index, item in enumerate(items):
        if index:
            parts.append(b", ")
        parts.append(item)
    parts.append(b"]}\n")
    body = b"".join(parts)
    _json_head(request, 200, len(body))
    return body


@attrs.frozen
class ErrorStyle:
    """How one server words its errors; ``handle_error`` decides which error it is.

    ``envelope`` turns a status and a message into the response body;
    ``method_not_allowed`` words a 405 for the request's method; ``internal``
    is the message of a 500; ``label`` starts the log line of a 500.
    """

    envelope: Callable[[int, str], Any]
    method_not_allowed: Callable[[str], str]
    internal: str
    label: str


def handle_error(request: IRequest, failure: Failure, style: ErrorStyle, log: Logger) -> bytes:
    """The one place an exception becomes a response, for both of vmready's HTTP servers.

    A ``VMReadyError`` answers its status and message; a routing error (404,
    405 with an ``Allow`` header) answers its status; anything else is logged
    with its traceback and answers a 500 that says nothing more.
    """

    def answer(code: int, message: str) -> bytes:
        return json_response(request, code, style.envelope(code, message))

    error = failure.value
    if isinstance(error, VMReadyError):
        return answer(error.http_status, error.message)
    if isinstance(error, MethodNotAllowed):
        if error.valid_methods:
            request.setHeader(b"Allow", ", ".join(sorted(error.valid_methods)).encode())
        return answer(405, style.method_not_allowed(request.method.decode("latin-1")))
    if isinstance(error, HTTPException):
        code = error.code or 500
        return answer(code, "not found" if code == 404 else str(error.name).lower())
    log.failure(
        "{label}{method} {path} failed",
        failure,
        label=style.label,
        method=request.method.decode("ascii", "replace"),
        path=request.path.decode("utf-8", "replace"),
    )
    return answer(500, style.internal)


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
