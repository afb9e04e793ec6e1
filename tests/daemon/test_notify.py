"""sd_notify: the protocol's pieces, the service's hooks, ``twistd vmready`` under a manager."""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogEvent, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase, TestCase
from zope.interface import implementer

from tests.daemon.test_daemon import DEADLINE, api_answers, twistd, wait_for_api
from tests.daemon.test_daemon_service import recovery_waits_for
from tests.reactor import reactor
from vmready.cli.client import Client, DaemonUnreachable
from vmready.daemon.daemonconfig import DaemonConfig
from vmready.daemon.notify import (
    Notifier,
    ReconcileProgress,
    datagram,
    forget_environment,
    notify_address,
    watchdog_interval,
)
from vmready.daemon.service import WATCHDOG_TIMER, VMReadyService
from vmready.daemon.tap import Options, makeService
from vmready.lifecycle import core as lifecycle_core
from vmready.store.sqlite import Store


class ManagerSocket:
    """What systemd listens on: a unix datagram socket, a file or in the abstract namespace."""

    def __init__(self, directory: str, abstract: bool = False) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"vmready-test-{uuid.uuid4().hex}"
            self.sock.bind("\0" + name)
            self.variable = "@" + name
        else:
            self.variable = os.path.join(directory, "notify.sock")
            self.sock.bind(self.variable)

    def close(self) -> None:
        self.sock.close()

    def pending(self) -> list[dict[str, str]]:
        """Every notification already sent, without waiting."""
        messages = []
        self.sock.setblocking(False)
        try:
            while True:
                messages.append(parse(self.sock.recv(4096)))
        except BlockingIOError:
            return messages

    def next(self, timeout: float = DEADLINE) -> dict[str, str]:
        """The next notification (fails the test after ``timeout``)."""
        self.sock.settimeout(timeout)
        return parse(self.sock.recv(4096))


def instances(data_dir: str, *names: str) -> None:
    """Stopped instances in the data dir's store, for the daemon to reconcile at start."""
    engine = Store.open(os.path.join(data_dir, "vmready.sqlite"))
    try:
        for name in names:
            engine.instances.create_instance(name, {}, {})
    finally:
        engine.close()


def parse(message: bytes) -> dict[str, str]:
    """A notification's KEY=value lines."""
    return dict(line.split("=", 1) for line in message.decode().split("\n"))


class ProtocolTests(SynchronousTestCase):
    """The variables a manager sets and the datagrams vmready sends."""

    def test_addresses(self) -> None:
        self.assertEqual(notify_address("/run/systemd/notify"), "/run/systemd/notify")
        self.assertEqual(notify_address("@sd-notify"), b"\0sd-notify")
        for nothing in (None, "", "@", "relative/path", "vsock:2:1234"):
            self.assertIsNone(notify_address(nothing), nothing)

    def test_watchdogIsHalfItsIntervalAndOnlyForItsProcess(self) -> None:
        self.assertEqual(watchdog_interval({"WATCHDOG_USEC": "30000000"}, 7), 15.0)
        self.assertEqual(
            watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "7"}, 7), 1.0
        )
        for environ in (
            {},
            {"WATCHDOG_USEC": "0"},
            {"WATCHDOG_USEC": "-5"},
            {"WATCHDOG_USEC": "soon"},
            {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "8"},
            {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "me"},
        ):
            self.assertIsNone(watchdog_interval(environ, 7), environ)

    def test_datagramIsOneLinePerField(self) -> None:
        self.assertEqual(
            datagram({"READY": "1", "STATUS": "two\nlines"}), b"READY=1\nSTATUS=two lines"
        )

    def test_theVariablesAreForgottenForChildren(self) -> None:
        environ = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/b"}
        forget_environment(environ)
        self.assertEqual(environ, {"PATH": "/b"})


class NotifierTests(SynchronousTestCase):
    """Notifier against real datagram sockets."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-n-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def manager(self, abstract: bool = False) -> ManagerSocket:
        manager = ManagerSocket(self.directory, abstract)
        self.addCleanup(manager.close)
        return manager

    def notifier(self, manager: ManagerSocket, **environ: str) -> Notifier:
        return Notifier.from_environment({"NOTIFY_SOCKET": manager.variable, **environ}, 1)

    def test_eachNotificationIsOneDatagram(self) -> None:
        manager = self.manager()
        notifier = self.notifier(manager)
        notifier.ready("serving")
        notifier.status("reconciling 1 of 2 instances")
        notifier.ping()
        notifier.stopping("bye")
        self.assertEqual(
            manager.pending(),
            [
                {"READY": "1", "STATUS": "serving"},
                {"STATUS": "reconciling 1 of 2 instances"},
                {"WATCHDOG": "1"},
                {"STOPPING": "1", "STATUS": "bye"},
            ],
        )

    def test_abstractNamespace(self) -> None:
        manager = self.manager(abstract=True)
        self.notifier(manager).ready("serving")
        self.assertEqual(manager.pending(), [{"READY": "1", "STATUS": "serving"}])

    def test_watchdogOnlyWithASocket(self) -> None:
        manager = self.manager()
        self.assertEqual(self.notifier(manager, WATCHDOG_USEC="4000000").watchdog, 2.0)
        self.assertIsNone(Notifier.from_environment({"WATCHDOG_USEC": "4000000"}, 1).watchdog)

    def test_withoutASocketNothingIsSentAndNothingFails(self) -> None:
        notifier = Notifier.from_environment({}, 1)
        self.assertIsNone(notifier.address)
        notifier.ready("serving")  # no socket to send to: returns quietly
        self.assertEqual(self.flushLoggedErrors(), [])

    def test_aManagerGoneAwayIsWarnedOnceNeverRaised(self) -> None:
        manager = self.manager()
        notifier = self.notifier(manager)
        manager.close()
        os.unlink(manager.variable)
        warnings: list[str] = []

        @implementer(ILogObserver)
        def observe(event: LogEvent) -> None:
            if event.get("log_namespace") == "vmready.daemon.notify.Notifier":
                warnings.append(event["log_format"])

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        notifier.ready("serving")
        notifier.status("still")
        self.assertEqual(warnings, ["cannot notify the service manager at {address!r}: {error}"])


class ReconcileProgressTests(SynchronousTestCase):
    """STATUS lines while instances are reconciled: the first, the last, and one a period."""

    def test_progressIsThrottledButTheEndIsAlwaysSaid(self) -> None:
        sent: list[str] = []

        class Recording(Notifier):
            def status(self, text: str) -> None:
                sent.append(text)

        notifier = Recording()
        clock = Clock()
        progress = ReconcileProgress(notifier, 40, clock.seconds)
        for _ in range(11):
            progress.one_done()
        clock.advance(1.0)
        progress.one_done()
        for _ in range(28):
            progress.one_done()
        self.assertEqual(
            sent,
            [
                "reconciling 0 of 40 instances",
                "reconciling 12 of 40 instances",
                "reconciling 40 of 40 instances",
            ],
        )


class ServiceNotificationTests(TestCase):
    """VMReadyService in-process: READY only once the API serves, then the reconciliation."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-ns-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.manager = ManagerSocket(self.directory)
        self.addCleanup(self.manager.close)

    def service(self, watchdog: float | None = None) -> VMReadyService:
        self.socket_path = os.path.join(self.directory, "api.sock")
        config = DaemonConfig(data_dir=self.directory, listen=f"unix:{self.socket_path}")
        service = VMReadyService(reactor, config, Notifier(self.manager.variable, watchdog))
        self.addCleanup(service.stopService)
        return service

    def test_readyOnlyOnceReadyIsClearedAndTheAPIServes(self) -> Deferred[None]:
        async def check() -> None:
            instances(self.directory, "a", "b", "c")
            gate: Deferred[None] = Deferred()
            self.patch(lifecycle_core, "Recovery", recovery_waits_for(gate))
            service = self.service()
            service.startService()
            client = Client(reactor, self.socket_path)
            with self.assertRaises(DaemonUnreachable):
                await client.get("/1.0")
            self.assertEqual(self.manager.pending(), [])
            gate.callback(None)
            await service.recovered
            self.assertIn("api_status", await client.get("/1.0"))
            self.assertEqual(
                self.manager.pending(),
                [
                    {"READY": "1", "STATUS": "serving the API; reconciling instances"},
                    {"STATUS": "reconciling 0 of 3 instances"},
                    {"STATUS": "reconciling 3 of 3 instances"},
                    {"STATUS": "serving 3 instances"},
                ],
            )
            await service.stopService()
            self.assertEqual(
                self.manager.pending(),
                [
                    {
                        "STOPPING": "1",
                        "STATUS": "stopping: letting go of the VMs (they keep running)",
                    }
                ],
            )

        return ensureDeferred(check())

    def test_watchdogPingsFromTheReactor(self) -> Deferred[None]:
        async def check() -> None:
            service = self.service(watchdog=15.0)
            service.startService()
            await service.recovered
            timers = [child for child in service if child.name == WATCHDOG_TIMER]
            self.assertEqual(len(timers), 1)
            self.assertEqual((timers[0].step, timers[0].clock), (15.0, reactor))
            self.assertIn({"WATCHDOG": "1"}, self.manager.pending())  # the first ping: at once

        return ensureDeferred(check())

    def test_noWatchdogTimerWithoutAWatchdog(self) -> Deferred[None]:
        async def check() -> None:
            service = self.service()
            service.startService()
            await service.recovered
            self.assertEqual([child for child in service if child.name == WATCHDOG_TIMER], [])

        return ensureDeferred(check())


class DaemonUnderAManagerTests(SynchronousTestCase):
    """``twistd vmready`` as systemd runs it: $NOTIFY_SOCKET set, SIGTERM to stop."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-nd-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.socket_path = os.path.join(self.directory, "vmready.sock")

    def start(self, **environ: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, **environ}
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            if name not in environ:
                env.pop(name, None)
        daemon = subprocess.Popen(
            twistd(self.directory, "--config", ""),  # whatever /etc/vmready holds
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

        def stop() -> None:
            if daemon.poll() is None:
                daemon.kill()
            daemon.wait(timeout=DEADLINE)
            assert daemon.stdout is not None
            daemon.stdout.close()

        self.addCleanup(stop)
        return daemon

    def serving(self, **environment: str) -> subprocess.Popen[bytes]:
        """A daemon started with ``environment``, once its operator API answers."""
        daemon = self.start(**environment)
        wait_for_api(self, daemon, self.socket_path)
        return daemon

    def manager(self, abstract: bool = False) -> ManagerSocket:
        manager = ManagerSocket(self.directory, abstract)
        self.addCleanup(manager.close)
        return manager

    def stop(self, daemon: subprocess.Popen[bytes]) -> str:
        """SIGTERM, as systemctl stop sends; the daemon's output."""
        daemon.send_signal(signal.SIGTERM)
        # twistd ends by the signal that stopped it, once stopped: systemd takes that as clean.
        self.assertEqual(daemon.wait(timeout=DEADLINE), -signal.SIGTERM)
        assert daemon.stdout is not None
        return daemon.stdout.read().decode()

    def test_readyWhenTheAPIAnswersThenStatusThenStopping(self) -> None:
        instances(self.directory, "a", "b")
        manager = self.manager()
        daemon = self.start(NOTIFY_SOCKET=manager.variable)
        first = manager.next()
        self.assertEqual(first.get("READY"), "1", first)
        self.assertTrue(api_answers(self.socket_path))  # READY=1 was sent once the API served
        statuses: list[str] = []
        while not statuses or statuses[-1] != "serving 2 instances":
            statuses.append(manager.next()["STATUS"])
        self.assertEqual(statuses[0], "reconciling 0 of 2 instances")
        self.assertEqual(statuses[-2], "reconciling 2 of 2 instances")
        self.stop(daemon)
        self.assertEqual(manager.pending()[-1].get("STOPPING"), "1")

    def test_abstractSocketAndWatchdog(self) -> None:
        manager = self.manager(abstract=True)
        daemon = self.start(NOTIFY_SOCKET=manager.variable, WATCHDOG_USEC="400000")
        deadline = time.monotonic() + DEADLINE
        seen: list[dict[str, str]] = []
        ready = {"READY": "1", "STATUS": "serving the API; reconciling instances"}
        while ready not in seen or seen[seen.index(ready) :].count({"WATCHDOG": "1"}) < 3:
            self.assertLess(time.monotonic(), deadline)
            seen.append(manager.next())
        self.stop(daemon)

    def test_withoutNotifySocketTheDaemonRunsAsEver(self) -> None:
        daemon = self.serving()
        said = self.stop(daemon)
        self.assertNotIn("notify", said)
        self.assertNotIn("Traceback", said)

    def test_aMissingManagerSocketIsOneWarning(self) -> None:
        missing = os.path.join(self.directory, "gone.sock")
        daemon = self.serving(NOTIFY_SOCKET=missing)
        said = self.stop(daemon)
        self.assertEqual(said.count("cannot notify the service manager"), 1, said)
        self.assertNotIn("Traceback", said)


class MakeServiceTests(SynchronousTestCase):
    """makeService hands the service the notifier the environment asks for, then forgets it."""

    def test_theVariablesGoToTheNotifierNotToChildren(self) -> None:
        directory = tempfile.mkdtemp(prefix="vmr-nm-", dir="/tmp")
        self.addCleanup(shutil.rmtree, directory, True)
        notify = os.path.join(directory, "notify.sock")
        environ = {**os.environ, "NOTIFY_SOCKET": notify, "WATCHDOG_USEC": "10000000"}
        environ.pop("WATCHDOG_PID", None)
        self.patch(os, "environ", environ)
        self.patch(sys, "stderr", io.StringIO())  # the start-up summary
        options = Options()
        options.parseOptions(["--config", "", "--data-dir", directory])
        service = makeService(options)
        self.assertEqual((service.notifier.address, service.notifier.watchdog), (notify, 5.0))
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC"):
            self.assertNotIn(name, os.environ)
