"""Running the asyncio agent inside trial tests: a loop per test, and a loop whose clock is fake.

``VirtualTimeLoop`` is an asyncio loop whose clock moves only when the loop
would otherwise wait: whenever nothing is ready, it jumps to the next timer.
A test of heartbeats, retries and timeouts then runs at once and never depends
on how fast the machine is.  It suits I/O that completes inside the loop
(in-memory streams, socket pairs and unix sockets served by the same loop):
I/O that depends on another thread or process would race the jumps, so such
tests use ``run_in_loop`` with real time.

``AgentThread`` runs a coroutine on its own loop in a background thread, for
tests whose other side runs on Twisted's reactor (the fake host, the fake
serial peer).
"""

from __future__ import annotations

import asyncio
import selectors
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from tests.reactor import reactor

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """Never sleeps: a wait that finds nothing ready moves the loop's clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("the test's loop has nothing left to do: it waits forever")
        assert self.loop is not None
        self.loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a fake clock that jumps to the next timer when nothing else is ready."""

    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def run_virtual(test: SynchronousTestCase, scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``scenario()`` to its end on a fresh virtual-time loop."""
    loop = VirtualTimeLoop()
    test.addCleanup(loop.close)
    return _run(loop, scenario)


def run_in_loop(
    test: SynchronousTestCase,
    scenario: Callable[[], Coroutine[Any, Any, T]],
    timeout: float = 30.0,
) -> T:
    """Run ``scenario()`` on a fresh real-time loop, failing past ``timeout`` (a hung test)."""
    loop = asyncio.new_event_loop()
    test.addCleanup(loop.close)

    async def bounded() -> T:
        return await asyncio.wait_for(scenario(), timeout)

    return _run(loop, bounded)


def _run(loop: asyncio.AbstractEventLoop, scenario: Callable[[], Coroutine[Any, Any, T]]) -> T:
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(scenario())
    finally:
        # Whatever the scenario left running (a handler finishing its answer) ends now.
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Until ``predicate()`` holds: for states that have no event to wait on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


class AgentThread:
    """An asyncio loop in a background thread, for the agent beside Twisted's reactor."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="agent-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        """Run ``coroutine`` on the agent's loop."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, function: Callable[[], T]) -> T:
        """Call ``function`` on the agent's loop and wait for its result."""

        async def call() -> T:
            return function()

        return self.submit(call()).result(timeout=10)

    def deferred(self, coroutine: Coroutine[Any, Any, T]) -> Deferred[T]:
        """``coroutine`` run on the agent's loop, as a Deferred on Twisted's reactor."""
        waiter: Deferred[T] = Deferred()
        future = self.submit(coroutine)

        def done(finished: Future[T]) -> None:
            error = finished.exception()
            if error is not None:
                reactor.callFromThread(waiter.errback, error)
            else:
                reactor.callFromThread(waiter.callback, finished.result())

        future.add_done_callback(done)
        return waiter

    def stop(self) -> None:
        """Stop the loop and its thread (after cancelling what still runs)."""

        async def cancel_all() -> None:
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running():
            self.submit(cancel_all()).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        self.loop.close()
