"""Tests for fakeqemu._migration: the state file, and restoring from it as QEMU 7.2 does.

The refusal lines were measured by restoring real QEMU 7.2 migration streams
into mismatched destinations.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from fakeqemu._cmdline import MachineConfig, parse_command_line
from fakeqemu._migration import (
    STATE_MAGIC,
    STATE_VERSION,
    IncomingMigrationError,
    check_incoming,
    serialize_state,
)
from fakeqemu.testing import InMemoryVM, raw_qmp_transport
from tests.fakeqemu.commandlines import MACHINE, PORT, agent_port, legacy_port

STATE = "/vm/state"
INCOMING = ["-incoming", f"exec:cat {STATE}"]
FAILED = "load of migration failed: Invalid argument"
DEVICES = agent_port(16)
VM_ARGV = [*MACHINE, *DEVICES]
EXTRA_PORT = legacy_port()
VIRTIO_CONSOLE_LINES = [
    "Failed to load virtio-console:virtio",
    "error while loading state for instance 0x0 of device '0000:00:01.0/virtio-console'",
    FAILED,
]


def config(*argv: str) -> MachineConfig:
    """The configuration a command line describes."""
    return parse_command_line(list(argv))


def saved_state(argv: list[str], guest_bytes: bytes = b"") -> bytes:
    """Run a VM with ``argv``, let its guest write ``guest_bytes``, migrate it to a file."""
    source = InMemoryVM(argv)
    if guest_bytes:
        guest = source.connect_guest(PORT)
        source.flush()
        guest.write(guest_bytes)
        source.flush()
    source.machine.migration.migrate(f"exec:cat > {STATE}", source.files.__setitem__)
    source.advance()
    return source.files[STATE]


def document(state: bytes) -> dict[str, Any]:
    """A state file, decoded."""
    decoded: dict[str, Any] = json.loads(state)
    return decoded


class StateFileTests(SynchronousTestCase):
    """What migrate writes: the device set, memory, and ring-buffer contents."""

    def test_stateFileNamesItsFormat(self) -> None:
        state = document(serialize_state(config(*VM_ARGV), {}))
        self.assertEqual((state["magic"], state["version"]), (STATE_MAGIC, STATE_VERSION))

    def test_stateFileRecordsMachineMemoryAndCpus(self) -> None:
        state = document(serialize_state(config(*VM_ARGV, "-smp", "2"), {}))
        self.assertEqual(
            (state["machine"], state["memory_bytes"], state["cpus"]),
            ("pc-q35-7.2", 64 * 1024 * 1024, 2),
        )

    def test_stateFileRecordsEveryBusWithItsPorts(self) -> None:
        state = document(serialize_state(config(*VM_ARGV, *EXTRA_PORT), {}))
        self.assertEqual(
            state["serial_buses"],
            [
                {
                    "bus": "vs0.0",
                    "pci_address": "0000:00:01.0",
                    "ports": [
                        {"nr": 1, "name": PORT, "chardev": "vmready"},
                        {"nr": 2, "name": "org.linuxcontainers.lxd", "chardev": None},
                    ],
                }
            ],
        )

    def test_stateFileRecordsRingbufSizeAndContents(self) -> None:
        state = document(serialize_state(config(*VM_ARGV), {"vmready": b"STARTED\n"}))
        self.assertEqual(
            state["ringbufs"],
            {"vmready": {"size": 16, "contents": base64.b64encode(b"STARTED\n").decode()}},
        )

    def test_emptyRingbufIsRecordedEmpty(self) -> None:
        state = document(serialize_state(config(*VM_ARGV), {}))
        self.assertEqual(state["ringbufs"]["vmready"]["contents"], "")

    def test_migrationRecordsWhatTheGuestWrote(self) -> None:
        state = document(saved_state(VM_ARGV, b"STARTED\n"))
        contents = base64.b64decode(state["ringbufs"]["vmready"]["contents"])
        self.assertEqual(contents, b"STARTED\n")

    def test_migrationDoesNotDrainTheRingbuf(self) -> None:
        source = InMemoryVM(VM_ARGV)
        source.machine.wiring.ringbuf_write("vmready", b"kept")
        source.machine.migration.migrate(f"exec:cat > {STATE}", source.files.__setitem__)
        source.advance()
        self.assertEqual(source.machine.wiring.ringbufs["vmready"].peek(), b"kept")


class IncomingCheckTests(SynchronousTestCase):
    """check_incoming refuses what QEMU refuses, with QEMU's lines."""

    def refusal(self, destination: list[str], state: bytes) -> list[str]:
        """The lines a destination with ``destination``'s command line prints."""
        error: IncomingMigrationError = self.assertRaises(
            IncomingMigrationError, check_incoming, config(*destination), STATE, state
        )
        return error.lines

    def test_identicalDevicesAreAccepted(self) -> None:
        state = saved_state(VM_ARGV)
        self.assertEqual(check_incoming(config(*VM_ARGV), STATE, state), document(state))

    def test_renamedPortIsAccepted(self) -> None:
        renamed = [*MACHINE, *DEVICES[:-1], "virtserialport,chardev=vmready,name=x,bus=vs0.0"]
        check_incoming(config(*renamed), STATE, saved_state(VM_ARGV))

    def test_differentRingbufSizeIsAccepted(self) -> None:
        resized = [*MACHINE, "-chardev", "ringbuf,id=vmready,size=4096", *DEVICES[2:]]
        check_incoming(config(*resized), STATE, saved_state(VM_ARGV))

    def test_extraPortIsRefused(self) -> None:
        self.assertEqual(
            self.refusal([*VM_ARGV, *EXTRA_PORT], saved_state(VM_ARGV)), VIRTIO_CONSOLE_LINES
        )

    def test_missingPortIsRefused(self) -> None:
        self.assertEqual(
            self.refusal(VM_ARGV, saved_state([*VM_ARGV, *EXTRA_PORT])), VIRTIO_CONSOLE_LINES
        )

    def test_differentPortNumberIsRefused(self) -> None:
        renumbered = [
            *MACHINE,
            *DEVICES[:-1],
            f"virtserialport,chardev=vmready,name={PORT},bus=vs0.0,nr=5",
        ]
        self.assertEqual(self.refusal(renumbered, saved_state(VM_ARGV)), VIRTIO_CONSOLE_LINES)

    def test_refusalNamesTheBusByPciAddress(self) -> None:
        source = [*MACHINE, "-device", "virtio-serial-pci", *DEVICES]
        destination = [*source, "-device", "virtserialport,bus=vs0.0"]
        self.assertEqual(
            self.refusal(destination, saved_state(source)),
            [
                "Failed to load virtio-console:virtio",
                "error while loading state for instance 0x0 of device "
                "'0000:00:02.0/virtio-console'",
                FAILED,
            ],
        )

    def test_busUnknownToTheDestinationIsRefused(self) -> None:
        self.assertEqual(
            self.refusal(MACHINE, saved_state(VM_ARGV)),
            [
                "Unknown savevm section or instance '0000:00:01.0/virtio-console' 0. "
                "Make sure that your current VM setup matches your saved VM setup, "
                "including any hotplugged devices",
                FAILED,
            ],
        )

    def test_busTheStreamDoesNotMentionIsAccepted(self) -> None:
        # Measured: QEMU leaves a device without a section in its reset state.
        check_incoming(config(*VM_ARGV), STATE, saved_state(MACHINE))

    def test_memoryMismatchIsRefused(self) -> None:
        self.assertEqual(
            self.refusal([*VM_ARGV, "-m", "128"], saved_state(VM_ARGV)),
            [
                "Size mismatch: pc.ram: 0x4000000 != 0x8000000: Invalid argument",
                "error while loading state for instance 0x0 of device 'ram'",
                FAILED,
            ],
        )

    def test_machineTypeMismatchIsRefused(self) -> None:
        self.assertEqual(
            self.refusal(
                ["-machine", "pc", "-m", "64"], saved_state(["-machine", "q35", "-m", "64"])
            ),
            ["Machine type received is 'pc-q35-7.2' and local is 'pc-i440fx-7.2'", FAILED],
        )

    def test_machineTypeIsCheckedBeforeMemory(self) -> None:
        self.assertEqual(
            self.refusal(["-machine", "pc", "-m", "128"], saved_state(["-machine", "q35"]))[0],
            "Machine type received is 'pc-q35-7.2' and local is 'pc-i440fx-7.2'",
        )

    def test_garbageIsNotAMigrationStream(self) -> None:
        expected = ["Not a migration stream", FAILED]
        self.assertEqual(
            [self.refusal(VM_ARGV, data) for data in (b"garbage\n", b"\xff\xfe", b"[]", b"{}")],
            [expected, expected, expected, expected],
        )

    def test_unknownStreamVersionIsRefused(self) -> None:
        state = document(saved_state(VM_ARGV))
        state["version"] = 99
        self.assertEqual(
            self.refusal(VM_ARGV, json.dumps(state).encode()),
            ["Unsupported migration stream version 99", FAILED],
        )


class RestoreTests(SynchronousTestCase):
    """Starting a VM with -incoming from a state file, end to end."""

    def restore(self, argv: list[str], state: bytes) -> InMemoryVM:
        """A VM started with ``argv`` and ``-incoming`` from ``state``."""
        return InMemoryVM([*argv, *INCOMING], files={STATE: state})

    def test_identicalDevicesResumeRunning(self) -> None:
        vm = self.restore(VM_ARGV, saved_state(VM_ARGV))
        self.assertEqual((vm.machine.run_state.value, vm.exits), ("running", []))

    def test_identicalDevicesWithMinusSRestorePaused(self) -> None:
        vm = self.restore([*VM_ARGV, "-S"], saved_state(VM_ARGV))
        self.assertEqual((vm.machine.run_state.value, vm.exits), ("paused", []))

    def test_restoredMigrationReportsCompleted(self) -> None:
        vm = self.restore(VM_ARGV, saved_state(VM_ARGV))
        self.assertEqual(vm.machine.migration.info, {"status": "completed"})

    def test_renamedPortRestoresAndIsReachableByItsNewName(self) -> None:
        renamed = [*MACHINE, *DEVICES[:-1], "virtserialport,chardev=vmready,name=new,bus=vs0.0"]
        vm = self.restore(renamed, saved_state(VM_ARGV))
        guest = vm.connect_guest("new")
        vm.flush()
        self.assertEqual((vm.exits, guest.open), ([], True))

    def test_ringbufContentsAreNotRestored(self) -> None:
        vm = self.restore(VM_ARGV, saved_state(VM_ARGV, b"STARTED\n"))
        self.assertEqual(vm.machine.wiring.ringbuf_read("vmready", 100), b"")

    def test_extraPortExitsWithQemusLines(self) -> None:
        vm = self.restore([*VM_ARGV, *EXTRA_PORT], saved_state(VM_ARGV))
        self.assertEqual(vm.exits, [(1, VIRTIO_CONSOLE_LINES)])

    def test_missingPortExitsWithQemusLines(self) -> None:
        vm = self.restore(VM_ARGV, saved_state([*VM_ARGV, *EXTRA_PORT]))
        self.assertEqual(vm.exits, [(1, VIRTIO_CONSOLE_LINES)])

    def test_failedRestoreLeavesTheMachineShutDown(self) -> None:
        vm = self.restore([*VM_ARGV, *EXTRA_PORT], saved_state(VM_ARGV))
        self.assertEqual((vm.machine.exited, vm.machine.run_state.value), (1, "shutdown"))

    def test_failedRestoreServesNoMonitor(self) -> None:
        vm = self.restore([*VM_ARGV, *EXTRA_PORT], saved_state(VM_ARGV))
        _, transport = raw_qmp_transport(vm)
        self.assertEqual((transport.value(), transport.disconnecting), (b"", True))

    def test_failedRestoreRefusesGuests(self) -> None:
        vm = self.restore([*VM_ARGV, *EXTRA_PORT], saved_state(VM_ARGV))
        guest = vm.connect_guest(PORT)
        vm.flush()
        self.assertFalse(guest.open)

    def test_memoryMismatchExits(self) -> None:
        vm = self.restore([*VM_ARGV, "-m", "128"], saved_state(VM_ARGV))
        self.assertEqual([status for status, _ in vm.exits], [1])

    def test_garbageExits(self) -> None:
        vm = self.restore(VM_ARGV, b"garbage\n")
        self.assertEqual(vm.exits, [(1, ["Not a migration stream", FAILED])])

    def test_restoredVmCanMigrateAgain(self) -> None:
        vm = self.restore(VM_ARGV, saved_state(VM_ARGV))
        vm.machine.migration.migrate("exec:cat > /vm/again", vm.files.__setitem__)
        vm.advance()
        self.assertEqual(document(vm.files["/vm/again"])["machine"], "pc-q35-7.2")
