"""Tests for fakeqemu.testing, the in-memory helpers other tests build on."""

from __future__ import annotations

import json

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from fakeqemu import CommandLineError
from fakeqemu._runstate import RunState
from fakeqemu.testing import FakeGuest, InMemoryVM, raw_qmp_transport
from tests.fakeqemu.commandlines import MACHINE, PORT, agent_port, qmp_option
from tests.fakeqemu.test_fakeqemu_machine import GREETING, RecordingQMPClient

VM_ARGV = [*MACHINE, *qmp_option(), *agent_port(64)]
STATE = "/vm/state"
INCOMING = ["-incoming", f"exec:cat {STATE}"]


def negotiated_client(vm: InMemoryVM) -> RecordingQMPClient:
    """A client connected to ``vm``'s monitor that has sent qmp_capabilities."""
    client = RecordingQMPClient()
    vm.connect_qmp(client)
    client.send({"execute": "qmp_capabilities"})
    vm.flush()
    client.messages.clear()
    return client


def migrated_state() -> bytes:
    """A state file from a VM with VM_ARGV's devices."""
    source = InMemoryVM(VM_ARGV)
    source.machine.migration.migrate(f"exec:cat > {STATE}", source.files.__setitem__)
    source.advance()
    return source.files[STATE]


class InMemoryVMTests(SynchronousTestCase):
    """InMemoryVM: a VM from a command line, its clock, its files, its exits."""

    def test_configComesFromTheCommandLine(self) -> None:
        vm = InMemoryVM(VM_ARGV)
        self.assertEqual(
            (vm.config.machine_type, [p.guest_name for p in vm.machine.wiring.ports]),
            ("pc-q35-7.2", [PORT]),
        )

    def test_commandLineErrorsPropagate(self) -> None:
        self.assertRaises(CommandLineError, InMemoryVM, ["-foo"])

    def test_injectedClockIsTheMachinesClock(self) -> None:
        clock = Clock()
        clock.advance(42.5)
        vm = InMemoryVM(VM_ARGV, clock=clock)
        events: list[dict[str, object]] = []
        vm.machine.subscribe(events.append)
        vm.machine.stop()
        self.assertEqual(
            (vm.clock, events[0]["timestamp"]), (clock, {"seconds": 42, "microseconds": 500000})
        )

    def test_defaultClockStartsAtZero(self) -> None:
        self.assertEqual(InMemoryVM(VM_ARGV).clock.seconds(), 0)

    def test_migrateWritesIntoTheFilesDict(self) -> None:
        files: dict[str, bytes] = {}
        vm = InMemoryVM(VM_ARGV, files=files)
        vm.machine.migration.migrate(f"exec:cat > {STATE}", vm.qmp_factory.write_file)
        vm.advance()
        self.assertEqual(json.loads(files[STATE])["machine"], "pc-q35-7.2")

    def test_filesDictIsCreatedWhenNotGiven(self) -> None:
        self.assertEqual(InMemoryVM(VM_ARGV).files, {})

    def test_incomingIsReadFromTheFilesDict(self) -> None:
        vm = InMemoryVM([*VM_ARGV, *INCOMING], files={STATE: migrated_state()})
        self.assertEqual((vm.machine.run_state, vm.exits), (RunState.RUNNING, []))

    def test_missingIncomingFileWaitsInInmigrate(self) -> None:
        # QEMU 7.2 with `exec:cat` of a missing file: cat fails, QEMU waits.
        vm = InMemoryVM([*VM_ARGV, *INCOMING])
        vm.advance(60)
        self.assertEqual((vm.machine.run_state, vm.exits), (RunState.INMIGRATE, []))

    def test_emptyIncomingFileWaitsInInmigrate(self) -> None:
        vm = InMemoryVM([*VM_ARGV, *INCOMING], files={STATE: b""})
        self.assertEqual((vm.machine.run_state, vm.exits), (RunState.INMIGRATE, []))

    def test_failedIncomingIsRecordedAsAnExit(self) -> None:
        vm = InMemoryVM([*VM_ARGV, *INCOMING], files={STATE: b"garbage"})
        self.assertEqual(
            vm.exits,
            [(1, ["Not a migration stream", "load of migration failed: Invalid argument"])],
        )

    def test_exitDisconnectsMonitorClients(self) -> None:
        vm = InMemoryVM(VM_ARGV)
        client = negotiated_client(vm)
        vm.machine.exit(0, [])
        self.assertEqual((vm.exits, client.lost), ([(0, [])], True))


class ConnectionTests(SynchronousTestCase):
    """connect_qmp, connect_guest, connect_control over in-memory transports."""

    def setUp(self) -> None:
        self.vm = InMemoryVM(VM_ARGV)

    def test_qmpClientIsGreetedOnConnect(self) -> None:
        client = RecordingQMPClient()
        self.vm.connect_qmp(client)
        self.assertEqual(client.messages, [GREETING])

    def test_connectQmpReturnsThePumpForItsConnection(self) -> None:
        client = RecordingQMPClient()
        pump = self.vm.connect_qmp(client)
        client.send({"execute": "qmp_capabilities"})
        pump.flush()
        self.assertEqual(client.messages[1:], [{"return": {}}])

    def test_guestIsOpenOnceConnected(self) -> None:
        guest = self.vm.connect_guest(PORT)
        port = self.vm.machine.wiring.find_port(PORT)
        self.assertEqual((guest.open, port is not None and port.guest is not None), (True, True))

    def test_unknownPortIsAKeyError(self) -> None:
        error = self.assertRaises(KeyError, self.vm.connect_guest, "nope")
        self.assertEqual(error.args, ("no virtio serial port named 'nope'",))

    def test_guestWritesArriveOnFlush(self) -> None:
        guest = self.vm.connect_guest(PORT)
        guest.write(b"STARTED\n")
        before = self.vm.machine.wiring.ringbufs["vmready"].peek()
        self.vm.flush()
        self.assertEqual(
            (before, self.vm.machine.wiring.ringbufs["vmready"].peek()), (b"", b"STARTED\n")
        )

    def test_guestRecordsWhatArrives(self) -> None:
        vm = InMemoryVM(
            [
                *VM_ARGV,
                "-chardev",
                "socket,id=c,path=/vm/c.sock,server=on,wait=off",
                "-device",
                "virtserialport,chardev=c,name=vmready.connect,id=vmready.connect",
            ]
        )
        guest = vm.connect_guest("vmready.connect")
        host = vm.connect_chardev("c")
        host.write(b"CONNECT ")
        host.write(b"2:1234\n")
        vm.flush()
        self.assertEqual(guest.received, b"CONNECT 2:1234\n")

    def test_connectingToAnUnknownChardevIsAKeyError(self) -> None:
        with self.assertRaises(KeyError):
            self.vm.connect_chardev("vmready")

    def test_guestCloseClosesThePort(self) -> None:
        guest = self.vm.connect_guest(PORT)
        guest.close()
        self.vm.flush()
        port = self.vm.machine.wiring.find_port(PORT)
        self.assertEqual((guest.open, port is not None and port.guest), (False, None))

    def test_controlChannelReceivesPowerdown(self) -> None:
        control = self.vm.connect_control()
        self.vm.machine.system_powerdown()
        self.vm.flush()
        self.assertEqual(control.received, b"POWERDOWN\n")

    def test_controlChannelCarriesGuestActions(self) -> None:
        control = self.vm.connect_control()
        control.write(b"reboot\n")
        self.vm.flush()
        self.assertEqual(control.received, b"ok\n")

    def test_flushMovesBytesInEveryDirectionUntilQuiet(self) -> None:
        client = negotiated_client(self.vm)
        guest = self.vm.connect_guest(PORT)
        guest.write(b"hi\n")
        self.vm.flush()
        client.send({"execute": "ringbuf-read", "arguments": {"device": "vmready", "size": 10}})
        self.vm.flush()
        self.assertEqual(client.replies(), [{"return": "hi\n"}])

    def test_advanceRunsDelayedWorkAndDeliversItsEffects(self) -> None:
        client = negotiated_client(self.vm)
        client.send({"execute": "quit"})
        self.vm.flush()
        self.vm.advance()
        self.assertEqual((self.vm.exits, client.lost), ([(0, [])], True))

    def test_advanceMovesTheClock(self) -> None:
        self.vm.advance(2.5)
        self.assertEqual(self.vm.clock.seconds(), 2.5)


class FakeGuestTests(SynchronousTestCase):
    """FakeGuest on its own: what a guest process does with a port."""

    def test_newGuestIsClosedAndHasReceivedNothing(self) -> None:
        guest = FakeGuest()
        self.assertEqual((guest.open, guest.received), (False, b""))

    def test_receivedBytesAccumulate(self) -> None:
        guest = FakeGuest()
        guest.dataReceived(b"a")
        guest.dataReceived(b"b")
        self.assertEqual(guest.received, b"ab")


class RawTransportTests(SynchronousTestCase):
    """raw_qmp_transport: the monitor's exact bytes, for wire-format tests."""

    def test_greetingIsWrittenOnConnect(self) -> None:
        _, transport = raw_qmp_transport(InMemoryVM(VM_ARGV))
        self.assertEqual(json.loads(transport.value()), GREETING)

    def test_bytesFedToTheServerAreAnswered(self) -> None:
        server, transport = raw_qmp_transport(InMemoryVM(VM_ARGV))
        transport.clear()
        server.dataReceived(b'{"execute":"qmp_capabilities","id":1}')
        self.assertEqual(transport.value(), b'{"return": {}, "id": 1}\r\n')

    def test_rawClientWaitsBehindAConnectedClient(self) -> None:
        vm = InMemoryVM(VM_ARGV)
        negotiated_client(vm)
        _, transport = raw_qmp_transport(vm)
        self.assertEqual(transport.value(), b"")
