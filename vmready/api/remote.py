"""The operator API over mutual TLS (``--https-address``): the same API, for trusted clients.

The handshake presents the daemon's ``server.crt`` and accepts any self-signed
client certificate inside its validity, or none (as LXD does); whether it is
*trusted* is decided per request against the trust store (``api.trust``), so
that an untrusted client can make the one request that trusts it (redeeming a
token) and read ``GET /`` and ``GET /1.0``; anything else is 403.  Removing a
certificate ends its client's requests in progress.  In a cluster, the current
members' server certificates are trusted too, as ``member NAME``: they relay
requests to each other (a certificate no member is known by is judged again
after one re-read of the members: a member that just joined relays at once).
The rules are in docs/security.md.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import ITCPTransport
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.web import http
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Site

from vmready.api.limits import MAX_OPERATOR_CONNECTIONS
from vmready.api.operatorbase import OPERATOR_ERRORS
from vmready.api.trust import Peer, TrustRegistry, mark_peer
from vmready.api.web import json_response, local_site
from vmready.lifecycle import Membership
from vmready.trust import (
    CertificatePair,
    MutualServerTLS,
    fingerprint,
    is_valid_at,
    peer_certificate_pem,
    server_tls_factory,
)

REMOTE_PURPOSE = "remote operator API"
_REDEEM = (b"POST", b"/1.0/certificates")
# What LXD shows any client, trusted or not, certificate or none.
_PUBLIC = frozenset({(b"GET", b"/"), (b"GET", b"/1.0")})


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class TrustedClientsOnly(Resource):
    """In front of the operator API's resource: trusted client certificates only.

    An untrusted one may only redeem a trust token (``POST /1.0/certificates``)
    and read what LXD shows untrusted clients (``GET /``, ``GET /1.0``); a
    client without a certificate, only the latter.
    """

    isLeaf = True

    def __init__(
        self, api: IResource, trust: TrustRegistry, membership: Membership | None = None
    ) -> None:
        super().__init__()
        self._api = api
        self._trust = trust
        self._membership = membership
        # The requests in progress of each trusted certificate, with their connections'
        # transports (a WebSocket takes its over from twisted.web): ended if it is removed.
        self._requests: dict[str, dict[IRequest, ITCPTransport | None]] = {}
        # A read of the members under way for unknown certificates, and who waits for it.
        self._reading_members = False
        self._members_waiting: list[Deferred[None]] = []
        trust.on_revoked(self._revoked)

    def render(self, request: IRequest) -> Any:
        """Mark the request's peer, refuse an untrusted one, else hand over to the API."""
        pem = peer_certificate_pem(getattr(request, "transport", None))
        public = (request.method, request.path) in _PUBLIC
        if pem is None:
            mark_peer(request, Peer(None, None))
            if not public:
                return self._refuse(request, "not authorized: a client certificate is required")
            return self._api.render(request)
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
        elif trusted_as is None and not public and (request.method, request.path) != _REDEEM:
            if self._membership is not None:
                self._read_members_then_decide(request, presented, self._membership)
                return NOT_DONE_YET
            return self._refuse_untrusted(request, presented)
        return self._api.render(request)

    def _read_members_then_decide(
        self, request: IRequest, presented: str, membership: Membership
    ) -> None:
        """An unknown certificate may be a member's that joined since the members were read
        (it relays at once): read them once more before refusing it."""
        gone: list[object] = []
        cast(http.Request, request).notifyFinish().addErrback(gone.append)

        def decide(_: object) -> None:
            if gone:
                return  # the client went away meanwhile
            member = membership.member_for_fingerprint(presented)
            if member is None or member.name == membership.name:
                body: Any = self._refuse_untrusted(request, presented)
            else:
                mark_peer(request, Peer(presented, f"member {member.name}"))
                body = self._api.render(request)
            if body is not NOT_DONE_YET:
                request.write(body)
                request.finish()

        # A read that fails leaves the members as they were: the certificate stays unknown.
        waiting: Deferred[None] = Deferred()
        self._members_waiting.append(waiting)
        waiting.addCallback(decide)
        if not self._reading_members:
            self._reading_members = True
            Deferred.fromCoroutine(membership.refresh()).addBoth(self._members_read_done)

    def _members_read_done(self, result: object) -> None:
        """One read serves every request that waited for it (a failed one too)."""
        self._reading_members = False
        waiting, self._members_waiting = self._members_waiting, []
        for each in waiting:
            each.callback(None)

    def _refuse_untrusted(self, request: IRequest, presented: str) -> bytes:
        return self._refuse(
            request,
            f"not authorized: this client's certificate ({presented}) is not trusted by "
            "the daemon; add it with a trust token ('vmready config trust add NAME' on "
            "the daemon's host, then 'vmready remote add ... --token TOKEN' or "
            "'lxc remote add NAME TOKEN')",
        )

    def _refuse(self, request: IRequest, message: str) -> bytes:
        return json_response(request, 403, OPERATOR_ERRORS.envelope(403, message))

    def _track(self, presented: str, request: IRequest) -> None:
        requests = self._requests.setdefault(presented, {})
        channel = getattr(request, "channel", None)
        requests[request] = getattr(channel, "transport", None)

        def finished(result: object) -> None:
            requests.pop(request, None)
            if not requests and self._requests.get(presented) is requests:
                del self._requests[presented]

        # twisted.web's Request (what Site hands over) has it; IRequest does not declare it.
        cast(http.Request, request).notifyFinish().addBoth(finished)

    def _revoked(self, revoked: str, initiator: IRequest | None) -> None:
        for request, transport in list(self._requests.pop(revoked, {}).items()):
            channel = getattr(request, "channel", None)
            if request is initiator:
                # It removed its own certificate: answer it, then close (no next request).
                if channel is not None:
                    channel.persistent = False
            elif transport is not None:
                transport.abortConnection()


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
        log_reads=False,
    )


def remote_tls_factory(
    server: CertificatePair, site: Site, clock: Callable[[], datetime.datetime] = _utcnow
) -> TLSMemoryBIOFactory:
    """TLS around ``site``: the daemon's certificate; any valid client certificate, or none."""
    tls = MutualServerTLS(
        server,
        lambda pem: is_valid_at(pem, clock()),
        purpose=REMOTE_PURPOSE,
        require_certificate=False,
    )
    return server_tls_factory(tls, site)
