"""The instance store: instances, their action history and snapshots, in SQLite or PostgreSQL.

``Store`` is the entry point (this module is named for its first engine):
``Store.open`` opens (creating or migrating) an SQLite file
(``store.schema``) or, given a ``postgresql://`` URL, a PostgreSQL database
(``store.pgschema``, ``store.postgres``) over one connection
(``store.database``), the same on both engines.  Its tables (``Tables``) are
one object per concern, each the only place its operations are written:
the instance rows (``.instances``, ``store.instances``), the agent
certificates (``.certificates``), the action history (``.actions``), the
snapshots (``.snapshots``), the cluster members and their events
(``.members``) and the remote API's trust store (``.trust``).  On a
``Store`` each call runs at once: ``store.instances.claim_task(...)``;
``store.asyncstore.AsyncStore`` has the same tables, each call a Deferred.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, ClassVar, Generic

from vmready.domain.members import MemberRecord, MembersView
from vmready.domain.model import ActionRecord, InstanceRecord
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.store import pgschema, schema
from vmready.store.actions import ActionHistory
from vmready.store.certificates import AgentCertificates
from vmready.store.database import Database, SQLiteDatabase
from vmready.store.instances import Instances
from vmready.store.members import Members
from vmready.store.postgres import PostgresDatabase, display_location, is_postgres_location
from vmready.store.snapshots import Snapshots
from vmready.store.table import Later, M, Sync
from vmready.store.trust import TrustTable

__all__ = ["Store", "Tables"]


class Tables(Generic[M]):
    """The store's tables over one database: each call at once (``Sync``) or queued (``Async``)."""

    def __init__(self, database: Database, member: str | None, later: Later | None) -> None:
        self.instances: Instances[M] = Instances(database, member, later)
        self.certificates: AgentCertificates[M] = AgentCertificates(database, member, later)
        self.actions: ActionHistory[M] = ActionHistory(database, member, later)
        self.snapshots: Snapshots[M] = Snapshots(database, member, later)
        self.members: Members[M] = Members(database, member, later)
        self.trust: TrustTable[M] = TrustTable(database, member, later)


class Store(Tables[Sync]):
    """vmready's store, on SQLite or PostgreSQL; open it with ``Store.open``."""

    SCHEMA_VERSION: ClassVar[int] = schema.SCHEMA_VERSION
    MIGRATIONS: ClassVar[list[tuple[int, str]]] = schema.MIGRATIONS
    POSTGRES_MIGRATIONS: ClassVar[list[tuple[int, str]]] = pgschema.MIGRATIONS

    def __init__(self, path: str, database: Database, schema_version: int) -> None:
        super().__init__(database, None, None)
        # Where the store is, as it may be shown: a file's path, or a URL without its password.
        self.path = path
        self.schema_version = schema_version
        # "sqlite" or "postgresql".
        self.engine_name = database.engine_name
        # Whether other daemons can hear of its changes (LISTEN/NOTIFY, store.notifications).
        self.notifies = database.NOTIFIES
        # The connection: transactions, batches (store.executor), what a call changed.
        self.database = database

    @classmethod
    def open(cls, location: str, clock: Callable[[], float] = time.time) -> Store:
        """Open (creating or migrating) the store, or raise StoreError with one line.

        ``location``: an SQLite file's path, or a ``postgresql://`` (``postgres://``)
        URL.  ``clock`` stamps rows; on PostgreSQL leases take the server's clock.
        """
        if is_postgres_location(location):
            pool, version = pgschema.connect(
                location, clock, cls.POSTGRES_MIGRATIONS, cls.SCHEMA_VERSION
            )
            return cls(display_location(location), PostgresDatabase(pool, clock), version)
        connection, version = schema.connect(location, clock, cls.MIGRATIONS, cls.SCHEMA_VERSION)
        return cls(location, SQLiteDatabase(connection, clock), version)

    def close(self) -> None:
        """Close the database connection."""
        self.database.close()

    # Former pass-throughs, until their callers call the tables

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """Run many calls in one transaction (the database thread's batches)."""
        return self.database.batch()

    def create_instance(
        self,
        name: str,
        config: dict[str, str],
        devices: dict[str, dict[str, str]],
        instance_uuid: str | None = None,
        member: str | None = None,
    ) -> InstanceRecord:
        """Add an instance, building with a spawning task; Conflict if the name is taken."""
        return self.instances.create_instance(name, config, devices, instance_uuid, member)

    def get_instance(self, name: str) -> InstanceRecord:
        """The instance called name, or NotFound."""
        return self.instances.get_instance(name)

    def find_instance(self, name: str) -> InstanceRecord | None:
        """The instance called name, or None."""
        return self.instances.find_instance(name)

    def list_instances(self) -> list[InstanceRecord]:
        """Every instance, ordered by name."""
        return self.instances.list_instances()

    def claim_task(
        self, name: str, action: str, allowed_from: frozenset[VMState], task: TaskState
    ) -> InstanceRecord:
        """Start task if there is none and vm_state is in allowed_from; else the 409 saying why."""
        return self.instances.claim_task(name, action, allowed_from, task)

    def advance_task(self, name: str, expected: TaskState, task: TaskState) -> InstanceRecord:
        """Move from task_state expected to task; Conflict if the instance is not in expected."""
        return self.instances.advance_task(name, expected, task)

    def finish_task(
        self,
        name: str,
        expected: TaskState,
        vm_state: VMState,
        power_state: PowerState | None = None,
        config_updates: dict[str, str | None] | None = None,
    ) -> InstanceRecord:
        """End task expected: rest in vm_state, optionally set power_state and config; atomic."""
        return self.instances.finish_task(name, expected, vm_state, power_state, config_updates)

    def set_error(
        self, name: str, reason: str, power_state: PowerState | None = None
    ) -> InstanceRecord:
        """Put the instance in vm_state error with reason, ending any task."""
        return self.instances.set_error(name, reason, power_state)

    def set_power_state(self, name: str, power_state: PowerState) -> InstanceRecord:
        """Record what the hypervisor reports; an unchanged power state writes nothing."""
        return self.instances.set_power_state(name, power_state)

    def update_config(self, name: str, updates: dict[str, str | None]) -> InstanceRecord:
        """Set config keys (None deletes the key) in one read-modify-write transaction."""
        return self.instances.update_config(name, updates)

    def settle(
        self,
        name: str,
        allowed_from: frozenset[VMState],
        vm_state: VMState,
        power_state: PowerState,
        config_updates: dict[str, str | None] | None = None,
    ) -> InstanceRecord | None:
        """Move an idle instance to ``vm_state`` without an action (a VM exited, the poller)."""
        return self.instances.settle(name, allowed_from, vm_state, power_state, config_updates)

    def clear_ready_everywhere(self, member: str | None = None) -> int:
        """Remove the ready key from every instance (of ``member``, or all); how many had it."""
        return self.instances.clear_ready_everywhere(member)

    def rename_instance(
        self, name: str, new_name: str, allowed_from: frozenset[VMState], request_id: str
    ) -> InstanceRecord:
        """Call an idle instance ``new_name``, with its snapshots and certificate; atomic."""
        return self.instances.rename_instance(name, new_name, allowed_from, request_id)

    def delete_instance(self, name: str) -> None:
        """Remove the instance and its snapshots; its action history stays."""
        self.instances.delete_instance(name)

    # Members

    def renew_lease(
        self, name: str, address: str, fingerprint: str, lease_seconds: float
    ) -> float:
        """Join as member ``name`` (``LeaseHeld``: another daemon holds it); when it runs out."""
        return self.members.renew_lease(name, address, fingerprint, lease_seconds)

    def check_join(self, name: str, fingerprint: str) -> None:
        """``LeaseHeld`` if joining as member ``name`` would be refused now."""
        self.members.check_join(name, fingerprint)

    def renew_held_lease(
        self, name: str, address: str, fingerprint: str, lease_seconds: float
    ) -> float:
        """Renew the lease this daemon holds (``LeaseLost``: it does not); when it runs out."""
        return self.members.renew_held_lease(name, address, fingerprint, lease_seconds)

    def give_up_lease(self, name: str, fingerprint: str) -> None:
        """Member ``name`` stops cleanly: its lease ends now (if ``fingerprint`` holds it)."""
        self.members.give_up_lease(name, fingerprint)

    def list_members(self) -> MembersView:
        """Every member and its instance count, read at one moment of the store's clock."""
        return self.members.list_members()

    def remove_member(self, name: str) -> MemberRecord:
        """Retire member ``name`` (not while online or stamped on instances); its record."""
        return self.members.remove_member(name)

    # Notifications

    def publish_event(self, payload: str) -> None:
        """Tell every member listening on ``vmready_events`` (at commit); PostgreSQL only.

        ValueError for a payload PostgreSQL would refuse (7,900 bytes and over);
        NotImplementedError on SQLite, whose store has one daemon: nobody to tell.
        """
        self.members.publish_event(payload)

    # Agent certificates

    def set_agent_certificate(self, name: str, fingerprint: str) -> None:
        """Record (or replace) the fingerprint of the client certificate issued to an instance."""
        self.certificates.set_agent_certificate(name, fingerprint)

    def instance_for_fingerprint(self, fingerprint: str) -> InstanceRecord | None:
        """The instance whose agent certificate has this fingerprint (None: unknown or revoked)."""
        return self.certificates.instance_for_fingerprint(fingerprint)

    def agent_fingerprints(self) -> dict[str, str]:
        """Every instance's agent certificate fingerprint, by instance name."""
        return self.certificates.agent_fingerprints()

    # Action history

    def start_action(self, name: str, action: str, request_id: str) -> int:
        """Record the start of an action on instance name; return its id."""
        return self.actions.start_action(name, action, request_id)

    def start_step(self, action_id: int, step: str) -> int:
        """Record the start of a step of an action; return its id."""
        return self.actions.start_step(action_id, step)

    def finish_step(self, step_id: int, result: str, error: str | None = None) -> None:
        """Record how a step ended ("success" or "error")."""
        self.actions.finish_step(step_id, result, error)

    def add_step(self, action_id: int, step: str, result: str, error: str | None = None) -> None:
        """Record a step that started and ended at once."""
        self.actions.add_step(action_id, step, result, error)

    def finish_action(self, action_id: int, result: str, error: str | None = None) -> None:
        """Record how an action ended ("success" or "error")."""
        self.actions.finish_action(action_id, result, error)

    def list_actions(self, name: str) -> list[ActionRecord]:
        """The action history of instance name (kept after delete), newest first."""
        return self.actions.list_actions(name)

    def unfinished_actions(self, member: str | None = None) -> list[ActionRecord]:
        """Actions that never finished (of ``member``'s instances, or all), oldest first."""
        return self.actions.unfinished_actions(member)

    # Snapshots

    def create_snapshot(
        self, instance: str, name: str, stateful: bool, metadata: dict[str, Any]
    ) -> dict[str, Any]:
        """Record a snapshot of instance; Conflict if the instance already has one called name."""
        return self.snapshots.create_snapshot(instance, name, stateful, metadata)

    def delete_snapshot(self, instance: str, name: str) -> dict[str, Any]:
        """Forget snapshot ``name`` of instance and return its row; NotFound if it has none."""
        return self.snapshots.delete_snapshot(instance, name)

    def find_snapshot(self, instance: str, name: str) -> dict[str, Any] | None:
        """Snapshot ``name`` of instance, or None."""
        return self.snapshots.find_snapshot(instance, name)

    def list_snapshots(self, instance: str) -> list[dict[str, Any]]:
        """The snapshots of instance, oldest first; NotFound if there is no such instance."""
        return self.snapshots.list_snapshots(instance)
