"""Trust tokens: encoded and decoded exactly, and every malformed one refused precisely."""

from __future__ import annotations

import base64
import datetime
import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from vmready.trust.tokens import TokenError, TrustToken, hash_secret, normalize_fingerprint

_WHEN = datetime.datetime(2026, 11, 28, 17, 0, 0, tzinfo=datetime.UTC)


def _encoded(body: Any) -> str:
    return base64.b64encode(json.dumps(body).encode()).decode()


def _body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "client_name": "laptop",
        "fingerprint": "ab" * 32,
        "addresses": ["10.0.0.1:8443"],
        "secret": "cd" * 32,
        "expires_at": "2026-11-28T17:00:00Z",
    }
    body.update(changes)
    return {key: value for key, value in body.items() if value is not None}


class TokenTests(SynchronousTestCase):
    def test_roundTrip(self) -> None:
        token = TrustToken.issue("laptop", "ab" * 32, ["10.0.0.1:8443"], _WHEN)
        self.assertEqual(len(token.secret), 64)
        decoded = TrustToken.decode(token.encode())
        self.assertEqual(decoded, token)
        self.assertEqual(decoded.secret_hash, hash_secret(token.secret))
        self.assertNotEqual(decoded.secret_hash, token.secret)

    def test_eachTokenHasItsOwnSecret(self) -> None:
        first = TrustToken.issue("a", "ab" * 32, [], _WHEN)
        second = TrustToken.issue("a", "ab" * 32, [], _WHEN)
        self.assertNotEqual(first.secret, second.secret)

    def test_whitespaceFromCopyingIsIgnored(self) -> None:
        text = _encoded(_body())
        decoded = TrustToken.decode(f"  {text[:20]}\n{text[20:]}\n")
        self.assertEqual(decoded.client_name, "laptop")
        self.assertEqual(decoded.expires_at, _WHEN)

    def assertRefused(self, text: str, message: str) -> None:
        error = self.assertRaises(TokenError, TrustToken.decode, text)
        self.assertEqual(str(error), message)

    def test_malformedTokens(self) -> None:
        self.assertRefused("", "the trust token is empty")
        self.assertRefused("%%%%", "not a trust token: not base64 text (was it copied whole?)")
        self.assertRefused(
            base64.b64encode(b"hello").decode(),
            "not a trust token: its base64 does not hold JSON (was it copied whole?)",
        )
        self.assertRefused(
            _encoded(_body())[:-12],
            "not a trust token: its base64 does not hold JSON (was it copied whole?)",
        )
        self.assertRefused(_encoded([1, 2]), "not a trust token: expected a JSON object inside")
        self.assertRefused(_encoded(_body(secret=None)), "trust token: secret is missing")
        self.assertRefused(_encoded(_body(client_name=7)), "trust token: client_name is not text")
        self.assertRefused(_encoded(_body(client_name="")), "trust token: client_name is empty")
        self.assertRefused(
            _encoded(_body(fingerprint="AB" * 32)),
            "trust token: fingerprint is not 64 lower-case hex digits",
        )
        self.assertRefused(
            _encoded(_body(secret="xyz")), "trust token: secret is not hex of 16 to 64 bytes"
        )
        self.assertRefused(
            _encoded(_body(addresses="10.0.0.1:8443")),
            "trust token: addresses is not a list of host:port strings",
        )
        self.assertRefused(
            _encoded(_body(expires_at="tomorrow")),
            "trust token: expires_at 'tomorrow' is not a date and time",
        )
        self.assertRefused(
            _encoded(_body(expires_at="2026-11-28T17:00:00")),
            "trust token: expires_at '2026-11-28T17:00:00' has no time zone",
        )


class FingerprintTests(SynchronousTestCase):
    def test_opensslFormIsAccepted(self) -> None:
        colons = ":".join(["AB"] * 32)
        self.assertEqual(normalize_fingerprint(f"SHA256 Fingerprint={colons}"), "ab" * 32)
        self.assertEqual(normalize_fingerprint("AB" * 32), "ab" * 32)

    def test_otherTextIsRefused(self) -> None:
        error = self.assertRaises(TokenError, normalize_fingerprint, "abcd")
        self.assertEqual(
            str(error),
            "'abcd' is not a SHA-256 certificate fingerprint (64 hex digits, colons allowed)",
        )
