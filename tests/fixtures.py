"""A real Lifecycle for API and CLI tests: the SQLite store, fakeqemu VMs, the event bus."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import gatherResults
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from vmready.events import EventBus
from vmready.hypervisor import HypervisorDriver
from vmready.lifecycle import Lifecycle
from vmready.store import Store

# Short enough that a clean stop of a guest-less fakeqemu VM falls back to force quickly.
STOP_TIMEOUT = 0.3


class TrackingReactor:
    """The global reactor, remembering the delayed calls made through it so tests can end clean.

    Operations stay queryable for minutes after they finish (a ``callLater``);
    trial rightly fails a test that leaves such a call pending.
    """

    def __init__(self, real: Any) -> None:
        self._real = real
        self.delayed: list[IDelayedCall] = []

    def callLater(self, delay: float, f: Any, *args: Any, **kwargs: Any) -> IDelayedCall:
        """``reactor.callLater``, remembered."""
        call: IDelayedCall = self._real.callLater(delay, f, *args, **kwargs)
        self.delayed.append(call)
        return call

    def cancel_pending(self) -> None:
        """Cancel every remembered call still pending."""
        for call in self.delayed:
            if call.active():
                call.cancel()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def make_lifecycle(test: TestCase, stop_timeout: float = STOP_TIMEOUT) -> Lifecycle:
    """A Lifecycle on a fresh store and fakeqemu, torn down (VMs stopped) after ``test``."""
    # Under /tmp, not trial's deep temp dir: unix socket paths must stay short.
    base = tempfile.mkdtemp(prefix="vmready-test-")
    test.addCleanup(shutil.rmtree, base, True)
    store = Store.open(os.path.join(base, "vmready.sqlite"))
    tracking = TrackingReactor(reactor)
    lifecycle = Lifecycle(
        tracking,
        store,
        HypervisorDriver(reactor, "fakeqemu"),
        EventBus(reactor.seconds),
        os.path.join(base, "run"),
        stop_timeout=stop_timeout,
    )

    async def tear_down() -> None:
        pending = [op.when_done() for op in lifecycle.operations.list() if not op.done]
        await gatherResults(pending)
        # Taken from the lifecycle first, so their exit is not recorded as an instance error.
        vms = [lifecycle.vms.pop(name) for name in list(lifecycle.vms)]
        for vm in vms:
            await vm.force_stop()
        # An operation that just finished schedules its expiry after waking its waiters.
        await deferLater(reactor, 0, lambda: None)
        tracking.cancel_pending()
        store.close()

    test.addCleanup(tear_down)
    return lifecycle
