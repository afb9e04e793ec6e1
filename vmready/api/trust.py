"""Who may use the remote operator API: the trust store, its tokens, and each request's peer.

``TrustRegistry`` keeps the trusted client certificates in memory, so the gate
in front of the remote API (``api.remote``) decides every request without
waiting for the store; every change is committed to the store first, and a
member reads the store again (``refresh``) when another member changed it.  It
tells whoever listens when a certificate is removed (the gate then closes that
client's connections).  A request on the unix socket has no ``Peer``: whoever
reaches that socket is the daemon's administrator.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest

from vmready.domain import BadRequest, Forbidden, NotFound
from vmready.store import AsyncStore, Store, TrustedCertificate
from vmready.trust import TokenError, TrustToken, hash_secret, normalize_fingerprint

# Seconds a trust token stays valid (Incus's tokens do not expire by default; ours do).
DEFAULT_TOKEN_LIFETIME = 24 * 3600.0
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,62}")
_PEER_ATTRIBUTE = "vmready_remote_peer"


@attrs.frozen
class Peer:
    """The TLS client of a remote API request: its certificate, and the name it is trusted as.

    ``fingerprint`` is None for a client that presented no certificate (it
    may only read what LXD shows untrusted clients: ``GET /``, ``GET /1.0``).
    """

    fingerprint: str | None
    trusted_as: str | None

    @property
    def trusted(self) -> bool:
        """Whether the certificate is in the trust store."""
        return self.trusted_as is not None


def mark_peer(request: IRequest, peer: Peer) -> None:
    """Remember the request's TLS client for the handlers (the gate does this)."""
    setattr(request, _PEER_ATTRIBUTE, peer)


def peer_of(request: IRequest) -> Peer | None:
    """The request's TLS client; None on the unix socket."""
    peer = getattr(request, _PEER_ATTRIBUTE, None)
    return peer if isinstance(peer, Peer) else None


def _utc(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC)


def _rfc3339(seconds: float) -> str:
    return _utc(seconds).strftime("%Y-%m-%dT%H:%M:%SZ")


def certificate_json(entry: TrustedCertificate) -> dict[str, Any]:
    """A trusted certificate as the API shows it (Incus's certificate object, in part)."""
    return {
        "name": entry.name,
        "type": "client",
        "fingerprint": entry.fingerprint,
        "added_at": _rfc3339(entry.added_at),
    }


def validate_trust_name(name: object) -> str:
    """The name a certificate is trusted as; a 400 for anything else."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadRequest(
            f"Invalid certificate name {name!r}: use 1-63 letters, digits, '.', '_', '@' "
            "and '-', starting with a letter or digit"
        )
    return name


class TrustRegistry:
    """The trusted client certificates, read at every remote request.

    Changed through here, or read again (``refresh``) when another member
    changed them.
    """

    def __init__(
        self,
        store: AsyncStore,
        clock: Callable[[], float],
        server_fingerprint: str | None = None,
        token_lifetime: float = DEFAULT_TOKEN_LIFETIME,
    ) -> None:
        self._store = store
        self._clock = clock
        self.server_fingerprint = server_fingerprint
        self.token_lifetime = token_lifetime
        # host:port the remote API is reached at (tokens carry them); empty: it does not listen.
        self.addresses: list[str] = []
        self._trusted: dict[str, TrustedCertificate] = {}
        self._revoked: list[Callable[[str, IRequest | None], None]] = []
        # Whether a refresh runs, and whether another read is owed after its current one.
        self._refreshing = False
        self._owed = False
        self._waiting: list[Deferred[None]] = []

    async def load(self) -> None:
        """Read the trusted certificates (before the remote API listens)."""
        await self.refresh()

    def refresh(self) -> Deferred[None]:
        """Read the trust store again: trust what is new, revoke what is gone.

        Another member trusted or removed a certificate; a certificate gone is
        revoked as ``remove`` revokes it (its requests in progress end).  Fires
        once a read that began after this call is applied; calls while one
        runs share one more read.  The store runs its calls in order and
        answers them in that order, so a read is applied before any change
        made here after it (a redeemed token, a removal), and after any made
        before it: it never undoes one, nor revokes in a removal's place.
        """
        done: Deferred[None] = Deferred()
        self._waiting.append(done)
        self._owed = True
        if not self._refreshing:
            self._refreshing = True
            Deferred.fromCoroutine(self._refresh_while_owed())
        return done

    async def _refresh_while_owed(self) -> None:
        try:
            while self._owed:
                self._owed = False
                waiting, self._waiting = self._waiting, []
                try:
                    entries = await self._store.run(
                        lambda engine: engine.trust.trusted_certificates()
                    )
                except Exception:
                    # Those waiting learn why; any asked since get a read of their own.
                    failure = Failure()
                    for done in waiting:
                        done.errback(failure)
                    continue
                self._apply(entries)
                for done in waiting:
                    done.callback(None)
        finally:
            self._refreshing = False

    def _apply(self, entries: list[TrustedCertificate]) -> None:
        trusted = {entry.fingerprint: entry for entry in entries}
        gone = [fingerprint for fingerprint in self._trusted if fingerprint not in trusted]
        self._trusted = trusted
        for fingerprint in gone:
            for listener in list(self._revoked):
                listener(fingerprint, None)

    def trusted(self, fingerprint: str) -> TrustedCertificate | None:
        """The entry trusting ``fingerprint``, or None."""
        return self._trusted.get(fingerprint)

    def on_revoked(self, listener: Callable[[str, IRequest | None], None]) -> None:
        """Call ``listener(fingerprint, request)`` when a certificate stops being trusted.

        ``request`` is the one that removed it (None: not a request).
        """
        self._revoked.append(listener)

    async def issue(self, name: object) -> dict[str, Any]:
        """A new trust token for ``name`` (``POST /1.0/certificates`` with ``token: true``)."""
        name = validate_trust_name(name)
        if self.server_fingerprint is None or not self.addresses:
            raise BadRequest(
                "this daemon serves no remote API: start it with --https-address HOST:PORT "
                "(or https-address in its config file) before issuing trust tokens"
            )
        now = self._clock()
        expires = now + self.token_lifetime
        token = TrustToken.issue(name, self.server_fingerprint, self.addresses, _utc(expires))
        secret_hash = token.secret_hash

        def add(engine: Store) -> None:
            engine.trust.add_token(name, secret_hash, now, expires)

        await self._store.run(add)
        return {
            "client_name": name,
            "token": token.encode(),
            "fingerprint": self.server_fingerprint,
            "addresses": list(self.addresses),
            "expires_at": _rfc3339(expires),
        }

    async def redeem(self, text: object, peer: Peer) -> TrustedCertificate:
        """Trust ``peer``'s certificate for the token ``text``; Forbidden if it does not work."""
        if not isinstance(text, str):
            raise BadRequest("Invalid field 'trust_token': expected the token's text")
        presented = peer.fingerprint
        if presented is None:
            raise Forbidden(
                "not authorized: a trust token trusts the client certificate that presents it, "
                "and this client presented none"
            )
        try:
            token = TrustToken.decode(text)
        except TokenError as e:
            raise BadRequest(str(e)) from None
        secret_hash = hash_secret(token.secret)
        now = self._clock()
        entry = await self._store.run(
            lambda engine: engine.trust.redeem_token(secret_hash, presented, now)
        )
        self._trusted[entry.fingerprint] = entry
        return entry

    async def certificates(self) -> list[TrustedCertificate]:
        """Every trusted certificate, by name (read from the store)."""
        return await self._store.run(lambda engine: engine.trust.trusted_certificates())

    async def find(self, fingerprint: str) -> TrustedCertificate:
        """The entry for ``fingerprint``; NotFound otherwise."""
        key = _fingerprint(fingerprint)
        for entry in await self.certificates():
            if entry.fingerprint == key:
                return entry
        raise NotFound(f"no trusted certificate has fingerprint {key}")

    async def remove(
        self, fingerprint: str, initiator: IRequest | None = None
    ) -> TrustedCertificate:
        """Stop trusting ``fingerprint``: its requests in progress end, later ones are refused."""
        key = _fingerprint(fingerprint)
        entry = await self._store.run(lambda engine: engine.trust.remove_certificate(key))
        self._trusted.pop(key, None)
        for listener in list(self._revoked):
            listener(key, initiator)
        return entry


def _fingerprint(text: str) -> str:
    try:
        return normalize_fingerprint(text)
    except TokenError as e:
        raise BadRequest(str(e)) from None


def refuse_untrusted(peer: Peer | None, what: str) -> None:
    """Forbidden for a TLS client that is not trusted (the gate lets it redeem a token only)."""
    if peer is not None and not peer.trusted:
        raise Forbidden(f"not authorized: {what} needs a trusted client certificate")
