"""Where the store's engine runs: one database thread, or inline for tests and replays.

``DatabaseThread`` keeps the disk off the reactor: calls run in order on one
thread, those queued while it was busy in one transaction, each in its own
savepoint (one call's error fails that call alone); a call's Deferred fires on
the reactor thread only once its transaction committed.  A write the disk or
PostgreSQL refuses is rolled back and tried again for ``retry_for`` seconds,
then each call fails with ``StoreWriteFailed`` (nothing kept); ``StoreHealth``
announces when writes start and stop failing.  A connection lost during
``COMMIT`` fails the batch at once with ``OutcomeUnknown`` (it may have
committed: never run again); a deadlock fails its one call
(``CallDeadlocked``).  ``InlineExecutor`` runs each call at once, for replays
on a ``task.Clock`` and unit tests.  See docs/architecture.md and
docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import errno
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import psycopg
from twisted.internet.defer import Deferred, fail, maybeDeferred, succeed
from twisted.internet.interfaces import IReactorThreads
from twisted.logger import Logger
from twisted.python.failure import Failure

from vmready.domain import Listener, Listeners, VMReadyError
from vmready.store.database import CommitUnknown, TransactionLost

T = TypeVar("T")
_log = Logger()

# At most this many calls share a transaction: a commit is never far away.
MAX_BATCH = 512
# How long a batch the disk refuses is tried again before its calls fail.
DEFAULT_RETRY_FOR = 5.0
# The pauses between tries: from the first, doubling, up to the last.
_FIRST_PAUSE = 0.05
_LONGEST_PAUSE = 1.0
# What SQLite says when the disk, not the call, is at fault.
_DISK_MESSAGES = ("disk is full", "disk i/o error", "readonly database", "unable to open")
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EROFS, errno.EDQUOT})


class StoreWriteFailed(TransactionLost, VMReadyError):
    """The store could not write (the disk is full, say); nothing of the call was kept."""

    http_status = 503


class StoreClosed(RuntimeError):
    """A call after the store was closed (the daemon stops): nothing of it was run."""

    def __init__(self) -> None:
        super().__init__("the store is closed")


class OutcomeUnknown(StoreWriteFailed):
    """The connection was lost during COMMIT: the call may or may not have been kept."""


class CallDeadlocked(StoreWriteFailed):
    """The call and another writer waited for each other's rows; nothing of the call was kept."""


def is_deadlock(error: BaseException) -> bool:
    """Whether ``error`` is PostgreSQL ending a statement to break a deadlock."""
    return isinstance(error, psycopg.errors.DeadlockDetected)


def is_write_failure(error: BaseException) -> bool:
    """Whether ``error`` is the disk refusing a write, not a call's own error (a Conflict).

    On PostgreSQL: the server, or the way to it (``OperationalError``: the
    connection lost, no connection to be had, a deadlock, a serialization failure).
    """
    if isinstance(error, TransactionLost | psycopg.OperationalError):
        return True
    if isinstance(error, sqlite3.OperationalError):
        text = str(error).lower()
        return any(message in text for message in _DISK_MESSAGES)
    return isinstance(error, OSError) and error.errno in _DISK_ERRNOS


class StoreHealth:
    """Whether the store's writes succeed, on the reactor thread: since when they fail, why."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.failing_since: float | None = None
        self.error: str | None = None
        self._listeners: Listeners[StoreHealth] = Listeners(_log, "store health listener failed")

    def subscribe(self, listener: Listener[StoreHealth]) -> Callable[[], None]:
        """Call ``listener`` when writes start failing and when they succeed again."""
        return self._listeners.subscribe(listener)

    def failed(self, error: str) -> None:
        """A write was refused; the first of a run is announced."""
        first = self.failing_since is None
        self.error = error
        if first:
            self.failing_since = self._clock()
            self._listeners.notify(self)

    def succeeded(self) -> None:
        """A batch committed: if writes were failing, they no longer are."""
        if self.failing_since is None:
            return
        self.failing_since = None
        self.error = None
        self._listeners.notify(self)


class Executor(Protocol):
    """Runs the engine's calls; each Deferred fires on the reactor thread once committed."""

    def submit(self, work: Callable[[], T]) -> Deferred[T]:
        """Run ``work`` after every call submitted before it."""

    def stop(self) -> Deferred[None]:
        """Run what is queued, then nothing more; fires when the last call has returned."""

    @property
    def health(self) -> StoreHealth:
        """Whether writes succeed (on the reactor thread)."""


class BatchingEngine(Protocol):
    """What ``DatabaseThread`` needs of the engine's database to commit many calls together."""

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """One transaction around many calls."""

    def savepoint(self) -> contextlib.AbstractContextManager[None]:
        """One call inside a batch, undone alone if it raises."""


class InlineExecutor:
    """Each call at once, on the caller's thread: for replays and unit tests."""

    def __init__(self) -> None:
        # Inline calls are not retried: a refused write fails its call at once.
        self.health = StoreHealth()

    def submit(self, work: Callable[[], T]) -> Deferred[T]:
        return maybeDeferred(work)

    def stop(self) -> Deferred[None]:
        return succeed(None)


_Call = tuple[Callable[[], Any], Deferred[Any]]


class DatabaseThread:
    """One thread that owns the engine: calls in order, queued calls committed together."""

    def __init__(
        self,
        reactor: IReactorThreads,
        engine: BatchingEngine,
        path: str,
        name: str = "vmready-store",
        max_batch: int = MAX_BATCH,
        retry_for: float = DEFAULT_RETRY_FOR,
    ) -> None:
        self._reactor = reactor
        self._engine = engine
        # Where the store is, as its errors name it.
        self._path = path
        self._max_batch = max_batch
        self.retry_for = retry_for
        self.health = StoreHealth()
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._stopping = False
        self._waiting: list[Deferred[None]] = []
        self._done = False
        # How many transactions committed, and how many calls they held (for tests, figures).
        self.batches = 0
        self.calls = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], T]) -> Deferred[T]:
        if self._stopping:
            return fail(StoreClosed())
        done: Deferred[T] = Deferred()
        self._queue.put((work, done))
        return done

    def stop(self) -> Deferred[None]:
        if self._done:
            return succeed(None)
        if not self._stopping:
            self._stopping = True
            self._queue.put(None)
        stopped: Deferred[None] = Deferred()
        self._waiting.append(stopped)
        return stopped

    # On the database thread:

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                break
            calls, last = self._drain(first)
            outcomes = self._run_batch(calls)
            self._reactor.callFromThread(_deliver, calls, outcomes)
            if last:
                break
        self._reactor.callFromThread(self._finished)

    def _drain(self, first: _Call) -> tuple[list[_Call], bool]:
        """The first call and whatever else is queued (up to a batch); whether stop came."""
        calls = [first]
        while len(calls) < self._max_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return calls, False
            if item is None:
                return calls, True
            calls.append(item)
        return calls, False

    def _run_batch(self, calls: list[_Call]) -> list[Any]:
        """Each call's result or Failure; every one a Failure if the commit failed.

        A batch the disk refuses is rolled back and tried again until it
        commits or ``retry_for`` has passed (or the store is stopping).
        """
        deadline = time.monotonic() + self.retry_for
        pause = _FIRST_PAUSE
        while True:
            try:
                outcomes = self._try_batch(calls)
            except CommitUnknown as e:
                # Perhaps committed: never run again; each call says so.
                message = _describe(e)
                self._reactor.callFromThread(self.health.failed, message)
                unknown = Failure(
                    OutcomeUnknown(
                        f"the store could not confirm a write to {self._path}:"
                        f" {message}; the outcome is unknown (this change may have been"
                        " kept: read the instance again before acting on it)"
                    )
                )
                return [unknown] * len(calls)
            except Exception as e:
                if not is_write_failure(e):
                    failure = Failure()
                    return [failure] * len(calls)
                message = _describe(e)
                self._reactor.callFromThread(self.health.failed, message)
                if self._stopping or time.monotonic() + pause > deadline:
                    refused = Failure(
                        StoreWriteFailed(
                            f"the store could not write {self._path}: {message} "
                            f"(tried for {self.retry_for:g}s; nothing of this change was kept)"
                        )
                    )
                    return [refused] * len(calls)
                time.sleep(pause)
                pause = min(pause * 2, _LONGEST_PAUSE)
                continue
            self._reactor.callFromThread(self.health.succeeded)
            self.batches += 1
            self.calls += len(calls)
            return outcomes

    def _try_batch(self, calls: list[_Call]) -> list[Any]:
        outcomes: list[Any] = []
        with self._engine.batch():
            for work, _done in calls:
                outcomes.append(_one(self._engine, work, self._path))
        return outcomes

    def _finished(self) -> None:
        self._done = True
        waiting, self._waiting = self._waiting, []
        for stopped in waiting:
            stopped.callback(None)


def _one(engine: BatchingEngine, work: Callable[[], Any], path: str) -> Any:
    try:
        with engine.savepoint():
            return work()
    except TransactionLost:
        raise  # the whole batch is gone: every call of it fails, none runs after
    except Exception as e:
        if is_deadlock(e):
            # PostgreSQL aborted the statement, not the transaction: ROLLBACK TO the call's
            # savepoint (done by isolated()) leaves the batch usable, its earlier calls' locks
            # held.  This call alone fails; the batch commits, and the other writer goes on.
            return Failure(
                CallDeadlocked(
                    f"the store could not write {path}: this change and another writer"
                    f" waited for each other's rows ({_describe(e)}); nothing of this"
                    " change was kept, try again"
                )
            )
        if is_write_failure(e):
            raise  # the disk, not the call: the whole batch is rolled back and tried again
        return Failure()


def _describe(error: BaseException) -> str:
    """The disk's complaint in one line (an OSError's strerror, SQLite's or psycopg's message)."""
    cause = error.__cause__ if isinstance(error, TransactionLost) else None
    shown = cause if cause is not None else error
    if isinstance(shown, OSError) and shown.strerror:
        return shown.strerror
    return " ".join(line.strip() for line in str(shown).splitlines() if line.strip())


def _deliver(calls: list[_Call], outcomes: list[Any]) -> None:
    """On the reactor thread, in submission order: each caller gets its own outcome."""
    for (_work, done), outcome in zip(calls, outcomes, strict=True):
        if isinstance(outcome, Failure):
            done.errback(outcome)
        else:
            done.callback(outcome)
