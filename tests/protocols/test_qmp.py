"""Tests for vmready.protocols.qmp, the one QMP client."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from fakeqemu import RunningVM, parse_command_line
from fakeqemu.testing import InMemoryVM
from tests.reactor import reactor
from vmready.protocols.qmp import (
    QMPClientProtocol,
    QMPDisconnected,
    QMPError,
    QMPEvent,
    connect_qmp,
)

VM_ARGS = [
    "-machine",
    "q35",
    "-nodefaults",
    "-S",
    "-qmp",
    "unix:/vm/qmp.sock,server=on,wait=off",
    "-device",
    "virtio-serial-pci,id=vs0",
    "-chardev",
    "ringbuf,id=vmready,size=16",
    "-device",
    "virtserialport,chardev=vmready,name=com.canonical.lxd",
]


def _result(d: Deferred[Any]) -> list[Any]:
    box: list[Any] = []
    d.addBoth(box.append)
    return box


class QMPClientAgainstFakeQemuTests(SynchronousTestCase):
    """The client over in-memory transports to a fakeqemu monitor."""

    def setUp(self) -> None:
        self.vm = InMemoryVM(VM_ARGS)
        self.client = QMPClientProtocol()
        self.vm.connect_qmp(self.client)
        self.vm.flush()

    def test_negotiatesCapabilitiesAfterGreeting(self) -> None:
        self.assertTrue(self.client.negotiated)
        assert self.client.greeting is not None
        self.assertEqual(self.client.greeting["capabilities"], ["oob"])

    def test_commandsIssuedBeforeNegotiationWaitForIt(self) -> None:
        vm = InMemoryVM(VM_ARGS)
        client = QMPClientProtocol()
        pending = client.execute("query-status")
        vm.connect_qmp(client)
        vm.flush()
        self.assertEqual(self.successResultOf(pending)["status"], "prelaunch")

    def test_repliesAreMatchedToTheirCommandsById(self) -> None:
        status = self.client.execute("query-status")
        version = self.client.execute("query-version")
        self.vm.flush()
        self.assertEqual(self.successResultOf(version)["qemu"]["major"], 7)
        self.assertEqual(self.successResultOf(status)["status"], "prelaunch")

    def test_qemuErrorsAreTypedWithClassAndDesc(self) -> None:
        failed = self.client.execute("ringbuf-read", {"device": "nope", "size": 4})
        self.vm.flush()
        error = self.failureResultOf(failed, QMPError).value
        self.assertEqual(
            (error.command, error.error_class, error.desc),
            ("ringbuf-read", "GenericError", "Device 'nope' not found"),
        )

    def test_unknownCommandIsCommandNotFound(self) -> None:
        failed = self.client.execute("frobnicate")
        self.vm.flush()
        self.assertEqual(
            self.failureResultOf(failed, QMPError).value.error_class, "CommandNotFound"
        )

    def test_eventsReachEverySubscriberWithTimestamp(self) -> None:
        first: list[QMPEvent] = []
        second: list[QMPEvent] = []
        self.client.subscribe(first.append)
        self.client.subscribe(second.append)
        self.vm.clock.advance(12.5)
        self.client.execute("cont")
        self.vm.flush()
        self.assertEqual(first, [QMPEvent("RESUME", {}, 12.5)])
        self.assertEqual(second, first)

    def test_unsubscribedListenerGetsNothing(self) -> None:
        events: list[QMPEvent] = []
        unsubscribe = self.client.subscribe(events.append)
        unsubscribe()
        self.client.execute("cont")
        self.vm.flush()
        self.assertEqual(events, [])

    def test_failingListenerDoesNotStopOthers(self) -> None:
        events: list[QMPEvent] = []

        def broken(event: QMPEvent) -> None:
            raise RuntimeError("listener bug")

        self.client.subscribe(broken)
        self.client.subscribe(events.append)
        self.client.execute("cont")
        self.vm.flush()
        self.assertEqual([e.name for e in events], ["RESUME"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_quitFailsCommandsStillPendingWithDisconnect(self) -> None:
        quit_ = self.client.execute("quit")
        self.vm.advance(0)
        self.successResultOf(quit_)
        later = self.client.execute("query-status")
        self.vm.flush()
        self.assertIsInstance(self.failureResultOf(later).value, QMPDisconnected)
        self.assertFalse(self.client.is_open)
        self.successResultOf(self.client.when_closed())


class QMPClientProtocolErrorTests(SynchronousTestCase):
    """A peer that is not QMP, or goes away, is handled without tracebacks to the caller."""

    def setUp(self) -> None:
        self.client = QMPClientProtocol()
        self.transport = StringTransport()
        self.client.makeConnection(self.transport)

    def _greet(self) -> None:
        self.client.dataReceived(b'{"QMP": {"version": {}, "capabilities": []}}\r\n')
        request = json.loads(self.transport.value().splitlines()[-1])
        self.assertEqual(request["execute"], "qmp_capabilities")
        self.client.dataReceived(
            json.dumps({"return": {}, "id": request["id"]}).encode() + b"\r\n"
        )
        self.transport.clear()

    def assertReplyIgnored(self, reply: bytes) -> None:
        """After the greeting, ``reply`` to a pending command neither answers it nor
        breaks the connection."""
        self._greet()
        pending = self.client.execute("query-status")
        self.client.dataReceived(reply)
        self.assertNoResult(pending)
        self.assertFalse(self.transport.disconnecting)

    def test_sendsIdsAndArgumentsAsJSONLines(self) -> None:
        self._greet()
        self.client.execute("ringbuf-read", {"device": "r", "size": 4})
        self.assertEqual(
            json.loads(self.transport.value()),
            {"execute": "ringbuf-read", "id": 2, "arguments": {"device": "r", "size": 4}},
        )
        self.assertTrue(self.transport.value().endswith(b"\n"))

    def test_garbageFromPeerClosesWithProtocolError(self) -> None:
        self._greet()
        pending = self.client.execute("query-status")
        self.client.dataReceived(b"this is not json\r\n")
        self.assertTrue(self.transport.disconnecting)
        self.client.connectionLost(Failure(ConnectionError("closed")))
        error = self.failureResultOf(pending, QMPDisconnected).value
        self.assertIn("not JSON", str(error))
        self.assertEqual(len(self.flushLoggedErrors()), 0)

    def test_nonObjectFromPeerIsAProtocolError(self) -> None:
        self._greet()
        self.client.dataReceived(b"[1, 2]\r\n")
        self.assertTrue(self.transport.disconnecting)

    def test_overlongLineIsAProtocolError(self) -> None:
        self.client.MAX_LENGTH = 64
        self.client.dataReceived(b"{" + b" " * 100)
        self.assertTrue(self.transport.disconnecting)

    def test_replyWithUnknownIdIsIgnored(self) -> None:
        self.assertReplyIgnored(b'{"return": {}, "id": 999}\r\n')

    def test_disconnectDuringGreetingFailsWaiters(self) -> None:
        ready = self.client.when_ready()
        pending = self.client.execute("query-status")
        self.client.connectionLost(Failure(ConnectionError("socket vanished")))
        self.assertIsInstance(self.failureResultOf(ready).value, QMPDisconnected)
        self.assertIn("socket vanished", str(self.failureResultOf(pending).value))

    def test_everyPendingCommandFailsOnDisconnect(self) -> None:
        self._greet()
        first = self.client.execute("query-status")
        second = self.client.execute("query-version")
        self.client.connectionLost(Failure(ConnectionError("monitor is gone")))
        for pending, command in ((first, "query-status"), (second, "query-version")):
            error = self.failureResultOf(pending, QMPDisconnected).value
            self.assertIn(command, str(error))
            self.assertIn("monitor is gone", str(error))

    def test_malformedEventIsAProtocolErrorNotACrash(self) -> None:
        self._greet()
        events: list[QMPEvent] = []
        self.client.subscribe(events.append)
        self.client.dataReceived(b'{"event": "STOP", "data": [1], "timestamp": 5}\r\n')
        self.assertTrue(self.transport.disconnecting)
        self.assertEqual(events, [])

    def test_replyWithUnhashableIdIsIgnored(self) -> None:
        self.assertReplyIgnored(b'{"return": {}, "id": [1, 2]}\r\n')

    def test_secondGreetingIsAProtocolError(self) -> None:
        self._greet()
        self.client.dataReceived(b'{"QMP": {"version": {}, "capabilities": []}}\r\n')
        self.assertTrue(self.transport.disconnecting)

    def test_rejectedNegotiationFailsReadyWaiters(self) -> None:
        ready = self.client.when_ready()
        self.client.dataReceived(b'{"QMP": {"version": {}, "capabilities": []}}\r\n')
        request = json.loads(self.transport.value().splitlines()[-1])
        self.client.dataReceived(
            json.dumps(
                {"id": request["id"], "error": {"class": "GenericError", "desc": "no"}}
            ).encode()
            + b"\r\n"
        )
        self.assertEqual(self.failureResultOf(ready, QMPError).value.desc, "no")


class ConnectQMPTests(TestCase):
    """connect_qmp over a real unix socket to an in-process fakeqemu VM."""

    def setUp(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="vmr-qmp-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.socket_path = os.path.join(self.directory, "qmp.sock")

    def test_connectsAndNegotiatesOverUnixSocket(self) -> None:
        config = parse_command_line(
            ["-machine", "none", "-qmp", f"unix:{self.socket_path},server=on,wait=off"]
        )
        exits: list[int] = []
        vm = RunningVM(config, reactor, None, lambda status, lines: exits.append(status))
        vm.start()

        def stop_vm() -> Deferred[None]:
            if not exits:
                vm.kill()
            return vm.when_stopped()

        self.addCleanup(stop_vm)

        async def check() -> None:
            client = await connect_qmp(reactor, self.socket_path)
            self.assertEqual((await client.execute("query-status"))["status"], "running")
            client.close()
            await client.when_closed()

        return ensureDeferred(check())  # type: ignore[return-value]

    def test_missingSocketIsAClearDisconnect(self) -> None:
        async def check() -> None:
            with self.assertRaises(QMPDisconnected) as caught:
                await connect_qmp(reactor, self.socket_path, timeout=2)
            self.assertIn(self.socket_path, str(caught.exception))

        return ensureDeferred(check())  # type: ignore[return-value]

    def test_silentPeerTimesOut(self) -> None:
        class Silent(Protocol):
            """Accepts the connection and never greets."""

        port = reactor.listenUNIX(self.socket_path, Factory.forProtocol(Silent))

        async def check() -> None:
            try:
                with self.assertRaises(QMPDisconnected) as caught:
                    await connect_qmp(reactor, self.socket_path, timeout=0.2)
                self.assertIn("no QMP greeting", str(caught.exception))
            finally:
                stopped = port.stopListening()
                if stopped is not None:
                    await stopped

        return ensureDeferred(check())  # type: ignore[return-value]
