"""The store as the daemon uses it: every call a Deferred, run by the engine's executor.

``AsyncStore`` has the engine's tables in the ``Async`` mode (``store.table``):
``store.instances.claim_task(...)`` returns a Deferred that fires once the
call's transaction committed, and ``run(work)`` does the same for any work on
the engine.  Instance reads (``view``) are synchronous: the rows as of the
last commit, kept up to date from what each call recorded it changed
(``Database.recording``), applied before the call's callbacks run; after an
``OutcomeUnknown`` every row is read again (``reload_instances``).  See
docs/architecture.md, "the store".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorThreads
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain import Fenced, InstanceRecord
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
        # Told when the store refuses a write as fenced (this daemon's lease was taken over).
        self.fenced_by: Callable[[Fenced], None] | None = None

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
            return self._executor.submit(work).addErrback(self._watch_outcome)
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
        """On the reactor thread, as a call fails: after an unknown outcome, reread every row;
        a write refused as fenced is told to ``fenced_by``."""
        if failure.check(OutcomeUnknown) and not self._stale:
            self._stale = True
            self._reread()
        if isinstance(failure.value, Fenced) and self.fenced_by is not None:
            self.fenced_by(failure.value)
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
