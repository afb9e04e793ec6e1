"""The store as the daemon uses it: every call a Deferred, run by the engine's executor.

``AsyncStore`` has the engine's tables (``store.sqlite.Tables``: ``instances``,
``actions``, ``snapshots``, ``members``, ``certificates``, ``trust``), each
in the ``Async`` mode (``store.table``): ``store.instances.claim_task(...)``
takes the arguments of ``Instances.claim_task`` and returns a Deferred that
fires, on the reactor thread, once the call ran and its transaction
committed; ``run(work)`` does the same for any work on the engine (several
calls in one turn).  The engine runs on an ``Executor``: the daemon's
``DatabaseThread`` (one thread, in order, queued calls committed together;
on PostgreSQL its connection comes from a pool) or ``InlineExecutor`` (at
once, for replays and unit tests); the layers above see only this class,
whichever the engine.

Whoever announces a state (an event, a response) waits for the Deferred of the
write that made it first: nothing is announced that the store could lose.

Instance reads (``view``: ``get_instance``, ``find_instance``,
``list_instances``, ``owned_instances``, the agent certificate lookup) are
synchronous and never touch the disk: on a database thread they read
``store.view.CommittedInstances``, the rows as of the last commit.  It is kept
up to date without a wrapper per write: every call runs inside the
database's ``recording()``, where each write of an instance row or agent
certificate notes what it changed (``Database.record``; a change rolled back
is forgotten), the executor hands the result back with those changes, and
they are applied as the call's Deferred fires, before its callbacks run:
in commit order, so whoever awaited a write reads it back, and nobody reads
a state that is not committed.  A write the disk refused
(``executor.StoreWriteFailed``) changes nothing they read.  Inline, they read
the engine itself (``LiveInstances``), which is the same thing there.

A write whose outcome is unknown (``executor.OutcomeUnknown``: PostgreSQL's
connection lost during COMMIT) may have committed although its Deferred
failed: the view is then ``stale``, and every row is read again
(``reload_instances``) as the next call in line; while the store does not
answer, that read fails and is asked again, until the view shows what really
committed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorThreads
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain.members import MemberRecord, MembersView
from vmready.domain.model import ActionRecord, InstanceRecord
from vmready.domain.states import PowerState, TaskState, VMState
from vmready.store.database import Change
from vmready.store.executor import (
    DatabaseThread,
    Executor,
    InlineExecutor,
    OutcomeUnknown,
    StoreHealth,
    StoreWriteFailed,
)
from vmready.store.sqlite import Store, Tables
from vmready.store.table import Async
from vmready.store.view import CommittedInstances, InstanceView, LiveInstances

__all__ = ["AsyncStore"]

T = TypeVar("T")

_log = Logger()


class AsyncStore(Tables[Async]):
    """The store's tables with every call a Deferred, run in order by one executor."""

    def __init__(
        self, engine: Store, executor: Executor, cached: bool, member: str | None = None
    ) -> None:
        super().__init__(engine.database, member, self._submit)
        # Touch the engine directly only where the executor runs inline (tests, replays).
        self.engine = engine
        # The cluster member this daemon is (None: the store's only daemon, on one host).
        self.member = member
        self._executor = executor
        self._cache = (
            CommittedInstances(
                engine.instances.list_instances(), engine.certificates.agent_fingerprints(), member
            )
            if cached
            else None
        )
        # The instance reads the reactor makes at once.
        self.view: InstanceView = (
            LiveInstances(engine, member) if self._cache is None else self._cache
        )
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
        executor = DatabaseThread(reactor, engine.database, engine.path)
        return cls(engine, executor, cached=True, member=member)

    @property
    def executor(self) -> Executor:
        """What runs the engine's calls."""
        return self._executor

    @property
    def health(self) -> StoreHealth:
        """Whether writes succeed: since when they fail and why (announced as it changes)."""
        return self._executor.health

    @property
    def stale(self) -> bool:
        """Whether instance reads may miss a committed write (an outcome unknown, not reread)."""
        return self._stale

    def run(self, work: Callable[[Store], T]) -> Deferred[T]:
        """Any engine work, in order with every other call (e.g. several calls in one turn)."""
        return self._submit(lambda: work(self.engine))

    def refresh_instance(self, name: str) -> Deferred[InstanceRecord | None]:
        """Read instance ``name`` again after another member wrote it (None: it is gone).

        What instance reads see follows: the row as now committed, or no row.
        In order with this daemon's own calls, like every other.
        """
        done = self._submit(lambda: self.engine.instances.find_instance(name))
        cache = self._cache
        if cache is not None:

            def reread(record: InstanceRecord | None) -> InstanceRecord | None:
                if record is None:
                    cache.removed(name)
                else:
                    cache.committed(record)
                return record

            done.addCallback(reread)
        return done

    def reload_instances(self) -> Deferred[None]:
        """Read every row and agent fingerprint again into what instance reads see.

        After the notification listener reconnected: changes by other members
        while it was away were not heard of.
        """
        engine = self.engine
        done = self._executor.submit(
            lambda: (engine.instances.list_instances(), engine.certificates.agent_fingerprints())
        )
        cache = self._cache

        def reloaded(rows: tuple[list[InstanceRecord], dict[str, str]]) -> None:
            if cache is not None:
                cache.replace(*rows)

        return done.addCallback(reloaded)

    async def close(self) -> None:
        """Run what is queued, then close the engine."""
        await self._executor.stop()
        self.engine.close()

    def _submit(self, work: Callable[[], T]) -> Deferred[T]:
        """Every call goes to the executor here; once committed, what it changed is in the view."""
        cache = self._cache
        if cache is None:
            return self._executor.submit(work)
        database = self.engine.database

        def recorded() -> tuple[T, list[Change]]:
            with database.recording() as changes:
                result = work()
            return result, changes

        def committed(outcome: tuple[T, list[Change]]) -> T:
            result, changes = outcome
            for change in changes:
                change(cache)
            return result

        done = self._executor.submit(recorded)
        done.addErrback(self._watch_outcome)
        return done.addCallback(committed)

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

        self.reload_instances().addCallbacks(reread, failed)

    # Former pass-throughs, until their callers call the tables and the view

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
        """NOTIFY ``vmready_events`` with payload; fires once committed (sent then)."""
        return self.members.publish_event(payload)

    def create_instance(
        self,
        name: str,
        config: dict[str, str],
        devices: dict[str, dict[str, str]],
        instance_uuid: str | None = None,
    ) -> Deferred[InstanceRecord]:
        """Add an instance run by this member, building with a spawning task; Conflict if taken."""
        return self.instances.create_instance(name, config, devices, instance_uuid)

    def get_instance(self, name: str) -> InstanceRecord:
        """The instance called name, or NotFound."""
        return self.view.get_instance(name)

    def find_instance(self, name: str) -> InstanceRecord | None:
        """The instance called name, or None."""
        return self.view.find_instance(name)

    def list_instances(self) -> list[InstanceRecord]:
        """Every instance (of every member), ordered by name."""
        return self.view.list_instances()

    def owned_instances(self) -> list[InstanceRecord]:
        """The instances this daemon runs."""
        return self.view.owned_instances()

    def owns(self, record: InstanceRecord) -> bool:
        """Whether this daemon runs the instance (always, on a single host)."""
        return self.view.owns(record)

    def claim_task(
        self, name: str, action: str, allowed_from: frozenset[VMState], task: TaskState
    ) -> Deferred[InstanceRecord]:
        """Start task if there is none and vm_state is in allowed_from; else the 409 saying why."""
        return self.instances.claim_task(name, action, allowed_from, task)

    def advance_task(
        self, name: str, expected: TaskState, task: TaskState
    ) -> Deferred[InstanceRecord]:
        """Move from task_state expected to task; Conflict if the instance is not in expected."""
        return self.instances.advance_task(name, expected, task)

    def finish_task(
        self,
        name: str,
        expected: TaskState,
        vm_state: VMState,
        power_state: PowerState | None = None,
        config_updates: dict[str, str | None] | None = None,
    ) -> Deferred[InstanceRecord]:
        """End task expected: rest in vm_state, optionally set power_state and config; atomic."""
        return self.instances.finish_task(name, expected, vm_state, power_state, config_updates)

    def set_error(
        self, name: str, reason: str, power_state: PowerState | None = None
    ) -> Deferred[InstanceRecord]:
        """Put the instance in vm_state error with reason, ending any task."""
        return self.instances.set_error(name, reason, power_state)

    def set_power_state(self, name: str, power_state: PowerState) -> Deferred[InstanceRecord]:
        """Record what the hypervisor reports; an unchanged power state writes nothing."""
        return self.instances.set_power_state(name, power_state)

    def update_config(self, name: str, updates: dict[str, str | None]) -> Deferred[InstanceRecord]:
        """Set config keys (None deletes the key) in one read-modify-write transaction."""
        return self.instances.update_config(name, updates)

    def settle(
        self,
        name: str,
        allowed_from: frozenset[VMState],
        vm_state: VMState,
        power_state: PowerState,
        config_updates: dict[str, str | None] | None = None,
    ) -> Deferred[InstanceRecord | None]:
        """Move an idle instance to ``vm_state`` without an action (a VM exited, the poller)."""
        return self.instances.settle(name, allowed_from, vm_state, power_state, config_updates)

    def clear_ready_everywhere(self) -> Deferred[int]:
        """Remove the ready key from every instance it runs (daemon start); how many had it."""
        return self.instances.clear_ready_everywhere()

    def delete_instance(self, name: str) -> Deferred[None]:
        """Remove the instance and its snapshots; its action history stays."""
        return self.instances.delete_instance(name)

    def rename_instance(
        self, name: str, new_name: str, allowed_from: frozenset[VMState], request_id: str
    ) -> Deferred[InstanceRecord]:
        """Call an idle instance ``new_name``, with its snapshots and certificate; atomic."""
        return self.instances.rename_instance(name, new_name, allowed_from, request_id)

    def renew_lease(
        self, name: str, address: str, fingerprint: str, lease_seconds: float
    ) -> Deferred[float]:
        """Join as member ``name`` (``LeaseHeld``: another daemon holds it); when it runs out."""
        return self.members.renew_lease(name, address, fingerprint, lease_seconds)

    def renew_held_lease(
        self, name: str, address: str, fingerprint: str, lease_seconds: float
    ) -> Deferred[float]:
        """Renew the lease this daemon holds (``LeaseLost``: it does not); when it runs out."""
        return self.members.renew_held_lease(name, address, fingerprint, lease_seconds)

    def give_up_lease(self, name: str, fingerprint: str) -> Deferred[None]:
        """Member ``name`` stops cleanly: its lease ends now (if ``fingerprint`` holds it)."""
        return self.members.give_up_lease(name, fingerprint)

    def list_members(self) -> Deferred[MembersView]:
        """Every member and its instance count, read at one moment of the store's clock."""
        return self.members.list_members()

    def remove_member(self, name: str) -> Deferred[MemberRecord]:
        """Retire member ``name`` (not while online or stamped on instances); its record."""
        return self.members.remove_member(name)

    def set_agent_certificate(self, name: str, fingerprint: str) -> Deferred[None]:
        """Record (or replace) the fingerprint of the client certificate issued to an instance."""
        return self.certificates.set_agent_certificate(name, fingerprint)

    def instance_for_fingerprint(self, fingerprint: str) -> InstanceRecord | None:
        """The instance whose agent certificate has this fingerprint (None: unknown or revoked)."""
        return self.view.instance_for_fingerprint(fingerprint)

    def start_action(self, name: str, action: str, request_id: str) -> Deferred[int]:
        """Record the start of an action on instance name; return its id."""
        return self.actions.start_action(name, action, request_id)

    def start_step(self, action_id: int, step: str) -> Deferred[int]:
        """Record the start of a step of an action; return its id."""
        return self.actions.start_step(action_id, step)

    def finish_step(self, step_id: int, result: str, error: str | None = None) -> Deferred[None]:
        """Record how a step ended ("success" or "error")."""
        return self.actions.finish_step(step_id, result, error)

    def add_step(
        self, action_id: int, step: str, result: str, error: str | None = None
    ) -> Deferred[None]:
        """Record a step that started and ended at once."""
        return self.actions.add_step(action_id, step, result, error)

    def finish_action(
        self, action_id: int, result: str, error: str | None = None
    ) -> Deferred[None]:
        """Record how an action ended ("success" or "error")."""
        return self.actions.finish_action(action_id, result, error)

    def list_actions(self, name: str) -> Deferred[list[ActionRecord]]:
        """The action history of instance name (kept after delete), newest first."""
        return self.actions.list_actions(name)

    def unfinished_actions(self) -> Deferred[list[ActionRecord]]:
        """Actions that never finished on the instances this daemon runs, oldest first."""
        return self.actions.unfinished_actions()

    def create_snapshot(
        self, instance: str, name: str, stateful: bool, metadata: dict[str, Any]
    ) -> Deferred[dict[str, Any]]:
        """Record a snapshot of instance; Conflict if the instance already has one called name."""
        return self.snapshots.create_snapshot(instance, name, stateful, metadata)

    def delete_snapshot(self, instance: str, name: str) -> Deferred[dict[str, Any]]:
        """Forget snapshot ``name`` of instance, returning its row; NotFound if it has none."""
        return self.snapshots.delete_snapshot(instance, name)

    def find_snapshot(self, instance: str, name: str) -> Deferred[dict[str, Any] | None]:
        """Snapshot ``name`` of instance, or None."""
        return self.snapshots.find_snapshot(instance, name)

    def list_snapshots(self, instance: str) -> Deferred[list[dict[str, Any]]]:
        """The snapshots of instance, oldest first; NotFound if there is no such instance."""
        return self.snapshots.list_snapshots(instance)
