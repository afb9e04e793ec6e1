"""Fuzz target for trust tokens: the text a remote client hands over to be trusted.

A token reaches the daemon in ``POST /1.0/certificates {"trust_token": …}``
from a client it does not trust yet, and the CLI's ``remote add --token``
reads one pasted by an operator; both read it with ``TrustToken.decode``.
"""

from __future__ import annotations

import base64
import datetime
import json
from typing import Any

from hypothesis import strategies as st

from tests.fuzzing.target import FuzzTarget
from tests.fuzzing.web_mutations import edited, json_edited
from tests.fuzzing.wire_mutations import deep_json, noise
from vmready.trust.tokens import TokenError, TrustToken

_VALID = TrustToken(
    "laptop",
    "ab" * 32,
    ("vmready.example:8443", "[2001:db8::1]:8443"),
    "0f" * 32,
    datetime.datetime(2026, 11, 28, 17, 13, 57, tzinfo=datetime.UTC),
)
_VALID_BODY = json.loads(base64.b64decode(_VALID.encode()))


def _as_token(value: Any) -> str:
    """A JSON value as a token's text (base64 of its JSON), as a client would send it."""
    raw = json.dumps(value).encode("utf-8", "surrogatepass")
    return base64.b64encode(raw).decode("ascii")


def _wrapped(text: str) -> str:
    """A token as a mail or terminal may wrap it: lines of 60, indented."""
    return " \n".join(text[i : i + 60] for i in range(0, len(text), 60))


def _from_bytes(raw: bytes) -> str:
    return raw.decode("latin-1")


_TOKENS: st.SearchStrategy[str] = st.one_of(
    # Edits of a valid token's text: cut, doubled, a byte changed, whitespace, URL-safe.
    edited(st.just(_VALID.encode().encode("ascii"))).map(_from_bytes),
    st.just(_VALID.encode()).map(lambda text: text.replace("+", "-").replace("/", "_")),
    st.just(_VALID.encode()).map(_wrapped),
    # Valid base64 of a damaged body: wrong types, missing keys, odd dates and addresses.
    json_edited(st.just(_VALID_BODY)).map(_as_token),
    st.builds(
        lambda key, value: _as_token({**_VALID_BODY, key: value}),
        st.sampled_from(sorted(_VALID_BODY)),
        st.one_of(
            st.text(max_size=80),
            st.integers(),
            st.none(),
            st.lists(st.text(max_size=20), max_size=3),
            st.sampled_from(
                ["2026-13-01T00:00:00Z", "2026-11-28T17:13:57", "9999-12-31T23:59:59+14:00", "Z"]
            ),
        ),
    ),
    st.integers(1, 5000).map(lambda depth: base64.b64encode(deep_json(depth)).decode()),
    noise().map(_from_bytes),
    st.text(max_size=200),
)


def check_trust_token(text: str) -> None:
    """A token, every field as documented, read back the same; or TokenError, in one line."""
    try:
        token = TrustToken.decode(text)
    except TokenError as e:
        message = str(e)
        assert message and "\n" not in message, message
        return
    assert token.client_name, token
    assert len(token.fingerprint) == 64 and token.fingerprint == token.fingerprint.lower(), token
    assert all(isinstance(address, str) for address in token.addresses), token
    assert token.expires_at.tzinfo is not None, token
    again = TrustToken.decode(token.encode())
    assert again.encode() == token.encode(), (token, again)


TARGETS = [
    FuzzTarget(
        name="trust-token",
        description=(
            "TrustToken.decode: the token a remote client sends to POST /1.0/certificates "
            "and an operator pastes into remote add --token"
        ),
        inputs=_TOKENS,
        check=check_trust_token,
    ),
]
