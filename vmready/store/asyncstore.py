"""The store as the daemon uses it: every call a Deferred, run by the engine's executor.

``AsyncStore`` has the methods of the engine (``store.sqlite.Store``, on
SQLite or PostgreSQL), each returning a Deferred that fires, on the reactor
thread, once the call ran and its transaction committed.  The engine runs on
an ``Executor``: the daemon's ``DatabaseThread`` (one thread, in order, queued
calls committed together; on PostgreSQL its connection comes from a pool) or
``InlineExecutor`` (at once, for replays and unit tests); the layers above see
only this class, whichever the engine.

Whoever announces a state (an event, a response) waits for the Deferred of the
write that made it first: nothing is announced that the store could lose.

Instance reads (``get_instance``, ``find_instance``, ``list_instances``) are
synchronous and never touch the disk: on a database thread they read
``CommittedInstances``, the rows as of the last commit, kept up to date by each
write's result as its Deferred fires (in commit order), so whoever awaited a
write reads it back, and nobody reads a state that is not committed.  A write
the disk refused (``executor.StoreWriteFailed``) changes nothing they read.  Inline,
they read the engine itself, which is the same thing there.

A write whose outcome is unknown (``executor.OutcomeUnknown``: PostgreSQL's
connection lost during COMMIT) may have committed although its Deferred
failed: the view is then ``stale``, and every row is read again
(``reload_instances``) as the next call in line; while the store does not
answer, that read fails and is asked again, until the view shows what really
committed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorThreads
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain.members import MemberRecord, MembersView
from vmready.domain.model import ActionRecord, InstanceRecord
from vmready.domain.states import READY_KEY, PowerState, TaskState, VMState
from vmready.store.database import instance_not_found
from vmready.store.executor import (
    DatabaseThread,
    Executor,
    InlineExecutor,
    OutcomeUnknown,
    StoreHealth,
    StoreWriteFailed,
)
from vmready.store.sqlite import Store, check_payload

__all__ = ["AsyncStore"]

T = TypeVar("T")

_log = Logger()


class InstanceView(Protocol):
    """The instance reads the reactor makes without waiting."""

    def get_instance(self, name: str) -> InstanceRecord: ...

    def find_instance(self, name: str) -> InstanceRecord | None: ...

    def list_instances(self) -> list[InstanceRecord]: ...

    def instance_for_fingerprint(self, fingerprint: str) -> InstanceRecord | None: ...


class CommittedInstances:
    """Every instance row as of the last commit, in memory, read on the reactor thread."""

    def __init__(self, records: list[InstanceRecord], fingerprints: dict[str, str]) -> None:
        self._records = {record.name: record for record in records}
        # The agent certificate of each instance, and the other way round.
        self._fingerprint_of = dict(fingerprints)
        self._instance_of = {fingerprint: name for name, fingerprint in fingerprints.items()}

    def instance_for_fingerprint(self, fingerprint: str) -> InstanceRecord | None:
        name = self._instance_of.get(fingerprint)
        return None if name is None else self._records.get(name)

    def certified(self, name: str, fingerprint: str) -> None:
        """The instance's agent now has this certificate (and no other)."""
        self._instance_of.pop(self._fingerprint_of.get(name, ""), None)
        self._fingerprint_of[name] = fingerprint
        self._instance_of[fingerprint] = name

    def get_instance(self, name: str) -> InstanceRecord:
        record = self._records.get(name)
        if record is None:
            raise instance_not_found(name)
        return record

    def find_instance(self, name: str) -> InstanceRecord | None:
        return self._records.get(name)

    def list_instances(self) -> list[InstanceRecord]:
        return [self._records[name] for name in sorted(self._records)]

    def committed(self, record: InstanceRecord) -> InstanceRecord:
        """A write's result: the row as it now stands."""
        self._records[record.name] = record
        return record

    def committed_maybe(self, record: InstanceRecord | None) -> InstanceRecord | None:
        """A write that may have changed nothing (None)."""
        return None if record is None else self.committed(record)

    def removed(self, name: str) -> None:
        """The row is gone (and its agent certificate with it)."""
        self._records.pop(name, None)
        self._instance_of.pop(self._fingerprint_of.pop(name, ""), None)

    def renamed(self, old_name: str, record: InstanceRecord) -> InstanceRecord:
        """The row called ``old_name`` is now ``record`` (its certificate moved with it)."""
        self._records.pop(old_name, None)
        self._records[record.name] = record
        fingerprint = self._fingerprint_of.pop(old_name, None)
        if fingerprint is not None:
            self._fingerprint_of[record.name] = fingerprint
            self._instance_of[fingerprint] = record.name
        return record

    def replace(self, records: list[InstanceRecord], fingerprints: dict[str, str]) -> None:
        """Every row as read again (after notifications may have been missed)."""
        self._records = {record.name: record for record in records}
        self._fingerprint_of = dict(fingerprints)
        self._instance_of = {fingerprint: name for name, fingerprint in fingerprints.items()}

    def ready_cleared(self, names: list[str], stamp: float) -> None:
        """These rows lost their ready key at ``stamp`` (what ``clear_ready`` wrote)."""
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


def _copied(updates: dict[str, str | None] | None) -> dict[str, str | None] | None:
    """A caller's dict, copied: the engine reads it later, on its own thread."""
    return None if updates is None else dict(updates)


class AsyncStore:
    """The store's calls as Deferreds, run in order by one executor."""

    def __init__(
        self, engine: Store, executor: Executor, cached: bool, member: str | None = None
    ) -> None:
        # Touch the engine directly only where the executor runs inline (tests, replays).
        self.engine = engine
        # The cluster member this daemon is (None: the store's only daemon, on one host).
        self.member = member
        self._executor = executor
        self._cache = (
            CommittedInstances(engine.list_instances(), engine.agent_fingerprints())
            if cached
            else None
        )
        self._view: InstanceView = self._cache if self._cache is not None else engine
        # An outcome was unknown: the view may lack a write that committed, until reloaded.
        self._stale = False

    @classmethod
    def inline(cls, engine: Store) -> AsyncStore:
        """Calls run at once on the caller's thread (replays, unit tests)."""
        return cls(engine, InlineExecutor(), cached=False)

    @classmethod
    def threaded(
        cls, reactor: IReactorThreads, engine: Store, member: str | None = None
    ) -> AsyncStore:
        """Calls run on one database thread of their own (the daemon)."""
        return cls(engine, DatabaseThread(reactor, engine), cached=True, member=member)

    @property
    def executor(self) -> Executor:
        """What runs the engine's calls."""
        return self._executor

    @property
    def stale(self) -> bool:
        """Whether instance reads may miss a committed write (an outcome unknown, not reread)."""
        return self._stale

    def _submit(self, work: Callable[[], T]) -> Deferred[T]:
        """Every call goes to the executor here: an unknown outcome makes the view reread."""
        done = self._executor.submit(work)
        if self._cache is not None:
            done.addErrback(self._watch_outcome)
        return done

    def _watch_outcome(self, failure: Failure) -> Failure:
        """On the reactor thread, as a call fails: after an unknown outcome, reread every row."""
        if failure.check(OutcomeUnknown) and not self._stale:
            self._stale = True
            self._reread()
        return failure

    def _reread(self) -> None:
        """Reload the view; while the store does not answer, ask again (until it is closed)."""

        def reread(_: None) -> None:
            self._stale = False

        def failed(failure: Failure) -> None:
            if failure.check(StoreWriteFailed):
                self._reread()  # tried for retry_for already: go to the back of the line
            elif not failure.check(RuntimeError):  # RuntimeError: the store is closed
                _log.failure("cannot read the store again after an unknown outcome", failure)

        self._reload().addCallbacks(reread, failed)

    @property
    def health(self) -> StoreHealth:
        """Whether writes succeed: since when they fail and why (announced as it changes)."""
        return self._executor.health

    def _write(self, work: Callable[[], InstanceRecord]) -> Deferred[InstanceRecord]:
        """An instance write; once committed, what instance reads see."""
        done = self._submit(work)
        if self._cache is not None:
            done.addCallback(self._cache.committed)
        return done

    def _write_maybe(
        self, work: Callable[[], InstanceRecord | None]
    ) -> Deferred[InstanceRecord | None]:
        """An instance write that may change nothing (None)."""
        done = self._submit(work)
        if self._cache is not None:
            done.addCallback(self._cache.committed_maybe)
        return done

    @property
    def path(self) -> str:
        """Where the engine keeps the store (a URL without its password)."""
        return self.engine.path

    @property
    def engine_name(self) -> str:
        """ "sqlite" or "postgresql"."""
        return self.engine.engine_name

    @property
    def notifies(self) -> bool:
        """Whether other members hear of this store's changes (PostgreSQL)."""
        return self.engine.notifies

    def publish_event(self, payload: str) -> Deferred[None]:
        """NOTIFY ``vmready_events`` with payload; fires once committed (sent then).

        ValueError above 7,900 bytes (PostgreSQL refuses 8,000);
        NotImplementedError on SQLite (a single host: nobody to tell).
        """
        if not self.engine.notifies:
            raise NotImplementedError(f"the {self.engine.engine_name} store has no other members")
        check_payload(payload)
        return self._submit(lambda: self.engine.publish_event(payload))

    def reload_instances(self) -> Deferred[None]:
        """Read every row and agent fingerprint again into what instance reads see.

        After the notification listener reconnected: changes by other members
        while it was away were not heard of.
        """
        return self._reload()

    def _reload(self) -> Deferred[None]:
        engine = self.engine
        done = self._executor.submit(
            lambda: (engine.list_instances(), engine.agent_fingerprints())
        )
        cache = self._cache

        def reloaded(rows: tuple[list[InstanceRecord], dict[str, str]]) -> None:
            if cache is not None:
                cache.replace(*rows)

        return done.addCallback(reloaded)

    def run(self, work: Callable[[Store], T]) -> Deferred[T]:
        """Any engine work, in order with every other call (e.g. a bulk read)."""
        return self._submit(lambda: work(self.engine))

    async def close(self) -> None:
        """Run what is queued, then close the engine."""
        await self._executor.stop()
        self.engine.close()

    def create_instance(
        self,
        name: str,
        config: dict[str, str],
        devices: dict[str, dict[str, str]],
        instance_uuid: str | None = None,
    ) -> Deferred[InstanceRecord]:
        """Add an instance run by this member, building with a spawning task; Conflict if taken."""
        config, devices = dict(config), {key: dict(value) for key, value in devices.items()}
        member = self.member or ""
        return self._write(
            lambda: self.engine.create_instance(name, config, devices, instance_uuid, member)
        )

    def get_instance(self, name: str) -> InstanceRecord:
        """The instance called name, or NotFound."""
        return self._view.get_instance(name)

    def find_instance(self, name: str) -> InstanceRecord | None:
        """The instance called name, or None."""
        return self._view.find_instance(name)

    def list_instances(self) -> list[InstanceRecord]:
        """Every instance (of every member), ordered by name."""
        return self._view.list_instances()

    def owned_instances(self) -> list[InstanceRecord]:
        """The instances this daemon runs, ordered by name (all of them on a single host)."""
        instances = self._view.list_instances()
        if self.member is None:
            return instances
        return [record for record in instances if record.member == self.member]

    def owns(self, record: InstanceRecord) -> bool:
        """Whether this daemon runs the instance (always, on a single host)."""
        return self.member is None or record.member == self.member

    def claim_task(
        self, name: str, action: str, allowed_from: frozenset[VMState], task: TaskState
    ) -> Deferred[InstanceRecord]:
        """Start task if there is none and vm_state is in allowed_from; else the 409 saying why."""
        return self._write(lambda: self.engine.claim_task(name, action, allowed_from, task))

    def advance_task(
        self, name: str, expected: TaskState, task: TaskState
    ) -> Deferred[InstanceRecord]:
        """Move from task_state expected to task; Conflict if the instance is not in expected."""
        return self._write(lambda: self.engine.advance_task(name, expected, task))

    def finish_task(
        self,
        name: str,
        expected: TaskState,
        vm_state: VMState,
        power_state: PowerState | None = None,
        config_updates: dict[str, str | None] | None = None,
    ) -> Deferred[InstanceRecord]:
        """End task expected: rest in vm_state, optionally set power_state and config; atomic."""
        config_updates = _copied(config_updates)
        return self._write(
            lambda: self.engine.finish_task(name, expected, vm_state, power_state, config_updates)
        )

    def set_error(
        self, name: str, reason: str, power_state: PowerState | None = None
    ) -> Deferred[InstanceRecord]:
        """Put the instance in vm_state error with reason, ending any task."""
        return self._write(lambda: self.engine.set_error(name, reason, power_state))

    def set_power_state(self, name: str, power_state: PowerState) -> Deferred[InstanceRecord]:
        """Record what the hypervisor reports; an unchanged power state writes nothing."""
        return self._write(lambda: self.engine.set_power_state(name, power_state))

    def update_config(self, name: str, updates: dict[str, str | None]) -> Deferred[InstanceRecord]:
        """Set config keys (None deletes the key) in one read-modify-write transaction."""
        updates = dict(updates)
        return self._write(lambda: self.engine.update_config(name, updates))

    def settle(
        self,
        name: str,
        allowed_from: frozenset[VMState],
        vm_state: VMState,
        power_state: PowerState,
        config_updates: dict[str, str | None] | None = None,
    ) -> Deferred[InstanceRecord | None]:
        """Move an idle instance to ``vm_state`` without an action (a VM exited, the poller)."""
        config_updates = _copied(config_updates)
        return self._write_maybe(
            lambda: self.engine.settle(name, allowed_from, vm_state, power_state, config_updates)
        )

    def clear_ready_everywhere(self) -> Deferred[int]:
        """Remove the ready key from every instance it runs (daemon start); how many had it.

        A cluster member clears only its own instances: another member's VMs
        did not stop because this daemon started.
        """
        member = self.member
        if self._cache is None:
            return self._submit(lambda: self.engine.clear_ready_everywhere(member))
        cache = self._cache

        def committed(outcome: tuple[list[str], float]) -> int:
            names, stamp = outcome
            cache.ready_cleared(names, stamp)
            return len(names)

        return self._submit(lambda: self.engine.clear_ready(member)).addCallback(committed)

    def delete_instance(self, name: str) -> Deferred[None]:
        """Remove the instance and its snapshots; its action history stays."""
        done = self._submit(lambda: self.engine.delete_instance(name))
        cache = self._cache
        if cache is not None:
            done.addCallback(lambda _: cache.removed(name))
        return done

    def rename_instance(
        self, name: str, new_name: str, allowed_from: frozenset[VMState], request_id: str
    ) -> Deferred[InstanceRecord]:
        """Call an idle instance ``new_name``, with its snapshots and certificate; atomic."""
        done = self._submit(
            lambda: self.engine.rename_instance(name, new_name, allowed_from, request_id)
        )
        cache = self._cache
        if cache is not None:
            done.addCallback(lambda record: cache.renamed(name, record))
        return done

    def refresh_instance(self, name: str) -> Deferred[InstanceRecord | None]:
        """Read instance ``name`` again after another member wrote it (None: it is gone).

        What instance reads see follows: the row as now committed, or no row.
        In order with this daemon's own calls, like every other.
        """
        done = self._submit(lambda: self.engine.find_instance(name))
        cache = self._cache
        if cache is not None:

            def reread(record: InstanceRecord | None) -> InstanceRecord | None:
                if record is None:
                    cache.removed(name)
                    return None
                return cache.committed(record)

            done.addCallback(reread)
        return done

    def renew_lease(
        self, name: str, address: str, fingerprint: str, lease_seconds: float
    ) -> Deferred[float]:
        """Join as member ``name`` (``LeaseHeld``: another daemon holds it); when it runs out."""
        return self._submit(
            lambda: self.engine.renew_lease(name, address, fingerprint, lease_seconds)
        )

    def renew_held_lease(
        self, name: str, address: str, fingerprint: str, lease_seconds: float
    ) -> Deferred[float]:
        """Renew the lease this daemon holds (``LeaseLost``: it does not); when it runs out."""
        return self._submit(
            lambda: self.engine.renew_held_lease(name, address, fingerprint, lease_seconds)
        )

    def give_up_lease(self, name: str, fingerprint: str) -> Deferred[None]:
        """Member ``name`` stops cleanly: its lease ends now (if ``fingerprint`` holds it)."""
        return self._submit(lambda: self.engine.give_up_lease(name, fingerprint))

    def list_members(self) -> Deferred[MembersView]:
        """Every member and its instance count, read at one moment of the store's clock."""
        return self._submit(self.engine.list_members)

    def remove_member(self, name: str) -> Deferred[MemberRecord]:
        """Retire member ``name`` (not while online or stamped on instances); its record."""
        return self._submit(lambda: self.engine.remove_member(name))

    def set_agent_certificate(self, name: str, fingerprint: str) -> Deferred[None]:
        """Record (or replace) the fingerprint of the client certificate issued to an instance."""
        done = self._submit(lambda: self.engine.set_agent_certificate(name, fingerprint))
        cache = self._cache
        if cache is not None:
            done.addCallback(lambda _: cache.certified(name, fingerprint))
        return done

    def instance_for_fingerprint(self, fingerprint: str) -> InstanceRecord | None:
        """The instance whose agent certificate has this fingerprint (None: unknown or revoked).

        Synchronous, like the instance reads: TLS asks it during a handshake.
        Only an instance this daemon runs: the guest API on one member's host
        never takes the agent of an instance another member runs.
        """
        record = self._view.instance_for_fingerprint(fingerprint)
        return record if record is not None and self.owns(record) else None

    def start_action(self, name: str, action: str, request_id: str) -> Deferred[int]:
        """Record the start of an action on instance name; return its id."""
        return self._submit(lambda: self.engine.start_action(name, action, request_id))

    def start_step(self, action_id: int, step: str) -> Deferred[int]:
        """Record the start of a step of an action; return its id."""
        return self._submit(lambda: self.engine.start_step(action_id, step))

    def finish_step(self, step_id: int, result: str, error: str | None = None) -> Deferred[None]:
        """Record how a step ended ("success" or "error")."""
        return self._submit(lambda: self.engine.finish_step(step_id, result, error))

    def add_step(
        self, action_id: int, step: str, result: str, error: str | None = None
    ) -> Deferred[None]:
        """Record a step that started and ended at once."""
        return self._submit(lambda: self.engine.add_step(action_id, step, result, error))

    def finish_action(
        self, action_id: int, result: str, error: str | None = None
    ) -> Deferred[None]:
        """Record how an action ended ("success" or "error")."""
        return self._submit(lambda: self.engine.finish_action(action_id, result, error))

    def list_actions(self, name: str) -> Deferred[list[ActionRecord]]:
        """The action history of instance name (kept after delete), newest first."""
        return self._submit(lambda: self.engine.list_actions(name))

    def unfinished_actions(self) -> Deferred[list[ActionRecord]]:
        """Actions that never finished on the instances this daemon runs, oldest first."""
        member = self.member
        return self._submit(lambda: self.engine.unfinished_actions(member))

    def create_snapshot(
        self, instance: str, name: str, stateful: bool, metadata: dict[str, Any]
    ) -> Deferred[dict[str, Any]]:
        """Record a snapshot of instance; Conflict if the instance already has one called name."""
        return self._submit(
            lambda: self.engine.create_snapshot(instance, name, stateful, metadata)
        )

    def delete_snapshot(self, instance: str, name: str) -> Deferred[dict[str, Any]]:
        """Forget snapshot ``name`` of instance, returning its row; NotFound if it has none."""
        return self._submit(lambda: self.engine.delete_snapshot(instance, name))

    def find_snapshot(self, instance: str, name: str) -> Deferred[dict[str, Any] | None]:
        """Snapshot ``name`` of instance, or None."""
        return self._submit(lambda: self.engine.find_snapshot(instance, name))

    def list_snapshots(self, instance: str) -> Deferred[list[dict[str, Any]]]:
        """The snapshots of instance, oldest first; NotFound if there is no such instance."""
        return self._submit(lambda: self.engine.list_snapshots(instance))
