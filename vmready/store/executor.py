"""Where the store's engine runs: one database thread, or inline for tests and replays.

The daemon's store must never make the reactor wait on the disk, so every
call, read or write, goes to ``DatabaseThread``: one thread, calls run in the
order they were submitted (every read sees every earlier write), and the calls
queued while the thread was busy run together in one transaction (one commit,
one fsync for a whole power-sync round), each in its own savepoint so that
one call's error (a Conflict) fails that call alone.  A call's Deferred fires
on the reactor thread only after the transaction that holds it committed, so
whoever waits on it never announces a state the store might still lose.

``InlineExecutor`` runs each call at once on the caller's thread: a replay,
whose clock is a ``task.Clock``, must stay deterministic, and a unit test can
read the result at once.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorThreads
from twisted.python.failure import Failure

from vmready.store.database import TransactionLost

__all__ = ["BatchingEngine", "DatabaseThread", "Executor", "InlineExecutor"]

T = TypeVar("T")

# At most this many calls share a transaction: a commit is never far away.
MAX_BATCH = 512


class Executor(Protocol):
    """Runs the engine's calls; each Deferred fires on the reactor thread once committed."""

    def submit(self, work: Callable[[], T]) -> Deferred[T]:
        """Run ``work`` after every call submitted before it."""

    def stop(self) -> Deferred[None]:
        """Run what is queued, then nothing more; fires when the last call has returned."""


class BatchingEngine(Protocol):
    """What ``DatabaseThread`` needs of an engine to commit many calls together."""

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """One transaction around many calls."""

    def isolated(self) -> contextlib.AbstractContextManager[None]:
        """One call inside a batch, undone alone if it raises."""


class InlineExecutor:
    """Each call at once, on the caller's thread: for replays and unit tests."""

    def submit(self, work: Callable[[], T]) -> Deferred[T]:
        try:
            return succeed(work())
        except Exception:
            return fail(Failure())

    def stop(self) -> Deferred[None]:
        return succeed(None)


_Call = tuple[Callable[[], Any], Deferred[Any]]


class DatabaseThread:
    """One thread that owns the engine: calls in order, queued calls committed together."""

    def __init__(
        self,
        reactor: IReactorThreads,
        engine: BatchingEngine,
        name: str = "vmready-store",
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._reactor = reactor
        self._engine = engine
        self._max_batch = max_batch
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
            return fail(RuntimeError("the store is closed"))
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
        """Each call's result or Failure; every one a Failure if the commit failed."""
        outcomes: list[Any] = []
        try:
            with self._engine.batch():
                for work, _done in calls:
                    outcomes.append(_one(self._engine, work))
        except Exception:
            failure = Failure()
            return [failure] * len(calls)
        self.batches += 1
        self.calls += len(calls)
        return outcomes

    def _finished(self) -> None:
        self._done = True
        waiting, self._waiting = self._waiting, []
        for stopped in waiting:
            stopped.callback(None)


def _one(engine: BatchingEngine, work: Callable[[], Any]) -> Any:
    try:
        with engine.isolated():
            return work()
    except TransactionLost:
        raise  # the whole batch is gone: every call of it fails, none runs after
    except Exception:
        return Failure()


def _deliver(calls: list[_Call], outcomes: list[Any]) -> None:
    """On the reactor thread, in submission order: each caller gets its own outcome."""
    for (_work, done), outcome in zip(calls, outcomes, strict=True):
        if isinstance(outcome, Failure):
            done.errback(outcome)
        else:
            done.callback(outcome)
