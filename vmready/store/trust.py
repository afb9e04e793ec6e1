"""The remote operator API's trust store: trusted client certificates and pending tokens.

A client certificate is trusted by its SHA-256 fingerprint, under a name the
operator chose (``vmready config trust add NAME``); names are unique, so
either identifies one entry.  A token is kept as its secret's SHA-256 until it
is redeemed (deleted as it adds its certificate, in one transaction: a token
works once) or expires (expired ones are swept whenever a token is issued).
"""

from __future__ import annotations

import attrs

from vmready.domain import Conflict, Forbidden, NotFound
from vmready.store.table import M, Table, operation


@attrs.frozen
class TrustedCertificate:
    """One trusted client certificate."""

    name: str
    fingerprint: str
    added_at: float


class TrustTable(Table[M]):
    """The ``trusted_certificates`` and ``trust_tokens`` tables."""

    @operation
    def trusted_certificates(self) -> list[TrustedCertificate]:
        """Every trusted certificate, by name."""
        rows = self._database.db.execute(
            "SELECT name, fingerprint, added_at FROM trusted_certificates ORDER BY name"
        )
        return [TrustedCertificate(row[0], row[1], row[2]) for row in rows]

    @operation
    def add_token(self, name: str, secret_hash: str, now: float, expires_at: float) -> None:
        """Remember a new token for ``name``; Conflict if the name is trusted or promised."""
        with self._database.transaction():
            db = self._database.db
            db.execute("DELETE FROM trust_tokens WHERE expires_at <= ?", (now,))
            if db.execute("SELECT 1 FROM trusted_certificates WHERE name = ?", (name,)).fetchone():
                raise Conflict(f"a certificate named {name} is trusted already")
            if db.execute("SELECT 1 FROM trust_tokens WHERE name = ?", (name,)).fetchone():
                raise Conflict(f"a trust token for {name} is pending already")
            db.execute(
                "INSERT INTO trust_tokens (secret_hash, name, created_at, expires_at)"
                " VALUES (?, ?, ?, ?)",
                (secret_hash, name, now, expires_at),
            )

    @operation
    def redeem_token(self, secret_hash: str, fingerprint: str, now: float) -> TrustedCertificate:
        """Trust ``fingerprint`` under the token's name and delete the token.

        Forbidden for a token that is unknown (never issued, used, revoked) or
        expired; a certificate trusted already keeps its entry (the token stays).
        """
        with self._database.transaction():
            db = self._database.db
            known = db.execute(
                "SELECT name, fingerprint, added_at FROM trusted_certificates"
                " WHERE fingerprint = ?",
                (fingerprint,),
            ).fetchone()
            if known is not None:
                return TrustedCertificate(known[0], known[1], known[2])
            # Locked: of two redeeming the same token at once, the second finds it gone.
            row = db.execute(
                "SELECT name, expires_at FROM trust_tokens WHERE secret_hash = ?"
                f"{self._database.LOCK_ROWS}",
                (secret_hash,),
            ).fetchone()
            if row is None:
                raise Forbidden(
                    "the trust token is unknown: used already, revoked or never issued"
                )
            name, expires_at = row
            db.execute("DELETE FROM trust_tokens WHERE secret_hash = ?", (secret_hash,))
            if expires_at <= now:
                raise Forbidden(f"the trust token for {name} has expired")
            db.execute(
                "INSERT INTO trusted_certificates (fingerprint, name, added_at) VALUES (?, ?, ?)",
                (fingerprint, name, now),
            )
            return TrustedCertificate(name, fingerprint, now)

    @operation
    def remove_certificate(self, fingerprint: str) -> TrustedCertificate:
        """Stop trusting ``fingerprint``; NotFound if it is not trusted."""
        with self._database.transaction():
            db = self._database.db
            row = db.execute(
                "SELECT name, fingerprint, added_at FROM trusted_certificates"
                " WHERE fingerprint = ?",
                (fingerprint,),
            ).fetchone()
            if row is None:
                raise NotFound(f"no trusted certificate has fingerprint {fingerprint}")
            db.execute("DELETE FROM trusted_certificates WHERE fingerprint = ?", (fingerprint,))
            return TrustedCertificate(row[0], row[1], row[2])
