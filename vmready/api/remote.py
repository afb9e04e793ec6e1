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
ends its client's requests in progress: a revoked client keeps no event
stream (the request that removed it gets its answer, then its connection closes).

In a cluster the certificates of the current members (the fingerprints the
members table holds, as the ``Membership`` last read them) are trusted too,
as ``member NAME``: each member forwards requests to another presenting its
own server certificate.  Only those: a certificate stops being trusted this
way when its member's row is gone (``cluster remove``) or holds another
fingerprint.  A member whose lease ran out (unreachable) keeps its row, and
so its trust: coming back, it must relay requests and answer relayed ones at
once, before every other member has read its new lease; it holds no more
than its row's owner had, and whoever can write the members table is trusted
already.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, cast

from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import Site

from vmready.api.limits import MAX_OPERATOR_CONNECTIONS
from vmready.api.operator import OPERATOR_ERRORS
from vmready.api.trust import Peer, TrustRegistry, mark_peer
from vmready.api.web import json_response, local_site
from vmready.lifecycle.members import Membership
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

    def __init__(
        self, api: IResource, trust: TrustRegistry, membership: Membership | None = None
    ) -> None:
        super().__init__()
        self._api = api
        self._trust = trust
        self._membership = membership
        # The requests in progress of each trusted certificate, ended if it is removed.
        self._requests: dict[str, set[IRequest]] = {}
        trust.on_revoked(self._revoked)

    def render(self, request: IRequest) -> Any:
        """Mark the request's peer, refuse an untrusted one, else hand over to the API."""
        pem = peer_certificate_pem(getattr(request, "transport", None))
        if pem is None:
            return self._refuse(request, "not authorized: a client certificate is required")
        presented = fingerprint(pem)
        entry = self._trust.trusted(presented)
        trusted_as = None if entry is None else entry.name
        if trusted_as is None and self._membership is not None:
            member = self._membership.member_for_fingerprint(presented)
            if member is not None and member.name != self._membership.name:
                trusted_as = f"member {member.name}"
        mark_peer(request, Peer(presented, trusted_as))
        if entry is not None:
            self._track(presented, request)
        elif trusted_as is None and (request.method, request.path) != _REDEEM:
            return self._refuse(
                request,
                f"not authorized: this client's certificate ({presented}) is not trusted by "
                "the daemon; add it with a trust token ('vmready config trust add NAME' on "
                "the daemon's host, then 'vmready remote add ... --token TOKEN')",
            )
        return self._api.render(request)

    def _refuse(self, request: IRequest, message: str) -> bytes:
        return json_response(request, 403, OPERATOR_ERRORS.envelope(403, message))

    def _track(self, presented: str, request: IRequest) -> None:
        requests = self._requests.setdefault(presented, set())
        requests.add(request)

        def finished(result: object) -> None:
            requests.discard(request)
            if not requests and self._requests.get(presented) is requests:
                del self._requests[presented]

        # twisted.web's Request (what Site hands over) has it; IRequest does not declare it.
        cast(http.Request, request).notifyFinish().addBoth(finished)

    def _revoked(self, revoked: str, initiator: IRequest | None) -> None:
        for request in list(self._requests.pop(revoked, ())):
            channel = getattr(request, "channel", None)
            if request is initiator:
                # It removed its own certificate: answer it, then close (no next request).
                if channel is not None:
                    channel.persistent = False
            elif channel is not None and channel.transport is not None:
                channel.transport.abortConnection()


def remote_site(
    api: IResource, trust: TrustRegistry, membership: Membership | None = None
) -> Site:
    """The site the remote API serves: ``api`` behind the trust gate, within the API's limits.

    Its connections count apart from the unix socket's, with the same bound;
    ``membership``: this daemon is a cluster member, and trusts the others.
    """
    return local_site(
        TrustedClientsOnly(api, trust, membership),
        OPERATOR_ERRORS,
        label="remote operator API",
        max_connections=MAX_OPERATOR_CONNECTIONS,
    )


def remote_tls_factory(
    server: CertificatePair, site: Site, clock: Callable[[], datetime.datetime] = _utcnow
) -> TLSMemoryBIOFactory:
    """Mutual TLS around ``site``: the daemon's certificate; any valid client certificate."""
    tls = MutualServerTLS(server, lambda pem: is_valid_at(pem, clock()), purpose=REMOTE_PURPOSE)
    return server_tls_factory(tls, site)
