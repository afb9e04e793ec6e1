"""Trust tokens: what ``vmready config trust add`` hands a new client, as Incus does.

A token is base64 of a JSON object: the name the client will be trusted as,
the daemon's certificate fingerprint (the client pins it: a token is also the
answer to "is this really my daemon?"), the addresses its remote API listens
on, a random secret, and when it expires.  The daemon keeps only the secret's
SHA-256, so its store never holds a usable token; redeeming one deletes it.

Decoding never raises anything but ``TokenError``, whose message says what is
wrong with the text (a token copied half, a fingerprint that is not one).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import json
import re
import secrets
from collections.abc import Sequence
from typing import Any

import attrs

_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
_SECRET = re.compile(r"[0-9a-f]{32,128}")
SECRET_BYTES = 32


class TokenError(ValueError):
    """Text that is not a usable trust token (or fingerprint); the message says why."""


def new_secret() -> str:
    """A fresh random secret, hex."""
    return secrets.token_hex(SECRET_BYTES)


def hash_secret(secret: str) -> str:
    """What the daemon stores for a secret: its SHA-256, hex."""
    return hashlib.sha256(secret.encode("ascii")).hexdigest()


def normalize_fingerprint(text: str) -> str:
    """A SHA-256 fingerprint as vmready writes it (64 lower-case hex digits).

    Accepts ``openssl x509 -fingerprint -sha256``'s form too (upper case,
    colons, a ``SHA256 Fingerprint=`` prefix); TokenError for anything else.
    """
    value = text.strip()
    if "=" in value:
        value = value.split("=", 1)[1]
    value = value.replace(":", "").lower()
    if not _FINGERPRINT.fullmatch(value):
        raise TokenError(
            f"{text!r} is not a SHA-256 certificate fingerprint (64 hex digits, colons allowed)"
        )
    return value


@attrs.frozen
class TrustToken:
    """One trust token's content."""

    client_name: str
    fingerprint: str
    addresses: tuple[str, ...]
    secret: str
    expires_at: datetime.datetime

    @classmethod
    def issue(
        cls,
        client_name: str,
        fingerprint: str,
        addresses: Sequence[str],
        expires_at: datetime.datetime,
    ) -> TrustToken:
        """A new token with a fresh secret."""
        return cls(client_name, fingerprint, tuple(addresses), new_secret(), expires_at)

    @property
    def secret_hash(self) -> str:
        """What the daemon stores for this token."""
        return hash_secret(self.secret)

    def encode(self) -> str:
        """The token's text: base64 of its JSON."""
        body = {
            "client_name": self.client_name,
            "fingerprint": self.fingerprint,
            "addresses": list(self.addresses),
            "secret": self.secret,
            "expires_at": _utc_text(self.expires_at),
        }
        raw = json.dumps(body, separators=(",", ":")).encode("utf-8")
        return base64.b64encode(raw).decode("ascii")

    @classmethod
    def decode(cls, text: str) -> TrustToken:
        """The token ``text`` holds; TokenError saying what is wrong with it."""
        compact = "".join(text.split())
        if not compact:
            raise TokenError("the trust token is empty")
        try:
            raw = base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
        except (binascii.Error, ValueError):
            try:
                raw = base64.b64decode(
                    compact + "=" * (-len(compact) % 4), altchars=b"-_", validate=True
                )
            except (binascii.Error, ValueError):
                raise TokenError(
                    "not a trust token: not base64 text (was it copied whole?)"
                ) from None
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            raise TokenError(
                "not a trust token: its base64 does not hold JSON (was it copied whole?)"
            ) from None
        except RecursionError:
            # Nested deeper than Python's JSON decoder recurses: no token is.
            raise TokenError("not a trust token: its JSON is nested too deeply") from None
        if not isinstance(body, dict):
            raise TokenError("not a trust token: expected a JSON object inside")
        name = _text(body, "client_name")
        if not name:
            raise TokenError("trust token: client_name is empty")
        fingerprint = _text(body, "fingerprint")
        if not _FINGERPRINT.fullmatch(fingerprint):
            raise TokenError("trust token: fingerprint is not 64 lower-case hex digits")
        secret = _text(body, "secret")
        if not _SECRET.fullmatch(secret):
            raise TokenError("trust token: secret is not hex of 16 to 64 bytes")
        addresses = body.get("addresses")
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise TokenError("trust token: addresses is not a list of host:port strings")
        expires = _text(body, "expires_at")
        try:
            expires_at = datetime.datetime.fromisoformat(expires.replace("Z", "+00:00"))
        except ValueError:
            raise TokenError(
                f"trust token: expires_at {expires!r} is not a date and time"
            ) from None
        if expires_at.tzinfo is None:
            raise TokenError(f"trust token: expires_at {expires!r} has no time zone")
        try:
            expires_at = expires_at.astimezone(datetime.UTC)
        except OverflowError:
            # 0001-01-01T00:00:00+14:00 is before the first moment a datetime holds.
            raise TokenError(f"trust token: expires_at {expires!r} is out of range") from None
        return cls(name, fingerprint, tuple(addresses), secret, expires_at)


def _utc_text(moment: datetime.datetime) -> str:
    """``moment`` in UTC as RFC 3339 to the second, its year in four digits.

    (``strftime("%Y")`` writes the year 26 as ``26``, which no reader takes back.)
    """
    utc = moment.astimezone(datetime.UTC)
    return (
        f"{utc.year:04d}-{utc.month:02d}-{utc.day:02d}"
        f"T{utc.hour:02d}:{utc.minute:02d}:{utc.second:02d}Z"
    )


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if value is None:
        raise TokenError(f"trust token: {key} is missing")
    if not isinstance(value, str):
        raise TokenError(f"trust token: {key} is not text")
    return value
