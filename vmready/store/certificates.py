"""Agent certificates: the fingerprint of the client certificate issued to each instance."""

from __future__ import annotations

from vmready.domain import InstanceRecord
from vmready.store.table import M, Table, operation


class AgentCertificates(Table[M]):
    """The ``agent_certificates`` table."""

    @operation
    def set_agent_certificate(self, name: str, fingerprint: str) -> None:
        """Record (or replace) the fingerprint of the client certificate issued to an instance."""
        with self._database.transaction():
            self._database.get_instance(name)
            self._database.db.execute(
                "INSERT INTO agent_certificates (instance, fingerprint, issued_at)"
                " VALUES (?, ?, ?)"
                " ON CONFLICT (instance) DO UPDATE SET"
                " fingerprint = excluded.fingerprint, issued_at = excluded.issued_at",
                (name, fingerprint, self._database.clock()),
            )
        self._database.record(lambda rows: rows.certified(name, fingerprint))

    @operation
    def instance_for_fingerprint(self, fingerprint: str) -> InstanceRecord | None:
        """The instance whose agent certificate has this fingerprint (None: unknown or revoked)."""
        row = self._database.db.execute(
            "SELECT instance FROM agent_certificates WHERE fingerprint = ?", (fingerprint,)
        ).fetchone()
        return None if row is None else self._database.find_instance(row[0])

    @operation
    def agent_fingerprints(self) -> dict[str, str]:
        """Every instance's agent certificate fingerprint, by instance name."""
        rows = self._database.db.execute("SELECT instance, fingerprint FROM agent_certificates")
        return {row[0]: row[1] for row in rows}
