"""The instance reads the reactor makes without waiting: ``AsyncStore.view``.

``CommittedInstances`` (a daemon's store, on its database thread) holds every
instance row as of the last commit, in memory: the store tells it each
committed call's changes (``database.InstanceRows``), in commit order.
``LiveInstances`` (a store run inline: replays, unit tests) reads the engine
itself, which is the same thing there.  Both answer as one cluster member
sees the store: ``owned_instances``, ``owns`` and the agent certificate
lookup take only the instances that member runs.
"""

from __future__ import annotations

import abc
from typing import Protocol

from vmready.domain import READY_KEY, InstanceRecord
from vmready.store.database import instance_not_found
from vmready.store.sqlite import Store


class AgentLookup(Protocol):
    """Which instance an agent certificate was issued to: a view, or a Store's certificates."""

    def instance_for_fingerprint(self, fingerprint: str) -> InstanceRecord | None:
        """The instance whose agent certificate has this fingerprint (None: unknown or revoked)."""


class InstanceView(abc.ABC):
    """The instance rows as one cluster member reads them on the reactor thread, at once."""

    def __init__(self, member: str | None) -> None:
        # The cluster member this daemon is (None: the store's only daemon, on one host).
        self.member = member

    @abc.abstractmethod
    def get_instance(self, name: str) -> InstanceRecord:
        """The instance called name, or NotFound."""

    @abc.abstractmethod
    def find_instance(self, name: str) -> InstanceRecord | None:
        """The instance called name, or None."""

    @abc.abstractmethod
    def list_instances(self) -> list[InstanceRecord]:
        """Every instance (of every member), ordered by name."""

    @abc.abstractmethod
    def _certified_instance(self, fingerprint: str) -> InstanceRecord | None:
        """The instance (of any member) whose agent certificate has this fingerprint."""

    def owned_instances(self) -> list[InstanceRecord]:
        """The instances this daemon runs, ordered by name (all of them on a single host)."""
        instances = self.list_instances()
        if self.member is None:
            return instances
        return [record for record in instances if record.member == self.member]

    def owns(self, record: InstanceRecord) -> bool:
        """Whether this daemon runs the instance (always, on a single host)."""
        return self.member is None or record.member == self.member

    def instance_for_fingerprint(self, fingerprint: str) -> InstanceRecord | None:
        """The instance whose agent certificate has this fingerprint (None: unknown or revoked).

        Synchronous: TLS asks it during a handshake.  Only an instance this
        daemon runs: the guest API on one member's host never takes the agent
        of an instance another member runs.
        """
        record = self._certified_instance(fingerprint)
        return record if record is not None and self.owns(record) else None


class LiveInstances(InstanceView):
    """The engine's rows, read at once (where its calls run inline: every one has happened)."""

    def __init__(self, engine: Store, member: str | None) -> None:
        super().__init__(member)
        self._engine = engine

    def get_instance(self, name: str) -> InstanceRecord:
        return self._engine.instances.get_instance(name)

    def find_instance(self, name: str) -> InstanceRecord | None:
        return self._engine.instances.find_instance(name)

    def list_instances(self) -> list[InstanceRecord]:
        return self._engine.instances.list_instances()

    def _certified_instance(self, fingerprint: str) -> InstanceRecord | None:
        return self._engine.certificates.instance_for_fingerprint(fingerprint)


class CommittedInstances(InstanceView):
    """Every instance row as of the last commit, in memory, read on the reactor thread."""

    def __init__(
        self, records: list[InstanceRecord], fingerprints: dict[str, str], member: str | None
    ) -> None:
        super().__init__(member)
        self.replace(records, fingerprints)

    def get_instance(self, name: str) -> InstanceRecord:
        record = self._records.get(name)
        if record is None:
            raise instance_not_found(name)
        return record

    def find_instance(self, name: str) -> InstanceRecord | None:
        return self._records.get(name)

    def list_instances(self) -> list[InstanceRecord]:
        return [self._records[name] for name in sorted(self._records)]

    def _certified_instance(self, fingerprint: str) -> InstanceRecord | None:
        name = self._instance_of.get(fingerprint)
        return None if name is None else self._records.get(name)

    def replace(self, records: list[InstanceRecord], fingerprints: dict[str, str]) -> None:
        """Every row as read again (at first, and after changes may have been missed)."""
        self._records = {record.name: record for record in records}
        # The agent certificate of each instance, and the other way round.
        self._fingerprint_of = dict(fingerprints)
        self._instance_of = {fingerprint: name for name, fingerprint in fingerprints.items()}

    # What a committed call changed (database.InstanceRows):

    def committed(self, record: InstanceRecord) -> None:
        self._records[record.name] = record

    def removed(self, name: str) -> None:
        self._records.pop(name, None)
        self._instance_of.pop(self._fingerprint_of.pop(name, ""), None)

    def renamed(self, old_name: str, record: InstanceRecord) -> None:
        self._records.pop(old_name, None)
        self._records[record.name] = record
        fingerprint = self._fingerprint_of.pop(old_name, None)
        if fingerprint is not None:
            self._fingerprint_of[record.name] = fingerprint
            self._instance_of[fingerprint] = record.name

    def certified(self, name: str, fingerprint: str) -> None:
        self._instance_of.pop(self._fingerprint_of.get(name, ""), None)
        self._fingerprint_of[name] = fingerprint
        self._instance_of[fingerprint] = name

    def ready_cleared(self, names: list[str], stamp: float) -> None:
        for name in names:
            record = self._records[name]
            config = {key: value for key, value in record.config.items() if key != READY_KEY}
            # Built directly, not with attrs.evolve: thousands of them before the API serves.
            self._records[name] = InstanceRecord(
                record.name,
                record.uuid,
                record.vm_state,
                record.task_state,
                record.power_state,
                config,
                record.devices,
                record.created_at,
                stamp,
                record.error,
                record.member,
            )
