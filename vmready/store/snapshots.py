"""Snapshot rows: which snapshots each instance has, with their metadata."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vmready.domain import Conflict, NotFound
from vmready.store.database import dump
from vmready.store.table import M, Table, operation


class Snapshots(Table[M]):
    """The ``snapshots`` table."""

    @operation
    def create_snapshot(
        self, instance: str, name: str, stateful: bool, metadata: dict[str, Any]
    ) -> dict[str, Any]:
        """Record a snapshot of instance; Conflict if the instance already has one called name."""
        encoded = dump(metadata)
        with self._database.transaction():
            self._database.get_instance(instance)
            taken = self._database.db.execute(
                "SELECT 1 FROM snapshots WHERE instance = ? AND name = ?", (instance, name)
            ).fetchone()
            if taken is not None:
                raise Conflict(f"Snapshot {name} of instance {instance} already exists")
            try:
                self._database.db.execute(
                    "INSERT INTO snapshots (instance, name, stateful, created_at, metadata)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (instance, name, int(stateful), self._database.clock(), encoded),
                )
            except self._database.integrity_errors:
                # Taken by a writer that committed since we looked (PostgreSQL).
                raise Conflict(f"Snapshot {name} of instance {instance} already exists") from None
            row = self._database.db.execute(
                "SELECT instance, name, stateful, created_at, metadata FROM snapshots"
                " WHERE instance = ? AND name = ?",
                (instance, name),
            ).fetchone()
        return _snapshot(row)

    @operation
    def delete_snapshot(self, instance: str, name: str) -> dict[str, Any]:
        """Forget snapshot ``name`` of instance and return its row; NotFound if it has none."""
        with self._database.transaction():
            self._database.get_instance(instance)
            found = self.find_snapshot(instance, name)
            if found is None:
                raise NotFound(f"Snapshot {name} of instance {instance} not found")
            self._database.db.execute(
                "DELETE FROM snapshots WHERE instance = ? AND name = ?", (instance, name)
            )
        return found

    @operation
    def find_snapshot(self, instance: str, name: str) -> dict[str, Any] | None:
        """Snapshot ``name`` of instance, or None."""
        row = self._database.db.execute(
            "SELECT instance, name, stateful, created_at, metadata FROM snapshots"
            " WHERE instance = ? AND name = ?",
            (instance, name),
        ).fetchone()
        return None if row is None else _snapshot(row)

    @operation
    def list_snapshots(self, instance: str) -> list[dict[str, Any]]:
        """The snapshots of instance, oldest first; NotFound if there is no such instance."""
        with self._database.transaction(immediate=False):
            self._database.get_instance(instance)
            rows = self._database.db.execute(
                "SELECT instance, name, stateful, created_at, metadata FROM snapshots"
                " WHERE instance = ? ORDER BY created_at, id",
                (instance,),
            ).fetchall()
        return [_snapshot(row) for row in rows]


def _snapshot(row: Sequence[Any]) -> dict[str, Any]:
    """A row of (instance, name, stateful, created_at, metadata)."""
    instance, name, stateful, created_at, metadata = row
    return {
        "instance": instance,
        "name": name,
        "stateful": bool(stateful),
        "created_at": created_at,
        "metadata": json.loads(metadata),
    }
