"""Tests for fakeqemu._machine and fakeqemu._qmp, driven as a QMP client sees them.

Every VM here is a fakeqemu.testing.InMemoryVM: in-memory transports, a
task.Clock, no sockets.  Expected replies were measured on qemu-system-x86_64 7.2.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.protocol import Protocol, connectionDone
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from fakeqemu import RingBuffer
from fakeqemu._guest import CLOSE_SETTLE
from fakeqemu._runstate import RunState
from fakeqemu._wiring import SerialPort
from fakeqemu.testing import FakeGuest, InMemoryVM, raw_qmp_transport
from tests.fakeqemu.commandlines import (
    LEGACY_PORT,
    MACHINE,
    PORT,
    QMP_SOCKET,
    agent_port,
    legacy_port,
    qmp_option,
)

EPOCH = 1_700_000_000.25
VM_ARGV = [*MACHINE, *qmp_option(QMP_SOCKET), *agent_port(16), *legacy_port()]
GREETING = {
    "QMP": {
        "version": {"qemu": {"micro": 22, "minor": 2, "major": 7}, "package": "fakeqemu"},
        "capabilities": ["oob"],
    }
}
NEEDS_NEGOTIATION = {
    "class": "CommandNotFound",
    "desc": "Expecting capabilities negotiation with 'qmp_capabilities'",
}
EMPTY: dict[str, Any] = {"return": {}}


def generic(desc: str) -> dict[str, Any]:
    """QEMU's GenericError reply."""
    return {"error": {"class": "GenericError", "desc": desc}}


def timestamp(seconds: float) -> dict[str, int]:
    """The timestamp QEMU puts on an event emitted at ``seconds``."""
    whole = int(seconds)
    return {"seconds": whole, "microseconds": round((seconds - whole) * 1_000_000)}


class RecordingQMPClient(Protocol):
    """A monitor client that records every message QEMU sends it."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.connected = False
        self.lost = False
        self._buffer = b""

    def connectionMade(self) -> None:
        self.connected = True

    def dataReceived(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\r\n")
        self.messages.extend(json.loads(line) for line in lines)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost = True

    def send(self, request: dict[str, Any] | bytes) -> None:
        """Write a request (or raw bytes) to the monitor."""
        assert self.transport is not None
        data = request if isinstance(request, bytes) else json.dumps(request).encode()
        self.transport.write(data)

    def disconnect(self) -> None:
        """Close the connection from the client's side."""
        assert self.transport is not None
        self.transport.loseConnection()

    def replies(self) -> list[dict[str, Any]]:
        """Every command reply, in order."""
        return [m for m in self.messages if "return" in m or "error" in m]

    def events(self) -> list[dict[str, Any]]:
        """Every event, in order."""
        return [m for m in self.messages if "event" in m]

    def event_names(self) -> list[str]:
        """The names of every event, in order."""
        return [m["event"] for m in self.events()]


class _VMTestCase(SynchronousTestCase):
    """A fresh VM, a negotiated client, and helpers to talk to them."""

    argv: list[str] = VM_ARGV

    def setUp(self) -> None:
        self.vm = self.make_vm(self.argv)
        self.client = self.connect()

    def make_vm(self, argv: list[str], files: dict[str, bytes] | None = None) -> InMemoryVM:
        """A VM whose clock reads a realistic time."""
        vm = InMemoryVM(argv, files=files)
        vm.clock.advance(EPOCH)
        return vm

    def connect(self, negotiate: bool = True) -> RecordingQMPClient:
        """A client connected to the VM's monitor, negotiated unless told otherwise."""
        client = RecordingQMPClient()
        self.vm.connect_qmp(client)
        self.vm.flush()
        if negotiate:
            self.assertEqual(self.send({"execute": "qmp_capabilities"}, client), EMPTY)
            client.messages.clear()
        return client

    def send(
        self, request: dict[str, Any] | bytes, client: RecordingQMPClient | None = None
    ) -> dict[str, Any]:
        """Send a request and return the one reply it caused."""
        client = client if client is not None else self.client
        before = len(client.replies())
        client.send(request)
        self.vm.flush()
        replies = client.replies()[before:]
        self.assertEqual(len(replies), 1, replies)
        return replies[0]

    def execute(self, command: str, **arguments: Any) -> dict[str, Any]:
        """Run a command and return its reply."""
        request: dict[str, Any] = {"execute": command}
        if arguments:
            request["arguments"] = arguments
        return self.send(request)

    def status(self) -> str:
        """The run state ``query-status`` reports."""
        reply = self.execute("query-status")
        status: str = reply["return"]["status"]
        self.assertEqual(reply["return"]["running"], status == "running")
        return status

    def read(self, size: int = 100, format: str = "utf8", device: str = "vmready") -> Any:
        """``ringbuf-read``'s result (or its error reply)."""
        reply = self.execute("ringbuf-read", device=device, size=size, format=format)
        return reply.get("return", reply)

    def write(self, data: str, format: str = "utf8", device: str = "vmready") -> dict[str, Any]:
        """``ringbuf-write``'s reply."""
        return self.execute("ringbuf-write", device=device, data=data, format=format)

    def guest(self, name: str = PORT) -> FakeGuest:
        """A guest process holding the named port open."""
        guest = self.vm.connect_guest(name)
        self.vm.flush()
        return guest

    def port(self, name: str = PORT) -> SerialPort:
        """The machine's port of that name."""
        port = self.vm.machine.wiring.find_port(name)
        assert port is not None
        return port

    def enable_migration_events(self) -> None:
        """Turn on the ``events`` migration capability."""
        reply = self.execute(
            "migrate-set-capabilities", capabilities=[{"capability": "events", "state": True}]
        )
        self.assertEqual(reply, EMPTY)


class GreetingTests(_VMTestCase):
    """The greeting every new monitor connection gets."""

    def test_greetingNamesQemu72AndOffersOob(self) -> None:
        client = RecordingQMPClient()
        self.client.disconnect()
        self.vm.connect_qmp(client)
        self.vm.flush()
        self.assertEqual(client.messages, [GREETING])

    def test_queryVersionMatchesTheGreeting(self) -> None:
        self.assertEqual(self.execute("query-version"), {"return": GREETING["QMP"]["version"]})

    def test_greetingIsTheFirstLineOnTheWire(self) -> None:
        self.client.disconnect()
        self.vm.flush()
        _, transport = raw_qmp_transport(self.vm)
        self.assertEqual(
            transport.value(),
            b'{"QMP": {"version": {"qemu": {"micro": 22, "minor": 2, "major": 7}, '
            b'"package": "fakeqemu"}, "capabilities": ["oob"]}}\r\n',
        )


class NegotiationTests(_VMTestCase):
    """qmp_capabilities must come first, once."""

    def setUp(self) -> None:
        self.vm = self.make_vm(self.argv)
        self.client = self.connect(negotiate=False)

    def test_commandBeforeNegotiationIsRefused(self) -> None:
        self.assertEqual(self.execute("query-status"), {"error": NEEDS_NEGOTIATION})

    def test_unknownCommandBeforeNegotiationAlsoAsksForNegotiation(self) -> None:
        self.assertEqual(self.execute("nope"), {"error": NEEDS_NEGOTIATION})

    def test_negotiationThenCommandsWork(self) -> None:
        self.assertEqual(
            [self.execute("qmp_capabilities"), self.execute("query-status")["return"]["status"]],
            [EMPTY, "running"],
        )

    def test_secondNegotiationIsRefused(self) -> None:
        self.execute("qmp_capabilities")
        self.assertEqual(
            self.execute("qmp_capabilities"),
            {
                "error": {
                    "class": "CommandNotFound",
                    "desc": "Capabilities negotiation is already complete, command ignored",
                }
            },
        )

    def test_unknownCapabilityIsRefusedAndNothingIsNegotiated(self) -> None:
        self.assertEqual(
            [self.execute("qmp_capabilities", enable=["bogus"]), self.execute("query-status")],
            [
                generic("Parameter 'null' does not accept value 'bogus'"),
                {"error": NEEDS_NEGOTIATION},
            ],
        )

    def test_enableMustBeAListOfStrings(self) -> None:
        self.assertEqual(
            [
                self.execute("qmp_capabilities", enable="oob"),
                self.execute("qmp_capabilities", enable=[1]),
            ],
            [
                generic("Invalid parameter type for 'enable', expected: array"),
                generic("Invalid parameter type for 'enable[0]', expected: string"),
            ],
        )

    def test_oobCanBeEnabled(self) -> None:
        self.assertEqual(self.execute("qmp_capabilities", enable=["oob"]), EMPTY)

    def test_eventsAreNotSentBeforeNegotiation(self) -> None:
        self.vm.machine.stop()
        self.vm.flush()
        self.execute("qmp_capabilities")
        self.vm.machine.cont()
        self.vm.flush()
        self.assertEqual(self.client.event_names(), ["RESUME"])


class EnvelopeTests(_VMTestCase):
    """The request object around a command, checked as QEMU checks it."""

    def test_nonObjectIsRefused(self) -> None:
        self.assertEqual(self.send(b"[1] "), generic("QMP input must be a JSON object"))

    def test_requestWithoutExecuteIsRefusedWithItsId(self) -> None:
        self.assertEqual(
            self.send({"id": 1}),
            {"id": 1, **generic("QMP input lacks member 'execute'")},
        )

    def test_unexpectedMemberIsRefused(self) -> None:
        self.assertEqual(
            self.send({"execute": "query-status", "foo": 1}),
            generic("QMP input member 'foo' is unexpected"),
        )

    def test_controlIsNotAMemberInQemu72(self) -> None:
        self.assertEqual(
            self.send({"execute": "query-status", "control": {}}),
            generic("QMP input member 'control' is unexpected"),
        )

    def test_executeMustBeAString(self) -> None:
        self.assertEqual(
            self.send({"execute": 1}), generic("QMP input member 'execute' must be a string")
        )

    def test_argumentsMustBeAnObject(self) -> None:
        self.assertEqual(
            self.send({"execute": "query-status", "arguments": []}),
            generic("QMP input member 'arguments' must be an object"),
        )

    def test_unknownCommandIsCommandNotFound(self) -> None:
        self.assertEqual(
            self.execute("nope"),
            {"error": {"class": "CommandNotFound", "desc": "The command nope has not been found"}},
        )

    def test_execOobIsUnexpectedWithoutTheOobCapability(self) -> None:
        self.assertEqual(
            self.send({"exec-oob": "query-status"}),
            generic("QMP input member 'exec-oob' is unexpected"),
        )

    def test_queryCommandsListsEveryCommand(self) -> None:
        names = {c["name"] for c in self.execute("query-commands")["return"]}
        self.assertTrue(
            {"query-status", "ringbuf-read", "ringbuf-write", "migrate", "quit"} <= names, names
        )


class OutOfBandTests(_VMTestCase):
    """With oob enabled, exec-oob is a member, but no emulated command runs out of band."""

    def setUp(self) -> None:
        self.vm = self.make_vm(self.argv)
        self.client = self.connect(negotiate=False)
        self.assertEqual(self.execute("qmp_capabilities", enable=["oob"]), EMPTY)

    def test_commandsDoNotSupportOob(self) -> None:
        self.assertEqual(
            self.send({"exec-oob": "query-status", "id": 2}),
            {"id": 2, **generic("The command query-status does not support OOB")},
        )

    def test_unknownOobCommandIsCommandNotFound(self) -> None:
        self.assertEqual(
            self.send({"exec-oob": "nope"}),
            {"error": {"class": "CommandNotFound", "desc": "The command nope has not been found"}},
        )

    def test_executeAndExecOobClash(self) -> None:
        self.assertEqual(
            self.send({"execute": "query-status", "exec-oob": "query-status"}),
            generic("QMP input member 'execute' clashes with 'exec-oob'"),
        )


class WireFormatTests(_VMTestCase):
    """The bytes QEMU writes: member order, separators, CRLF."""

    def setUp(self) -> None:
        self.vm = self.make_vm(self.argv)
        self.server, self.transport = raw_qmp_transport(self.vm)
        self.transport.clear()

    def exchange(self, data: bytes) -> bytes:
        """Feed bytes to the monitor and return what it wrote back."""
        self.transport.clear()
        self.server.dataReceived(data)
        value: bytes = self.transport.value()
        return value

    def test_errorReplyPutsIdFirst(self) -> None:
        self.assertEqual(
            self.exchange(b'{"execute":"query-status","id":7}'),
            b'{"id": 7, "error": {"class": "CommandNotFound", '
            b'"desc": "Expecting capabilities negotiation with \'qmp_capabilities\'"}}\r\n',
        )

    def test_returnPutsIdLast(self) -> None:
        self.assertEqual(
            self.exchange(b'{"execute":"qmp_capabilities","id":"a"}'),
            b'{"return": {}, "id": "a"}\r\n',
        )

    def test_replyWithoutIdHasNoId(self) -> None:
        self.assertEqual(self.exchange(b'{"execute":"qmp_capabilities"}'), b'{"return": {}}\r\n')

    def test_idOfAnyJsonTypeIsEchoedAsGiven(self) -> None:
        self.exchange(b'{"execute":"qmp_capabilities"}')
        self.assertEqual(
            [
                self.exchange(b'{"id":{"x":1},"execute":"nope"}'),
                self.exchange(b'{"execute":"query-status","id":[1,2]}'),
            ],
            [
                b'{"id": {"x": 1}, "error": {"class": "CommandNotFound", '
                b'"desc": "The command nope has not been found"}}\r\n',
                b'{"return": {"status": "running", "singlestep": false, "running": true}, '
                b'"id": [1, 2]}\r\n',
            ],
        )

    def test_eventWireShape(self) -> None:
        self.exchange(b'{"execute":"qmp_capabilities"}')
        self.assertEqual(
            self.exchange(b'{"execute":"stop"}'),
            b'{"timestamp": {"seconds": 1700000000, "microseconds": 250000}, "event": "STOP"}\r\n'
            b'{"return": {}}\r\n',
        )

    def test_twoCommandsInOneWriteGetTwoReplies(self) -> None:
        self.exchange(b'{"execute":"qmp_capabilities"}')
        self.assertEqual(
            self.exchange(b'{"execute":"query-version"}{"execute":"query-version"}').count(
                b'"return": {"qemu"'
            ),
            2,
        )


class ArgumentTests(_VMTestCase):
    """Arguments checked in schema order, with QEMU's messages."""

    def test_missingArgument(self) -> None:
        self.assertEqual(
            self.execute("ringbuf-read", device="vmready"), generic("Parameter 'size' is missing")
        )

    def test_missingArgumentsReportedInSchemaOrder(self) -> None:
        self.assertEqual(
            self.execute("ringbuf-read", size="x", extra=1),
            generic("Parameter 'device' is missing"),
        )

    def test_wrongType(self) -> None:
        expected = generic("Invalid parameter type for 'size', expected: integer")
        self.assertEqual(
            [self.execute("ringbuf-read", device="vmready", size=v) for v in ("1", 1.5, True)],
            [expected, expected, expected],
        )

    def test_unexpectedArgument(self) -> None:
        self.assertEqual(
            self.execute("ringbuf-read", device="vmready", size=1, extra=1),
            generic("Parameter 'extra' is unexpected"),
        )

    def test_argumentsToACommandWithoutParameters(self) -> None:
        self.assertEqual(self.execute("query-status", x=1), generic("Parameter 'x' is unexpected"))

    def test_enumValueOutsideTheEnum(self) -> None:
        self.assertEqual(
            self.execute("ringbuf-read", device="vmready", size=1, format="hex"),
            generic("Parameter 'format' does not accept value 'hex'"),
        )


class JsonErrorTests(_VMTestCase):
    """Parse errors are answered and the session carries on."""

    def test_invalidKeywordIsAnsweredAndSessionKept(self) -> None:
        self.assertEqual(
            [self.send(b"xyz\n"), self.status()],
            [generic("JSON parse error, invalid keyword 'xyz'"), "running"],
        )

    def test_strayByteIsAnsweredAndSessionKept(self) -> None:
        self.assertEqual(
            [self.send(b"@\n"), self.status()],
            [generic("JSON parse error, stray '@'"), "running"],
        )

    def test_unbalancedInputIsNotAnswered(self) -> None:
        self.client.send(b'{"execute":"query-status"')
        self.vm.flush()
        self.assertEqual(self.client.messages, [])

    def test_commandsNeedNoNewline(self) -> None:
        self.client.send(b'{"execute":"query-version"}{"execute":"query-version"}')
        self.vm.flush()
        self.assertEqual(len(self.client.replies()), 2)


class RunStateTests(_VMTestCase):
    """query-status through prelaunch, running, paused, postmigrate and inmigrate."""

    def test_runningWithoutMinusS(self) -> None:
        self.assertEqual(
            self.execute("query-status"),
            {"return": {"status": "running", "singlestep": False, "running": True}},
        )

    def test_prelaunchWithMinusS(self) -> None:
        self.vm = self.make_vm([*VM_ARGV, "-S"])
        self.client = self.connect()
        self.assertEqual(
            self.execute("query-status"),
            {"return": {"status": "prelaunch", "singlestep": False, "running": False}},
        )

    def test_contLeavesPrelaunchWithResume(self) -> None:
        self.vm = self.make_vm([*VM_ARGV, "-S"])
        self.client = self.connect()
        self.assertEqual(
            (self.execute("cont"), self.status(), self.client.event_names()),
            (EMPTY, "running", ["RESUME"]),
        )

    def test_stopInPrelaunchChangesNothing(self) -> None:
        self.vm = self.make_vm([*VM_ARGV, "-S"])
        self.client = self.connect()
        self.assertEqual(
            (self.execute("stop"), self.status(), self.client.event_names()),
            (EMPTY, "prelaunch", []),
        )

    def test_stopPausesWithStop(self) -> None:
        self.assertEqual(
            (self.execute("stop"), self.status(), self.client.event_names()),
            (EMPTY, "paused", ["STOP"]),
        )

    def test_stopEventPrecedesTheReturn(self) -> None:
        self.execute("stop")
        self.assertEqual(
            [m.get("event", "return") for m in self.client.messages], ["STOP", "return"]
        )

    def test_contResumesWithResume(self) -> None:
        self.execute("stop")
        self.assertEqual(
            (self.execute("cont"), self.status(), self.client.event_names()),
            (EMPTY, "running", ["STOP", "RESUME"]),
        )

    def test_stopWhenPausedAndContWhenRunningAreSilent(self) -> None:
        self.execute("cont")
        self.execute("stop")
        self.execute("stop")
        self.assertEqual(self.client.event_names(), ["STOP"])

    def test_inmigrateWhileTheStreamIsMissing(self) -> None:
        self.vm = self.make_vm([*VM_ARGV, "-incoming", "exec:cat /state"])
        self.client = self.connect()
        self.assertEqual(self.status(), "inmigrate")

    def test_contDuringIncomingMigrationOnlyArmsAutostart(self) -> None:
        self.vm = self.make_vm([*VM_ARGV, "-S", "-incoming", "exec:cat /state"])
        self.client = self.connect()
        self.assertEqual(
            (self.execute("cont"), self.status(), self.client.event_names()),
            (EMPTY, "inmigrate", []),
        )

    def test_autostartArmedByContResumesOnceTheStreamLoads(self) -> None:
        self.vm = self.make_vm([*VM_ARGV, "-S", "-incoming", "exec:cat /state"])
        self.client = self.connect()
        self.execute("cont")
        self.vm.machine.migration.load_incoming(self.saved_state())
        self.vm.flush()
        self.assertEqual((self.status(), self.client.event_names()), ("running", ["RESUME"]))

    def test_stopDuringIncomingMigrationKeepsTheVmPausedAfterLoading(self) -> None:
        self.vm = self.make_vm([*VM_ARGV, "-incoming", "exec:cat /state"])
        self.client = self.connect()
        self.execute("stop")
        self.vm.machine.migration.load_incoming(self.saved_state())
        self.vm.flush()
        self.assertEqual((self.status(), self.client.event_names()), ("paused", []))

    def test_postmigrateAfterMigrating(self) -> None:
        self.execute("migrate", uri="exec:cat > /state")
        self.vm.advance()
        self.assertEqual(self.status(), "postmigrate")

    def test_shutdownOnceTheMachineExited(self) -> None:
        self.execute("quit")
        self.vm.advance()
        self.assertEqual(self.vm.machine.query_status()["status"], "shutdown")

    def saved_state(self) -> bytes:
        """A state file from a VM with this test's devices."""
        source = InMemoryVM(VM_ARGV)
        source.machine.migration.migrate("exec:cat > /state", source.files.__setitem__)
        source.advance()
        return source.files["/state"]


class EventTimestampTests(_VMTestCase):
    """Events carry QEMU's timestamp shape, read from the injected clock."""

    def test_timestampIsSecondsAndMicroseconds(self) -> None:
        self.execute("stop")
        self.assertEqual(self.client.events(), [{"timestamp": timestamp(EPOCH), "event": "STOP"}])

    def test_timestampFollowsTheClock(self) -> None:
        self.execute("stop")
        self.vm.advance(2.5)
        self.execute("cont")
        self.assertEqual(
            [e["timestamp"] for e in self.client.events()],
            [timestamp(EPOCH), timestamp(EPOCH + 2.5)],
        )

    def test_oneMicrosecondIsNotLostToRounding(self) -> None:
        vm = InMemoryVM(VM_ARGV)
        vm.clock.advance(1.000001)
        events: list[dict[str, Any]] = []
        vm.machine.subscribe(events.append)
        vm.machine.stop()
        self.assertEqual(events[0]["timestamp"], {"seconds": 1, "microseconds": 1})

    def test_unsubscribedListenerGetsNoMoreEvents(self) -> None:
        events: list[dict[str, Any]] = []
        unsubscribe = self.vm.machine.subscribe(events.append)
        self.vm.machine.stop()
        unsubscribe()
        self.vm.machine.cont()
        self.assertEqual([e["event"] for e in events], ["STOP"])


class PowerTests(_VMTestCase):
    """Power button, reset, quit, and what the guest itself does."""

    def test_powerdownPressesTheButton(self) -> None:
        self.assertEqual(
            (self.execute("system_powerdown"), self.client.event_names(), self.status()),
            (EMPTY, ["POWERDOWN"], "running"),
        )

    def test_powerdownReachesAConnectedControlChannel(self) -> None:
        control = self.vm.connect_control()
        self.vm.flush()
        self.execute("system_powerdown")
        self.assertEqual(control.received, b"POWERDOWN\n")

    def test_resetIsAHostReset(self) -> None:
        self.execute("system_reset")
        self.assertEqual(
            [(e["event"], e["data"]) for e in self.client.events()],
            [("RESET", {"guest": False, "reason": "host-qmp-system-reset"})],
        )

    def test_resetClosesGuestPortsAndKeepsRunning(self) -> None:
        guest = self.guest()
        self.execute("system_reset")
        self.assertEqual((guest.open, self.port().guest, self.status()), (False, None, "running"))

    def test_quitAnnouncesShutdownBeforeItsReturn(self) -> None:
        self.execute("quit")
        self.assertEqual(
            [m.get("event", "return") for m in self.client.messages], ["SHUTDOWN", "return"]
        )
        self.assertEqual(
            self.client.events()[0]["data"], {"guest": False, "reason": "host-qmp-quit"}
        )

    def test_quitExitsAndDropsTheMonitor(self) -> None:
        self.execute("quit")
        self.vm.advance()
        self.assertEqual((self.vm.exits, self.client.lost), ([(0, [])], True))

    def test_quitClosesGuestPorts(self) -> None:
        guest = self.guest()
        self.execute("quit")
        self.vm.advance()
        self.assertFalse(guest.open)

    def test_guestPoweroffShutsDownAndExits(self) -> None:
        control = self.vm.connect_control()
        self.vm.flush()
        control.write(b"poweroff\n")
        self.vm.advance()
        self.assertEqual(
            (control.received, [(e["event"], e.get("data")) for e in self.client.events()]),
            (b"ok\n", [("SHUTDOWN", {"guest": True, "reason": "guest-shutdown"})]),
        )
        self.assertEqual((self.vm.exits, self.client.lost), ([(0, [])], True))

    def test_guestRebootResetsAndClosesPorts(self) -> None:
        guest = self.guest()
        control = self.vm.connect_control()
        self.vm.flush()
        control.write(b"reboot\n")
        self.vm.advance()
        self.assertEqual(
            [(e["event"], e.get("data")) for e in self.client.events()],
            [("RESET", {"guest": True, "reason": "guest-reset"})],
        )
        self.assertEqual((guest.open, self.status(), self.vm.exits), (False, "running", []))

    def test_guestPanicWithoutPvpanicIsInvisibleToTheHost(self) -> None:
        control = self.vm.connect_control()
        self.vm.flush()
        control.write(b"panic\n")
        self.vm.advance(60)
        self.assertEqual(
            (self.client.events(), self.status(), self.vm.exits, control.received),
            ([], "running", [], b"ok\n"),
        )

    def test_unknownGuestActionIsAnsweredWithAnError(self) -> None:
        control = self.vm.connect_control()
        self.vm.flush()
        control.write(b"dance\n")
        self.vm.flush()
        self.assertEqual(
            control.received, b"error: unknown action 'dance' (known: panic, poweroff, reboot)\n"
        )


class ChardevQueryTests(_VMTestCase):
    """query-chardev: ring buffers with frontend-open, then the monitors."""

    def chardevs(self) -> list[dict[str, Any]]:
        """query-chardev's result."""
        result: list[dict[str, Any]] = self.execute("query-chardev")["return"]
        return result

    def test_ringbufClosedUntilAGuestOpensItsPort(self) -> None:
        self.assertEqual(
            self.chardevs(),
            [
                {"frontend-open": False, "filename": "ringbuf", "label": "vmready"},
                {
                    "frontend-open": True,
                    "filename": f"unix:{QMP_SOCKET},server=on",
                    "label": "compat_monitor0",
                },
            ],
        )

    def test_frontendOpenWhileAGuestHoldsThePort(self) -> None:
        self.guest()
        self.assertTrue(self.chardevs()[0]["frontend-open"])

    def test_frontendClosedAgainWhenTheGuestDisconnects(self) -> None:
        guest = self.guest()
        guest.close()
        self.vm.flush()
        self.assertFalse(self.chardevs()[0]["frontend-open"])

    def test_guestOnAPortWithoutChardevOpensNoRingbuf(self) -> None:
        self.guest(LEGACY_PORT)
        self.assertFalse(self.chardevs()[0]["frontend-open"])

    def test_everyMonitorIsListed(self) -> None:
        self.vm = self.make_vm([*VM_ARGV, "-qmp", "unix:/vm/second.sock,server=on,wait=off"])
        self.client = self.connect()
        self.assertEqual(
            [(c["label"], c["filename"]) for c in self.chardevs()[1:]],
            [
                ("compat_monitor0", f"unix:{QMP_SOCKET},server=on"),
                ("compat_monitor1", "unix:/vm/second.sock,server=on"),
            ],
        )


class RingbufCommandTests(_VMTestCase):
    """ringbuf-read and ringbuf-write as QEMU serves them."""

    def test_utf8RoundTrip(self) -> None:
        self.assertEqual((self.write("caf\u00e9\n"), self.read()), (EMPTY, "caf\u00e9\n"))

    def test_base64RoundTrip(self) -> None:
        self.write("AAEC/w==", format="base64")
        self.assertEqual(self.read(format="base64"), "AAEC/w==")

    def test_formatDefaultsToUtf8(self) -> None:
        self.execute("ringbuf-write", device="vmready", data="hi")
        self.assertEqual(self.execute("ringbuf-read", device="vmready", size=10), {"return": "hi"})

    def test_base64ReadOfUtf8Text(self) -> None:
        self.write("caf\u00e9")
        self.assertEqual(self.read(format="base64"), "Y2Fmw6k=")

    def test_readDrains(self) -> None:
        self.write("STARTED\n")
        self.assertEqual((self.read(3), self.read(), self.read()), ("STA", "RTED\n", ""))

    def test_overflowKeepsNewestBytes(self) -> None:
        self.write("CONNECT 2:1234567\n")
        self.assertEqual(self.read(), "NNECT 2:1234567\n")

    def test_hostWritesStayInTheBufferAndNeverReachTheGuest(self) -> None:
        # QEMU's ringbuf-write fills the ring buffer; its frontend is never told.
        guest = self.guest()
        self.write("CONNECT 2:1234\n")
        self.vm.flush()
        self.assertEqual((guest.received, self.read()), (b"", "CONNECT 2:1234\n"))

    def test_base64WriteStoresRawBytesOnly(self) -> None:
        guest = self.guest()
        self.write("AAEC/w==", format="base64")
        self.vm.flush()
        self.assertEqual((guest.received, self.read(format="base64")), (b"", "AAEC/w=="))

    def test_guestWritesLandInTheRingbuf(self) -> None:
        guest = self.guest()
        guest.write(b"STARTED\n")
        self.vm.flush()
        self.assertEqual(self.read(), "STARTED\n")

    def test_utf8ReadStopsAtNulAndDrainsTheRest(self) -> None:
        guest = self.guest()
        guest.write(b"ab\x00cd")
        self.vm.flush()
        self.assertEqual((self.read(), self.read()), ("ab", ""))

    def test_utf8ReadReplacesInvalidBytes(self) -> None:
        guest = self.guest()
        guest.write(b"x\xff\xfey\xc3")
        self.vm.flush()
        self.assertEqual(self.read(), "x\ufffd\ufffdy\ufffd")

    def test_base64ReadKeepsEveryByte(self) -> None:
        guest = self.guest()
        guest.write(b"ab\x00\xff")
        self.vm.flush()
        self.assertEqual(self.read(format="base64"), "YWIA/w==")

    def test_utf8WriteOfNulStoresModifiedUtf8(self) -> None:
        self.write("a\u0000b")
        self.assertEqual(self.read(format="base64"), "YcCAYg==")

    def test_invalidBase64IsRefusedAndNothingWritten(self) -> None:
        guest = self.guest()
        self.assertEqual(
            (self.write("YWJj!", format="base64"), self.read(), guest.received),
            (generic("Base64 data contains invalid characters"), "", b""),
        )

    def test_unknownDevice(self) -> None:
        expected = generic("Device 'nope' not found")
        self.assertEqual(
            [self.read(device="nope"), self.write("x", device="nope")], [expected, expected]
        )

    def test_unknownDeviceIsReportedBeforeBadBase64(self) -> None:
        self.assertEqual(
            self.write("!!", format="base64", device="nope"), generic("Device 'nope' not found")
        )

    def test_monitorIsNotARingbuf(self) -> None:
        self.assertEqual(
            self.read(device="compat_monitor0"),
            generic("compat_monitor0 is not a ringbuf device"),
        )

    def test_sizeMustBePositive(self) -> None:
        expected = generic("size must be greater than zero")
        self.assertEqual([self.read(0), self.read(-1)], [expected, expected])

    def test_secondGuestOnTheSamePortIsRefused(self) -> None:
        """Once the holder stays for CLOSE_SETTLE: its close might only be late to be read."""
        first = self.guest()
        second = self.guest()
        self.vm.advance(CLOSE_SETTLE - 0.01)
        self.assertEqual((first.open, second.open), (True, True))
        self.vm.advance(0.01)
        self.assertEqual((first.open, second.open), (True, False))

    def test_aGuestThatReopensAtOnceHasThePort(self) -> None:
        """Close and open at once (an agent's announcement), the close read late: no refusal."""
        first = self.guest()
        second = self.vm.connect_guest(PORT)
        second.write(b"CONNECTED\n")
        self.vm.flush()
        first.close()
        self.vm.flush()
        self.assertEqual((second.open, self.port().guest is not None), (True, True))
        self.assertEqual(self.read(), "CONNECTED\n")
        self.assertEqual(self.vm.clock.getDelayedCalls(), [])

    def test_aReplacedRingbufTakesTheGuestsWritesAndTheReads(self) -> None:
        guest = self.guest()
        original = self.vm.machine.wiring.replace_ringbuf("vmready", RingBuffer(16))
        guest.write(b"STARTED\n")
        self.vm.flush()
        self.assertEqual((len(original), self.read()), (0, "STARTED\n"))

    def test_whatARefusedGuestSendsIsDropped(self) -> None:
        self.guest()
        second = self.vm.connect_guest(PORT)
        second.write(b"SPOOFED\n")
        self.vm.advance(CLOSE_SETTLE)
        self.assertEqual((second.open, self.read()), (False, ""))

    def test_refusedGuestDoesNotDisturbTheHolder(self) -> None:
        first = self.guest()
        self.guest()
        first.write(b"hello\n")
        self.vm.flush()
        self.assertEqual((self.read(), self.port().guest is not None), ("hello\n", True))

    def test_portCanBeReopenedAfterTheGuestCloses(self) -> None:
        first = self.guest()
        first.close()
        self.vm.flush()
        second = self.guest()
        second.write(b"again\n")
        self.vm.flush()
        self.assertEqual((second.open, self.read()), (True, "again\n"))

    def test_portWithoutChardevDiscardsWrites(self) -> None:
        guest = self.guest(LEGACY_PORT)
        guest.write(b"STARTED\n")
        self.vm.flush()
        self.assertEqual((guest.open, self.read()), (True, ""))

    def test_writesWithoutAGuestOnlyFillTheBuffer(self) -> None:
        self.write("x")
        self.assertEqual(self.read(), "x")


CONNECT_PORT = "vmready.connect"
SOCKET_ARGV = [
    *VM_ARGV,
    "-chardev",
    "socket,id=vmready-connect,path=/vm/connect.sock,server=on,wait=off",
    "-device",
    f"virtserialport,chardev=vmready-connect,name={CONNECT_PORT},bus=vs0.0,id={CONNECT_PORT}",
]


class SocketChardevTests(_VMTestCase):
    """A port wired to a ``socket`` chardev: the host's way to write to a guest."""

    argv = SOCKET_ARGV

    def host(self) -> FakeGuest:
        """A host process connected to the chardev's socket."""
        client = self.vm.connect_chardev("vmready-connect")
        self.vm.flush()
        return client

    def chardev(self) -> dict[str, Any]:
        chardevs = self.execute("query-chardev")["return"]
        found: dict[str, Any] = next(c for c in chardevs if c["label"] == "vmready-connect")
        return found

    def test_hostBytesReachTheGuestAndGuestBytesTheHost(self) -> None:
        guest = self.guest(CONNECT_PORT)
        host = self.host()
        host.write(b"CONNECT 2:1234\n")
        guest.write(b"ok\n")
        self.vm.flush()
        self.assertEqual((guest.received, host.received), (b"CONNECT 2:1234\n", b"ok\n"))

    def test_bytesSentBeforeTheGuestOpensWaitForIt(self) -> None:
        host = self.host()
        host.write(b"CONNECT 2:1234\n")
        self.vm.flush()
        guest = self.guest(CONNECT_PORT)
        self.assertEqual(guest.received, b"CONNECT 2:1234\n")

    def test_aSecondClientWaitsUntilTheFirstLeaves(self) -> None:
        guest = self.guest(CONNECT_PORT)
        first = self.host()
        second = self.host()
        second.write(b"CONNECT 2:2\n")
        self.vm.flush()
        before = guest.received
        first.close()
        self.vm.flush()
        self.assertEqual((before, guest.received), (b"", b"CONNECT 2:2\n"))

    def test_queryChardevSaysWhetherAClientIsConnected(self) -> None:
        alone = self.chardev()
        host = self.host()
        served = self.chardev()
        host.close()
        self.vm.flush()
        self.assertEqual(
            [alone["filename"], served["filename"], self.chardev()["filename"]],
            [
                "disconnected:unix:/vm/connect.sock,server=on",
                "unix:/vm/connect.sock,server=on",
                "disconnected:unix:/vm/connect.sock,server=on",
            ],
        )

    def test_frontendOpenFollowsTheGuest(self) -> None:
        closed = self.chardev()["frontend-open"]
        self.guest(CONNECT_PORT)
        self.assertEqual((closed, self.chardev()["frontend-open"]), (False, True))

    def test_ringbufCommandsRefuseASocketChardev(self) -> None:
        expected = generic("vmready-connect is not a ringbuf device")
        self.assertEqual(
            [self.read(device="vmready-connect"), self.write("x", device="vmready-connect")],
            [expected, expected],
        )

    def test_vserportChangeCarriesThePortsId(self) -> None:
        guest = self.guest(CONNECT_PORT)
        guest.close()
        self.vm.advance(1.0)  # the close comes at the end of the open's one-second period
        self.assertEqual(
            [(e["event"], e["data"]) for e in self.client.events()],
            [
                ("VSERPORT_CHANGE", {"open": True, "id": CONNECT_PORT}),
                ("VSERPORT_CHANGE", {"open": False, "id": CONNECT_PORT}),
            ],
        )


class MigrationCommandTests(_VMTestCase):
    """migrate, query-migrate and the migration capabilities."""

    def migrate(self, uri: str = "exec:cat > /state") -> dict[str, Any]:
        """Start a migration and let it finish."""
        reply = self.execute("migrate", uri=uri)
        self.vm.advance()
        return reply

    def test_migrationEventsWithTheEventsCapability(self) -> None:
        self.enable_migration_events()
        self.assertEqual(self.migrate(), EMPTY)
        self.assertEqual(
            [(e["event"], e.get("data")) for e in self.client.events()],
            [
                ("MIGRATION", {"status": "setup"}),
                ("MIGRATION_PASS", {"pass": 1}),
                ("MIGRATION", {"status": "active"}),
                ("STOP", None),
                ("MIGRATION_PASS", {"pass": 2}),
                ("MIGRATION", {"status": "completed"}),
            ],
        )

    def test_setupIsAnnouncedBeforeTheReturn(self) -> None:
        self.enable_migration_events()
        self.client.messages.clear()
        self.execute("migrate", uri="exec:cat > /state")
        self.assertEqual(
            [m.get("event", "return") for m in self.client.messages[:2]], ["MIGRATION", "return"]
        )

    def test_withoutTheCapabilityOnlyStopIsSent(self) -> None:
        self.migrate()
        self.assertEqual(self.client.event_names(), ["STOP"])

    def test_migrationWritesTheStateFile(self) -> None:
        self.migrate()
        self.assertEqual(json.loads(self.vm.files["/state"])["machine"], "pc-q35-7.2")

    def test_queryMigrateReportsCompletion(self) -> None:
        self.migrate()
        result = self.execute("query-migrate")["return"]
        self.assertEqual(
            (result["status"], result["ram"]["total"]), ("completed", 64 * 1024 * 1024)
        )

    def test_queryMigrateIsEmptyBeforeAnyMigration(self) -> None:
        self.assertEqual(self.execute("query-migrate"), EMPTY)

    def test_pausedVmMigratesWithoutAnotherStop(self) -> None:
        self.execute("stop")
        self.migrate()
        self.assertEqual((self.client.event_names(), self.status()), (["STOP"], "postmigrate"))

    def test_secondMigrationIsRefused(self) -> None:
        self.migrate()
        self.assertEqual(
            self.migrate("exec:cat > /other"),
            generic("Can't migrate the vm that was paused due to previous migration"),
        )

    def test_contResumesAfterMigration(self) -> None:
        self.migrate()
        self.assertEqual((self.execute("cont"), self.status()), (EMPTY, "running"))

    def test_badUriIsRefused(self) -> None:
        self.assertEqual(
            (self.migrate("file:/tmp/x"), self.status(), self.vm.files),
            (generic("Parameter 'uri' expects a valid migration protocol"), "running", {}),
        )

    def test_badUriFailsAMigrationThatWasSetUp(self) -> None:
        self.enable_migration_events()
        self.migrate("file:/tmp/x")
        self.assertEqual(
            (
                [e["data"]["status"] for e in self.client.events()],
                self.execute("query-migrate"),
            ),
            (["setup", "failed"], {"return": {"status": "failed"}}),
        )

    def test_unwritableTargetFailsAndTheVmKeepsRunning(self) -> None:
        self.client.disconnect()
        self.vm.flush()

        def refuse(path: str, data: bytes) -> None:
            raise PermissionError(path)

        self.vm.qmp_factory.write_file = refuse
        self.client = self.connect()
        self.enable_migration_events()
        self.migrate("exec:cat > /nonexistent/dir/x")
        self.assertEqual(
            (
                [e["data"]["status"] for e in self.client.events() if e["event"] == "MIGRATION"],
                self.execute("query-migrate"),
                self.status(),
            ),
            (
                ["setup", "active", "failed"],
                {
                    "return": {
                        "status": "failed",
                        "error-desc": "Unable to write to command: Broken pipe",
                    }
                },
                "running",
            ),
        )

    def test_migrateDuringIncomingMigrationIsRefused(self) -> None:
        self.vm = self.make_vm([*VM_ARGV, "-incoming", "exec:cat /state"])
        self.client = self.connect()
        self.assertEqual(
            self.migrate("exec:cat > /other"),
            generic("Guest is waiting for an incoming migration"),
        )

    def test_capabilitiesStartOff(self) -> None:
        capabilities = self.execute("query-migrate-capabilities")["return"]
        self.assertEqual(
            (capabilities[0], {c["state"] for c in capabilities}),
            ({"state": False, "capability": "xbzrle"}, {False}),
        )

    def test_setCapabilityIsReported(self) -> None:
        self.enable_migration_events()
        capabilities = self.execute("query-migrate-capabilities")["return"]
        self.assertEqual([c["capability"] for c in capabilities if c["state"]], ["events"])

    def test_capabilityErrorsNameTheListElement(self) -> None:
        def set_capabilities(*entries: Any) -> dict[str, Any]:
            return self.execute("migrate-set-capabilities", capabilities=list(entries))

        self.assertEqual(
            [
                set_capabilities({"capability": "bogus", "state": True}),
                set_capabilities({"state": True}),
                set_capabilities({"capability": "events", "state": 1}),
                set_capabilities({"capability": "events"}),
                set_capabilities(1),
                set_capabilities({"capability": 3, "state": True}),
                set_capabilities(
                    {"capability": "xbzrle", "state": True},
                    {"capability": "events", "state": True, "x": 1},
                ),
                self.execute("migrate-set-capabilities", capabilities={}),
            ],
            [
                generic("Parameter 'capability' does not accept value 'bogus'"),
                generic("Parameter 'capabilities[0].capability' is missing"),
                generic("Invalid parameter type for 'capabilities[0].state', expected: boolean"),
                generic("Parameter 'capabilities[0].state' is missing"),
                generic("Invalid parameter type for 'capabilities[0]', expected: object"),
                generic(
                    "Invalid parameter type for 'capabilities[0].capability', expected: string"
                ),
                generic("Parameter 'capabilities[1].x' is unexpected"),
                generic("Invalid parameter type for 'capabilities', expected: array"),
            ],
        )

    def test_refusedCapabilityListChangesNothing(self) -> None:
        self.execute(
            "migrate-set-capabilities",
            capabilities=[
                {"capability": "xbzrle", "state": True},
                {"capability": "bogus", "state": True},
            ],
        )
        capabilities = self.execute("query-migrate-capabilities")["return"]
        self.assertEqual([c["capability"] for c in capabilities if c["state"]], [])


class MonitorQueueTests(_VMTestCase):
    """QEMU serves one client per monitor socket at a time."""

    def test_secondClientGetsNoGreetingWhileTheFirstIsConnected(self) -> None:
        second = self.connect(negotiate=False)
        self.assertEqual((second.connected, second.messages), (True, []))

    def test_secondClientIsServedWhenTheFirstLeaves(self) -> None:
        second = self.connect(negotiate=False)
        self.client.disconnect()
        self.vm.flush()
        self.assertEqual(second.messages, [GREETING])

    def test_queuedClientsRequestsAreAnsweredOnceServed(self) -> None:
        second = self.connect(negotiate=False)
        second.send({"execute": "qmp_capabilities", "id": 1})
        second.send({"execute": "query-status", "id": 2})
        self.vm.flush()
        self.assertEqual(second.messages, [])
        self.client.disconnect()
        self.vm.flush()
        self.assertEqual([m.get("id") for m in second.messages], [None, 1, 2])

    def test_departedClientGetsNoEvents(self) -> None:
        second = self.connect(negotiate=False)
        self.client.disconnect()
        self.vm.flush()
        self.assertEqual(self.send({"execute": "qmp_capabilities"}, second), EMPTY)
        before = list(self.client.messages)
        self.vm.machine.stop()
        self.vm.flush()
        self.assertEqual((self.client.messages, second.event_names()), (before, ["STOP"]))


class SerialPortTests(SynchronousTestCase):
    """What a guest sees of the ports."""

    def test_namedPortIsFoundByItsName(self) -> None:
        port = InMemoryVM(VM_ARGV).machine.wiring.find_port(PORT)
        self.assertEqual(None if port is None else port.spec.chardev, "vmready")

    def test_unnamedPortHasABusAndNumberName(self) -> None:
        vm = InMemoryVM([*VM_ARGV, "-device", "virtserialport,bus=vs0.0"])
        self.assertEqual(vm.machine.wiring.ports[-1].guest_name, "vportvs0p0n3")

    def test_unknownPortIsNotFound(self) -> None:
        self.assertIsNone(InMemoryVM(VM_ARGV).machine.wiring.find_port("nope"))

    def test_guestCannotOpenAPortOfAnExitedMachine(self) -> None:
        vm = InMemoryVM(VM_ARGV)
        vm.machine.exit(0, [])
        guest = vm.connect_guest(PORT)
        vm.flush()
        self.assertFalse(guest.open)

    def test_guestWritesAfterExitAreDropped(self) -> None:
        vm = InMemoryVM(VM_ARGV)
        port = vm.machine.wiring.find_port(PORT)
        assert port is not None
        vm.machine.exit(0, [])
        vm.machine.wiring.guest_wrote(port, b"late")
        self.assertEqual(vm.machine.wiring.ringbufs["vmready"].peek(), b"")

    def test_exitIsReportedOnce(self) -> None:
        vm = InMemoryVM(VM_ARGV)
        vm.machine.exit(1, ["first"])
        vm.machine.exit(0, ["second"])
        self.assertEqual((vm.exits, vm.machine.run_state), ([(1, ["first"])], RunState.SHUTDOWN))
