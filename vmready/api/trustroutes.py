"""The operator API's trust store routes: the remote API's trusted client certificates.

Issue a trust token, redeem one (the only request an untrusted remote client
may make, besides reading ``GET /1.0``), list and remove trusted certificates
(``api.trust``).  A token is redeemed as vmready's ``{"trust_token": T}`` or
as LXD's clients send it, ``{"password": T, "type": "client", …}`` (``lxc
remote add NAME TOKEN``, pylxd's ``authenticate``); as LXD does with a token,
the body's other fields (``name``, ``type``, ``certificate``, ``restricted``,
``projects``) are ignored: the certificate trusted is the one the TLS client
presents, under the name the token was issued for.
"""

from __future__ import annotations

from typing import Any

from twisted.web.iweb import IRequest

from vmready.api.operatorbase import OperatorBase, operator_app
from vmready.api.requestbody import read_json_body, recursion_level
from vmready.api.trust import certificate_json, peer_of, refuse_untrusted
from vmready.api.web import sync_response
from vmready.domain import BadRequest
from vmready.trust import TokenError, TrustToken


class TrustRoutes(OperatorBase):
    """``/1.0/certificates`` and ``/1.0/certificates/<fingerprint>``."""

    app = operator_app

    @app.route("/1.0/certificates", methods=["GET"])
    async def list_certificates(self, request: IRequest) -> bytes:
        """The trusted client certificates, as URLs or (``recursion=1``) objects."""
        refuse_untrusted(peer_of(request), "listing certificates")
        entries = await self.trust.certificates()
        if recursion_level(request) >= 1:
            return sync_response(request, [certificate_json(entry) for entry in entries])
        return sync_response(request, [f"/1.0/certificates/{e.fingerprint}" for e in entries])

    @app.route("/1.0/certificates", methods=["POST"])
    async def add_certificate(self, request: IRequest) -> bytes:
        """``{"name": N, "token": true}``: issue a trust token; ``{"trust_token": T}``: redeem it.

        LXD's ``{"password": T, …}`` redeems too.  Redeeming trusts the
        certificate the TLS client presents, so it is done over the remote API
        only; issuing needs the unix socket or a trusted client.
        """
        body = read_json_body(request)
        peer = peer_of(request)
        token = _offered_token(body)
        if token is not None:
            if peer is None:
                raise BadRequest(
                    "a trust token is redeemed over the remote API (https), by the client "
                    "whose certificate it adds; this request came over the unix socket"
                )
            entry = await self.trust.redeem(token, peer)
            return sync_response(request, certificate_json(entry))
        refuse_untrusted(peer, "issuing trust tokens")
        if body.get("token") is not True:
            raise BadRequest(
                'expected {"name": NAME, "token": true} (issue a trust token) or '
                '{"trust_token": TOKEN} (redeem one)'
            )
        return sync_response(request, await self.trust.issue(body.get("name")))

    @app.route("/1.0/certificates/<fingerprint>", methods=["GET"])
    async def get_certificate(self, request: IRequest, fingerprint: str) -> bytes:
        """One trusted certificate."""
        refuse_untrusted(peer_of(request), "reading certificates")
        return sync_response(request, certificate_json(await self.trust.find(fingerprint)))

    @app.route("/1.0/certificates/<fingerprint>", methods=["DELETE"])
    async def delete_certificate(self, request: IRequest, fingerprint: str) -> bytes:
        """Stop trusting a certificate; its client's open connections close."""
        refuse_untrusted(peer_of(request), "removing certificates")
        return sync_response(
            request, certificate_json(await self.trust.remove(fingerprint, request))
        )


def _offered_token(body: dict[str, Any]) -> object | None:
    """The trust token a redeeming body offers: vmready's ``trust_token`` or LXD's ``password``.

    None: the body offers none (it asks for one to be issued).  LXD's trust
    password is not a thing vmready has: a password that is not a token is
    refused, saying so.
    """
    if "trust_token" in body:
        offered: object = body["trust_token"]
        return offered
    password = body.get("password")
    if password is None or password == "":
        return None
    if not isinstance(password, str):
        raise BadRequest("Invalid field 'password': expected a trust token's text")
    try:
        TrustToken.decode(password)
    except TokenError as e:
        raise BadRequest(
            f"Invalid field 'password': {e}; trust passwords are not supported by vmready, "
            "give a trust token ('vmready config trust add NAME' on the daemon's host)"
        ) from None
    return password
