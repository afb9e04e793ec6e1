"""VMReadyService in-process: recovery first, then the API and the power-sync timer."""

from __future__ import annotations

import gc
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from typing import Any, cast

from twisted.application.internet import TimerService
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.error import CannotListenError
from twisted.trial.unittest import TestCase

from tests.reactor import reactor
from vmready.cli.client import Client, DaemonUnreachable
from vmready.daemon.daemonconfig import DaemonConfig
from vmready.daemon.service import GC_SWEEP_TIMER, POWER_SYNC_TIMER, VMReadyService
from vmready.domain.model import InstanceRecord
from vmready.domain.reactor import IVMReadyReactor
from vmready.lifecycle import core as lifecycle_core
from vmready.lifecycle.guestlink import GuestLink
from vmready.lifecycle.recovery import Recovery


def recovery_waits_for(gate: Deferred[None]) -> type[Recovery]:
    """A lifecycle's recovery that starts only once ``gate`` fires (and fails if it fails)."""

    class GatedRecovery(Recovery):
        async def prepare(self) -> list[InstanceRecord]:
            await gate
            return await super().prepare()

    return GatedRecovery


def reconciliation_waits_for(gate: Deferred[None]) -> type[Recovery]:
    """A lifecycle's recovery whose per-instance reconciliation starts once ``gate`` fires."""

    class GatedRecovery(Recovery):
        async def reconcile(self, records: list[InstanceRecord]) -> None:
            await gate
            await super().reconcile(records)

    return GatedRecovery


class StopRecordingReactor:
    """The global reactor, except that a request to stop it is recorded, not obeyed."""

    def __init__(self) -> None:
        self.when_running: list[Callable[[], object]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(reactor, name)

    def callWhenRunning(self, f: Callable[[], object]) -> None:
        self.when_running.append(f)


class DaemonServiceTests(TestCase):
    """The service wires the pieces and honours --power-sync-interval."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-svc-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def service(
        self, interval: float = 0, listen: str = "", the_reactor: Any = reactor
    ) -> VMReadyService:
        self.socket_path = os.path.join(self.directory, "api.sock")
        service = VMReadyService(
            the_reactor,
            DaemonConfig(
                data_dir=self.directory,
                listen=listen or f"unix:{self.socket_path}",
                power_sync_interval=interval,
            ),
        )
        self.addCleanup(service.stopService)
        return service

    async def started(self, interval: float) -> VMReadyService:
        service = self.service(interval)
        service.startService()
        await service.recovered
        return service

    def gated(
        self, waits_for: Callable[[Deferred[None]], type[Recovery]], interval: float = 0
    ) -> tuple[Deferred[None], VMReadyService]:
        """A service started whose recovery ``waits_for`` the gate returned with it."""
        gate: Deferred[None] = Deferred()
        self.patch(lifecycle_core, "Recovery", waits_for(gate))
        service = self.service(interval)
        service.startService()
        return gate, service

    def timers(self, service: VMReadyService) -> list[TimerService]:
        return [
            child
            for child in service
            if isinstance(child, TimerService) and child.name == POWER_SYNC_TIMER
        ]

    def test_positiveIntervalRunsThePollerOnTheReactorClock(self) -> Deferred[None]:
        async def check() -> None:
            service = await self.started(2.5)
            timers = self.timers(service)
            self.assertEqual(len(timers), 1)
            self.assertEqual(timers[0].step, 2.5)
            self.assertIs(timers[0].clock, reactor)

        return ensureDeferred(check())

    def test_theHeapIsSweptOnTheReactorClockOnceRecovered(self) -> Deferred[None]:
        async def check() -> None:
            self.addCleanup(gc.unfreeze)
            service = VMReadyService(
                reactor,
                DaemonConfig(
                    data_dir=self.directory,
                    listen=f"unix:{os.path.join(self.directory, 'api.sock')}",
                    power_sync_interval=0,
                    gc_sweep_interval=600,
                ),
            )
            self.addCleanup(service.stopService)
            service.startService()
            await service.recovered
            sweeps = [
                child
                for child in service
                if isinstance(child, TimerService) and child.name == GC_SWEEP_TIMER
            ]
            self.assertEqual([(timer.step, timer.clock) for timer in sweeps], [(600, reactor)])
            self.assertEqual(service.sweeper.sweeps, 1)  # swept at once: the heap is built
            self.assertGreater(gc.get_freeze_count(), 0)
            await service.stopService()
            self.assertEqual(gc.get_freeze_count(), 0)

        return ensureDeferred(check())

    def test_zeroOrNegativeIntervalDisablesThePoller(self) -> Deferred[None]:
        async def check() -> None:
            for interval in (0.0, -1.0):
                service = await self.started(interval)
                self.assertEqual(self.timers(service), [])
                await service.stopService()

        return ensureDeferred(check())

    def test_storeAndSocketLiveInTheDataDir(self) -> Deferred[None]:
        async def check() -> None:
            await self.started(0)
            self.assertTrue(os.path.exists(os.path.join(self.directory, "vmready.sqlite")))
            self.assertTrue(os.path.exists(os.path.join(self.directory, "api.sock")))

        return ensureDeferred(check())

    def test_apiListensOnlyOnceReadyIsCleared(self) -> Deferred[None]:
        async def check() -> None:
            gate, service = self.gated(recovery_waits_for)
            client = Client(reactor, self.socket_path)
            with self.assertRaises(DaemonUnreachable):
                await client.get("/1.0")
            gate.callback(None)
            await service.recovered
            self.assertIn("api_status", await client.get("/1.0"))

        return ensureDeferred(check())

    def test_apiServesWhileInstancesAreReconciledAndPowerSyncWaits(self) -> Deferred[None]:
        async def check() -> None:
            gate, service = self.gated(reconciliation_waits_for, interval=2.5)
            await service.serving
            client = Client(reactor, self.socket_path)
            self.assertEqual(await client.get("/1.0/instances"), [])
            self.assertFalse(service.recovered.called)
            self.assertEqual(self.timers(service), [])
            gate.callback(None)
            await service.recovered
            self.assertEqual(len(self.timers(service)), 1)

        return ensureDeferred(check())

    def test_serverInfoShowsTheDaemonsEffectiveOptionsAsItsConfig(self) -> Deferred[None]:
        async def check() -> None:
            service = await self.started(12.5)
            config = (await Client(reactor, self.socket_path).get("/1.0"))["config"]
            self.assertEqual(
                {key: config[key] for key in ("power-sync-interval", "stop-timeout", "data-dir")},
                {"power-sync-interval": "12.5", "stop-timeout": "30", "data-dir": self.directory},
            )
            self.assertEqual(config["guest-listen"], service.config.guest_endpoint)
            # Unset options are not shown, rather than as "None".
            self.assertNotIn("qemu-binary", config)
            self.assertNotIn("default-image", config)

        return ensureDeferred(check())

    def test_apiListensEvenIfRecoveryFails(self) -> Deferred[None]:
        async def check() -> None:
            gate, service = self.gated(recovery_waits_for)
            gate.errback(RuntimeError("the store is on fire"))
            with self.assertRaises(RuntimeError):
                await service.recovered
            self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
            self.assertIn("api_status", await Client(reactor, self.socket_path).get("/1.0"))

        return ensureDeferred(check())

    def test_addressTakenWhenRecoveryEndsStopsTheDaemon(self) -> Deferred[None]:
        async def check() -> None:
            # makeService found the address free; another process took it since.
            taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.addCleanup(taken.close)
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            listen = f"tcp:{taken.getsockname()[1]}:interface=127.0.0.1"
            recording = StopRecordingReactor()
            service = self.service(listen=listen, the_reactor=recording)
            service.startService()
            await service.recovered
            self.assertEqual(len(self.flushLoggedErrors(CannotListenError)), 1)
            self.assertEqual(recording.when_running, [reactor.stop])
            self.assertEqual([child for child in service if child.running], [])

        return ensureDeferred(check())


class GuestAPIStartTests(DaemonServiceTests):
    """The guest API: a new random port at each start, its certificate, stale sockets."""

    def guest_sockets(self) -> list[str]:
        return sorted(n for n in os.listdir(self.directory) if n.startswith("guest-api.sock_"))

    async def restarted_link(self, first: VMReadyService) -> GuestLink:
        """The guest link of a daemon started after ``first`` stopped (leaving no socket)."""
        await first.stopService()
        self.assertEqual(self.guest_sockets(), [])
        second = await self.started(0)
        assert second.lifecycle is not None and second.lifecycle.reach.link is not None
        return second.lifecycle.reach.link

    def test_eachStartListensOnANewRandomPortAndAdvertisesIt(self) -> Deferred[None]:
        async def check() -> None:
            first = await self.started(0)
            assert first.lifecycle is not None and first.lifecycle.reach.link is not None
            port = first.lifecycle.reach.link.port
            self.assertEqual(self.guest_sockets(), [f"guest-api.sock_{port}"])
            self.assertEqual(
                first.lifecycle.reach.link.transport,
                f"hvsock:{os.path.join(self.directory, 'guest-api.sock')}",
            )
            self.assertNotEqual((await self.restarted_link(first)).port, port)

        return ensureDeferred(check())

    def test_serverCertificateIsMadeOnceWithAPrivateKey(self) -> Deferred[None]:
        async def check() -> None:
            first = await self.started(0)
            key = os.path.join(self.directory, "server.key")
            self.assertEqual(os.stat(key).st_mode & 0o777, 0o600)
            with open(os.path.join(self.directory, "server.crt"), "rb") as f:
                certificate = f.read()
            self.assertEqual((await self.restarted_link(first)).server_cert_pem, certificate)

        return ensureDeferred(check())

    def test_staleSocketsOfAKilledDaemonAreRemovedLiveAndForeignOnesKept(self) -> Deferred[None]:
        async def check() -> None:
            stale = os.path.join(self.directory, "guest-api.sock_4242")
            dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            dead.bind(stale)
            dead.close()  # the file stays; nothing listens: what kill -9 leaves behind
            live_path = os.path.join(self.directory, "guest-api.sock_4343")
            live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.addCleanup(live.close)
            live.bind(live_path)
            live.listen(1)
            notes = os.path.join(self.directory, "guest-api.sock_notes")
            open(notes, "w").close()
            await self.started(0)
            self.assertFalse(os.path.exists(stale))
            self.assertTrue(os.path.exists(live_path))
            self.assertTrue(os.path.exists(notes))

        return ensureDeferred(check())

    def test_guestAPIThatCannotListenStopsTheDaemon(self) -> Deferred[None]:
        async def check() -> None:
            recording = StopRecordingReactor()
            service = VMReadyService(
                cast(IVMReadyReactor, recording),
                DaemonConfig(
                    data_dir=self.directory,
                    listen=f"unix:{os.path.join(self.directory, 'api.sock')}",
                    power_sync_interval=0,
                    guest_listen=f"hvsock:path={self.directory}/missing/dir/g",
                ),
            )
            self.addCleanup(service.stopService)
            service.startService()
            with self.assertRaises(CannotListenError):
                await service.recovered
            self.assertEqual(recording.when_running, [reactor.stop])
            self.assertFalse(os.path.exists(os.path.join(self.directory, "api.sock")))

        return ensureDeferred(check())


class OptionsTests(TestCase):
    """twistd vmready's options: safe defaults, bounded values."""

    def test_defaultSocketIsOwnerOnly(self) -> None:
        from vmready.daemon.tap import Options

        options = Options()
        options.parseOptions(["--data-dir", "/tmp/vmr-opt"])
        self.assertEqual(options["listen"], "unix:/tmp/vmr-opt/vmready.sock:mode=600:backlog=256")

    async def test_theDefaultSocketQueuesAsManyConnectionsAsTheAPIServes(self) -> None:
        # Connections wait in the kernel's queue while the daemon is busy; a queue shorter
        # than the API's own bound hung up on clients of a daemon that was merely busy.
        from twisted.internet.endpoints import serverFromString
        from twisted.internet.protocol import Factory, Protocol

        from vmready.api.limits import MAX_OPERATOR_CONNECTIONS
        from vmready.daemon.tap import Options

        directory = tempfile.mkdtemp(prefix="vmr-queue-")
        self.addCleanup(shutil.rmtree, directory, True)
        options = Options()
        options.parseOptions(["--data-dir", directory])
        port = await serverFromString(reactor, options["listen"]).listen(
            Factory.forProtocol(Protocol)
        )
        self.addCleanup(port.stopListening)
        # The reactor does not run between these connects: none is accepted meanwhile.
        for _ in range(MAX_OPERATOR_CONNECTIONS):
            client = socket.socket(socket.AF_UNIX)
            client.setblocking(False)
            self.addCleanup(client.close)
            client.connect(os.path.join(directory, "vmready.sock"))  # no BlockingIOError

    def test_stopTimeoutMustBeFiniteAndBounded(self) -> None:
        from twisted.python import usage

        from vmready.daemon.tap import Options

        for value in ("-1", "5000", "inf", "nan", "soon"):
            with self.assertRaises(usage.UsageError):
                Options().parseOptions(["--stop-timeout", value])

    def test_syncConcurrencyIsAWholeNumberFrom1To1024(self) -> None:
        from twisted.python import usage

        from vmready.daemon.tap import Options

        for value in ("0", "-3", "1025", "2.5", "many"):
            with self.assertRaises(usage.UsageError):
                Options().parseOptions(["--data-dir", "/tmp/vmr-opt", "--sync-concurrency", value])
        options = Options()
        options.parseOptions(["--data-dir", "/tmp/vmr-opt", "--sync-concurrency", "3"])
        self.assertEqual(options["sync-concurrency"], 3)
        defaults = Options()
        defaults.parseOptions(["--data-dir", "/tmp/vmr-opt"])
        self.assertEqual(defaults["sync-concurrency"], 16)

    def test_theServiceHandsTheLimitToTheLifecycle(self) -> Deferred[None]:
        directory = tempfile.mkdtemp(prefix="vmr-svc-", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        service = VMReadyService(
            reactor,
            DaemonConfig(
                data_dir=directory,
                listen=f"unix:{os.path.join(directory, 'api.sock')}",
                power_sync_interval=0,
                sync_concurrency=5,
            ),
        )
        self.addCleanup(service.stopService)
        service.startService()
        assert service.lifecycle is not None
        self.assertEqual(service.lifecycle.recovery.concurrency, 5)
        return service.recovered
