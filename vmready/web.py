"""The one Request class vmready's HTTP servers use: fit for unix sockets and vsock.

``Request.getRequestHostname`` falls back to ``getHost().host`` when a client
sends no ``Host`` header (valid HTTP/1.0, e.g. ``nc -U``), and a unix or vsock
address has no host: Klein then fails with a 500 and a traceback.  Here such a
request is answered as addressed to ``localhost``.
"""

from __future__ import annotations

from twisted.web.resource import IResource
from twisted.web.server import Request, Site

__all__ = ["LocalRequest", "local_site"]


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
