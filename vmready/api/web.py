"""What vmready's HTTP servers share: their Request class and LXD's JSON envelope.

The Request class is fit for unix sockets and vsock.

``Request.getRequestHostname`` falls back to ``getHost().host`` when a client
sends no ``Host`` header (valid HTTP/1.0, e.g. ``nc -U``), and a unix or vsock
address has no host: Klein then fails with a 500 and a traceback.  Here such a
request is answered as addressed to ``localhost``.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IConsumer
from twisted.web.iweb import IBodyProducer, IRequest
from twisted.web.resource import IResource
from twisted.web.server import Request, Site
from zope.interface import implementer

from vmready.domain.states import StatusCode

__all__ = ["BytesProducer", "LocalRequest", "json_response", "local_site", "sync_response"]


class LocalRequest(Request):
    """A request whose host name is ``localhost`` when neither header nor address has one."""

    def getRequestHostname(self) -> bytes:
        """The Host header's host, else the listening address's, else ``localhost``."""
        if self.getHeader(b"Host") is None and not hasattr(self.getHost(), "host"):
            return b"localhost"
        hostname: bytes = super().getRequestHostname()
        return hostname


def local_site(resource: IResource) -> Site:
    """A Site for ``resource`` that answers requests without a Host header."""
    return Site(resource, requestFactory=LocalRequest)


def json_response(request: IRequest, code: int, body: Any) -> bytes:
    """The one place a response body is serialised (Klein would send a dict as nothing)."""
    request.setResponseCode(code)
    request.setHeader(b"Content-Type", b"application/json")
    return json.dumps(body).encode("utf-8") + b"\n"


def sync_response(request: IRequest, metadata: Any) -> bytes:
    """LXD's synchronous success envelope around ``metadata``."""
    return json_response(
        request,
        200,
        {
            "type": "sync",
            "status": "Success",
            "status_code": int(StatusCode.SUCCESS),
            "operation": "",
            "error_code": 0,
            "error": "",
            "metadata": metadata,
        },
    )


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
