"""The operator API over mutual TLS (``--https-address``): the same API, for trusted clients.

The TLS handshake demands a client certificate (a self-signed leaf inside its
validity period; no client certificate, no connection) and presents the
daemon's own ``server.crt``, the one its agents pin.  Whether a certificate is
*trusted* is decided per request, by its SHA-256 fingerprint against the trust
store (``api.trust``), not in the handshake: an untrusted client must be able
to make the one request that trusts it, ``POST /1.0/certificates`` with a
trust token.  Every other request of an untrusted client is answered 403 with
LXD's error envelope (a clear "not trusted" rather than a handshake that
breaks off without saying why).  Removing a certificate from the trust store
closes its client's open connections: a revoked client keeps no event stream.
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Callable
from typing import Any

from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import Site

from vmready.api.operator import OPERATOR_ERRORS
from vmready.api.trust import Peer, TrustRegistry, mark_peer
from vmready.api.web import json_response, local_site
from vmready.trust.certs import CertificatePair, fingerprint, is_valid_at
from vmready.trust.tls import MutualServerTLS, peer_certificate_pem, server_tls_factory

__all__ = ["REMOTE_PURPOSE", "TrustedClientsOnly", "remote_site", "remote_tls_factory"]

REMOTE_PURPOSE = "remote operator API"
_REDEEM = (b"POST", b"/1.0/certificates")


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class TrustedClientsOnly(Resource):
    """In front of the operator API's resource: trusted client certificates only.

    An untrusted one may only redeem a trust token (``POST /1.0/certificates``).
    """

    isLeaf = True

    def __init__(self, api: IResource, trust: TrustRegistry) -> None:
        super().__init__()
        self._api = api
        self._trust = trust
        # The connections of each trusted certificate, closed if it is removed.
        self._channels: dict[str, weakref.WeakSet[Any]] = {}
        trust.on_revoked(self._revoked)

    def render(self, request: IRequest) -> Any:
        """Mark the request's peer, refuse an untrusted one, else hand over to the API."""
        pem = peer_certificate_pem(getattr(request, "transport", None))
        if pem is None:
            return self._refuse(request, "not authorized: a client certificate is required")
        presented = fingerprint(pem)
        entry = self._trust.trusted(presented)
        mark_peer(request, Peer(presented, None if entry is None else entry.name))
        if entry is not None:
            channel = getattr(request, "channel", None)
            if channel is not None:
                self._channels.setdefault(presented, weakref.WeakSet()).add(channel)
        elif (request.method, request.path) != _REDEEM:
            return self._refuse(
                request,
                f"not authorized: this client's certificate ({presented}) is not trusted by "
                "the daemon; add it with a trust token ('vmready config trust add NAME' on "
                "the daemon's host, then 'vmready remote add ... --token TOKEN')",
            )
        return self._api.render(request)

    def _refuse(self, request: IRequest, message: str) -> bytes:
        return json_response(request, 403, OPERATOR_ERRORS.envelope(403, message))

    def _revoked(self, revoked: str) -> None:
        for channel in list(self._channels.pop(revoked, ())):
            transport = getattr(channel, "transport", None)
            if transport is not None:
                transport.abortConnection()


def remote_site(api: IResource, trust: TrustRegistry) -> Site:
    """The site the remote API serves: ``api`` behind the trust gate."""
    return local_site(TrustedClientsOnly(api, trust))


def remote_tls_factory(
    server: CertificatePair, site: Site, clock: Callable[[], datetime.datetime] = _utcnow
) -> TLSMemoryBIOFactory:
    """Mutual TLS around ``site``: the daemon's certificate; any valid client certificate."""
    tls = MutualServerTLS(server, lambda pem: is_valid_at(pem, clock()), purpose=REMOTE_PURPOSE)
    return server_tls_factory(tls, site)
