"""vmready.agent.sdnotify: READY=1 and STOPPING=1 to systemd over a real unix datagram socket."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from tests.agent.test_agent_service import Harness
from vmready.agent.apisocket import bind_socket
from vmready.agent.bootdata import BootData
from vmready.agent.sdnotify import NOTIFY_SOCKET, ServiceManager, datagram, notify_address


class Manager:
    """A service manager's notification socket: a bound unix datagram socket in a temp dir."""

    def __init__(self, test: SynchronousTestCase) -> None:
        base = tempfile.mkdtemp(prefix="vra-")
        test.addCleanup(shutil.rmtree, base, True)
        self.base = base
        self.path = os.path.join(base, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        test.addCleanup(self.sock.close)
        self.sock.bind(self.path)
        self.sock.setblocking(False)

    def received(self) -> list[bytes]:
        """Every datagram sent so far."""
        got = []
        while True:
            try:
                got.append(self.sock.recv(4096))
            except BlockingIOError:
                return got


class AddressTests(SynchronousTestCase):
    def test_pathIsAFileSystemSocket(self) -> None:
        self.assertEqual(notify_address("/run/systemd/notify"), "/run/systemd/notify")

    def test_atIsTheAbstractNamespace(self) -> None:
        self.assertEqual(notify_address("@systemd/notify"), b"\0systemd/notify")

    def test_unsetIsNone(self) -> None:
        self.assertEqual((notify_address(None), notify_address("")), (None, None))

    def test_vsockManagerIsNotReachedFromInside(self) -> None:
        self.assertIsNone(notify_address("vsock:2:1234"))


class DatagramTests(SynchronousTestCase):
    def test_linesOfKeyEqualsValue(self) -> None:
        self.assertEqual(datagram({"READY": "1", "STATUS": "serving"}), b"READY=1\nSTATUS=serving")

    def test_aValueStaysOnOneLine(self) -> None:
        self.assertEqual(datagram({"STATUS": "a\nb"}), b"STATUS=a b")


class ServiceManagerTests(SynchronousTestCase):
    def test_readyReachesTheManagersSocket(self) -> None:
        manager = Manager(self)
        ServiceManager(manager.path).ready("serving /dev/lxd/sock")
        self.assertEqual(manager.received(), [b"READY=1\nSTATUS=serving /dev/lxd/sock"])

    def test_stoppingReachesTheManagersSocket(self) -> None:
        manager = Manager(self)
        ServiceManager(manager.path).stopping("stopping")
        self.assertEqual(manager.received(), [b"STOPPING=1\nSTATUS=stopping"])

    def test_abstractSocketIsReached(self) -> None:
        name = f"vmready-test-{os.getpid()}-{id(self)}"
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.addCleanup(listening.close)
        listening.bind(b"\0" + name.encode())
        listening.settimeout(5)
        ServiceManager(notify_address("@" + name)).ready("up")
        self.assertEqual(listening.recv(4096), b"READY=1\nSTATUS=up")

    def test_environmentNamesTheManagerAndIsThenForgotten(self) -> None:
        environ = {NOTIFY_SOCKET: "/run/systemd/notify", "PATH": "/bin"}
        manager = ServiceManager.from_environment(environ)
        self.assertEqual((manager.address, environ), ("/run/systemd/notify", {"PATH": "/bin"}))

    def test_withoutTheVariableThereIsNoManager(self) -> None:
        self.assertIsNone(ServiceManager.from_environment({}).address)

    def test_unreachableManagerIsOneWarning(self) -> None:
        manager = Manager(self)
        gone = os.path.join(manager.base, "gone")
        warnings: list[str] = []

        class Collect(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                warnings.append(record.getMessage())

        handler = Collect(logging.WARNING)
        logger = logging.getLogger("vmready.agent.sdnotify")
        logger.addHandler(handler)
        self.addCleanup(logger.removeHandler, handler)
        notifier = ServiceManager(gone)
        notifier.ready("up")
        notifier.stopping("down")
        self.assertEqual(
            warnings,
            [f"cannot notify the service manager at {gone!r}: No such file or directory"],
        )


class AgentNotifiesTests(SynchronousTestCase):
    """The agent says READY=1 once its socket serves, STOPPING=1 when it stops."""

    def test_readyComesOnceTheSocketServesAndStoppingAtTheEnd(self) -> None:
        manager = Manager(self)
        harness = Harness(self)
        harness.agent.manager = ServiceManager(manager.path)
        path = os.path.join(manager.base, "lxd.sock")
        harness.agent.attach_socket(bind_socket(path), path)

        async def scenario() -> list[bytes]:
            await harness.start()
            said = manager.received()
            await harness.agent.stop()
            return said + manager.received()

        self.assertEqual(
            harness.run(scenario),
            [
                f"READY=1\nSTATUS=serving {path}; waiting for the host".encode(),
                b"STOPPING=1\nSTATUS=stopping",
            ],
        )

    def test_readySaysTheBootDataIsAnswered(self) -> None:
        manager = Manager(self)
        harness = Harness(self)
        harness.agent.manager = ServiceManager(manager.path)
        harness.agent.boot_data = BootData("instance-id: x\n")
        path = os.path.join(manager.base, "lxd.sock")
        harness.agent.attach_socket(bind_socket(path), path)

        async def scenario() -> list[bytes]:
            await harness.start()
            return manager.received()

        status = f"serving {path}; answering meta-data and config; waiting for the host"
        self.assertEqual(harness.run(scenario), [f"READY=1\nSTATUS={status}".encode()])
