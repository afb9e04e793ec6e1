"""The guest's side of the issue 11 devices, in memory: ports with ids, the console, a panic,
guestfwd connections and 9p exports, as a QMP client and a fake guest see them.

Every VM is a fakeqemu.testing.InMemoryVM.  The QEMU behaviour each test
asserts was measured on QEMU 7.2 with a Debian 6.1 kernel and busybox guest
(VSERPORT_CHANGE, the console file, panics with and without pvpanic, guestfwd
commands), as the fakeqemu docstrings record.
"""

from __future__ import annotations

import os
from typing import Any

from fakeqemu._cmdline import parse_command_line
from fakeqemu._guest import CLOSE_SETTLE
from fakeqemu._migration import IncomingMigrationError, check_incoming
from fakeqemu.testing import InMemoryVM, write_kernel, write_qcow2
from tests.fakeqemu.commandlines import (
    FORWARD,
    LEGACY_PORT,
    MACHINE,
    PORT,
    agent_port,
    guest_devices,
    legacy_port,
    qmp_option,
)
from tests.fakeqemu.test_fakeqemu_machine import EMPTY, EPOCH, RecordingQMPClient, _VMTestCase


class _GuestSideTestCase(_VMTestCase):
    """A VM from the contract's devices, built in a scratch directory."""

    def setUp(self) -> None:
        self.directory = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(self.directory, "config-drive"))
        self.vm = self.make_vm(self.arguments())
        self.client = self.connect()

    def path(self, name: str) -> str:
        """A path in the scratch directory."""
        return os.path.join(self.directory, name)

    def arguments(self, *extra: str) -> list[str]:
        """The contract's command line (no disk, no kernel), plus ``extra``."""
        return [
            *MACHINE,
            *qmp_option(),
            *agent_port(64, port_id=PORT),
            *legacy_port(),
            *guest_devices(self.directory, "socat - UNIX-CONNECT:/a"),
            *extra,
        ]

    def other_vm(self, *extra: str) -> InMemoryVM:
        """Another VM of the same kind, plus ``extra``; this test's client follows it."""
        self.vm = self.make_vm(self.arguments(*extra))
        self.client = self.connect()
        return self.vm

    def events(self) -> list[tuple[str, Any]]:
        """The events the client received: names and data."""
        return [(e["event"], e.get("data")) for e in self.client.events()]

    def console_log(self) -> bytes:
        """What the console file holds."""
        with open(self.path("console.log"), "rb") as f:
            return f.read()


class PortChangeTests(_GuestSideTestCase):
    """VSERPORT_CHANGE: for a port with an id, when the guest opens and closes it."""

    def test_openAndCloseOfAPortWithAnId(self) -> None:
        guest = self.guest(PORT)
        guest.close()
        self.vm.flush()
        self.assertEqual(self.events(), [("VSERPORT_CHANGE", {"open": True, "id": PORT})])
        self.vm.advance(1.0)  # QEMU sends one a second per port: the close ends the period
        self.assertEqual(
            self.events(),
            [
                ("VSERPORT_CHANGE", {"open": True, "id": PORT}),
                ("VSERPORT_CHANGE", {"open": False, "id": PORT}),
            ],
        )

    def test_eventDataIsInQEMUsKeyOrder(self) -> None:
        self.guest(PORT)
        self.assertEqual(list(self.client.events()[0]["data"]), ["open", "id"])

    def test_portWithoutIdIsSilent(self) -> None:
        guest = self.guest(LEGACY_PORT)
        guest.close()
        self.vm.flush()
        self.assertEqual(self.events(), [])

    def test_aSecondOpenerChangesNothing(self) -> None:
        self.guest(PORT)
        second = self.guest(PORT)
        self.vm.advance(CLOSE_SETTLE)
        self.assertEqual(
            (self.events(), second.open),
            ([("VSERPORT_CHANGE", {"open": True, "id": PORT})], False),
        )

    def test_resetClosesThePortBeforeAnnouncingRESET(self) -> None:
        self.guest(PORT)
        self.vm.advance(1.0)  # the open's throttle period is over
        self.client.messages.clear()
        self.assertEqual(self.execute("system_reset"), EMPTY)
        self.assertEqual(
            self.events(),
            [
                ("VSERPORT_CHANGE", {"open": False, "id": PORT}),
                ("RESET", {"guest": False, "reason": "host-qmp-system-reset"}),
            ],
        )

    def test_changesWithinASecondAreThrottledToTheLastOne(self) -> None:
        """QEMU's rate limit, measured with a real guest: one a second, the last one wins."""
        guest = self.guest(PORT)  # sent at once
        guest.close()
        again = self.guest(PORT)
        again.close()  # open, close, open, close within the second: only the last is held
        self.vm.advance(0.99)
        self.assertEqual(self.events(), [("VSERPORT_CHANGE", {"open": True, "id": PORT})])
        self.vm.advance(0.01)
        self.assertEqual(self.events()[1:], [("VSERPORT_CHANGE", {"open": False, "id": PORT})])
        self.vm.advance(5.0)
        self.assertEqual(len(self.events()), 2)
        self.guest(PORT)  # the period is over: sent at once again
        self.assertEqual(self.events()[2:], [("VSERPORT_CHANGE", {"open": True, "id": PORT})])

    def test_eachPortHasItsOwnPeriodAndHeldEventsKeepTheirTime(self) -> None:
        self.other_vm("-device", "virtserialport,name=other,bus=vs0.0,id=other")
        agent = self.guest(PORT)
        self.vm.advance(0.5)
        agent.close()  # held for the end of the period, stamped now
        self.guest("other")  # another id: not held back by this one
        self.vm.advance(0.5)
        events = self.client.events()
        self.assertEqual(
            [(e["data"]["id"], e["data"]["open"]) for e in events],
            [(PORT, True), ("other", True), (PORT, False)],
        )
        stamps = [e["timestamp"]["seconds"] + e["timestamp"]["microseconds"] / 1e6 for e in events]
        self.assertAlmostEqual(stamps[2] - stamps[0], 0.5)

    def test_exitReportsNoChange(self) -> None:
        self.guest(PORT)
        self.client.messages.clear()
        self.execute("quit")
        self.vm.advance()
        self.assertEqual(
            self.events(), [("SHUTDOWN", {"guest": False, "reason": "host-qmp-quit"})]
        )


class ConsoleTests(_GuestSideTestCase):
    """``<guest dir>/console``: the guest's ttyS0, into the ``-serial`` chardev."""

    def test_consoleOutputIsAppendedToTheFile(self) -> None:
        console = self.vm.connect_console()
        console.write(b"[    0.000000] Linux version 6.1.0\n")
        self.vm.flush()
        self.assertEqual(self.console_log(), b"[    0.000000] Linux version 6.1.0\n")

    def test_appendOnKeepsTheEarlierBootsLines(self) -> None:
        first = self.vm.connect_console()
        first.write(b"boot 1\n")
        self.vm.flush()
        self.other_vm()
        second = self.vm.connect_console()
        second.write(b"boot 2\n")
        self.vm.flush()
        self.assertEqual(self.console_log(), b"boot 1\nboot 2\n")

    def test_severalProcessesMayWriteTheConsole(self) -> None:
        a, b = self.vm.connect_console(), self.vm.connect_console()
        a.write(b"a\n")
        self.vm.flush()
        b.write(b"b\n")
        self.vm.flush()
        self.assertEqual((self.console_log(), a.open, b.open), (b"a\nb\n", True, True))

    def test_chardevIsOpenFromTheStartAndIsNoRingBuffer(self) -> None:
        chardevs = {c["label"]: c for c in self.execute("query-chardev")["return"]}
        self.assertEqual(
            (chardevs["console"], self.read(device="console")),
            (
                {"frontend-open": True, "filename": "file", "label": "console"},
                {"error": {"class": "GenericError", "desc": "console is not a ringbuf device"}},
            ),
        )

    def test_rebootClosesTheConsole(self) -> None:
        console = self.vm.connect_console()
        self.vm.flush()
        self.execute("system_reset")
        self.assertFalse(console.open)

    def test_ringBufferConsoleKeepsHostWritesFromTheGuest(self) -> None:
        # As QEMU's char-ringbuf.c: ringbuf-write stores, the UART never reads it.
        vm = InMemoryVM(
            [
                "-machine",
                "q35",
                "-nodefaults",
                "-chardev",
                "ringbuf,id=console,size=64",
                "-serial",
                "chardev:console",
            ]
        )
        console = vm.connect_console()
        console.write(b"login: ")
        vm.flush()
        vm.machine.wiring.ringbuf_write("console", b"root\n")
        vm.flush()
        self.assertEqual(
            (console.received, vm.machine.wiring.ringbuf_read("console", 64)),
            (b"", b"login: root\n"),
        )

    def test_noConsoleWithoutSerial(self) -> None:
        vm = InMemoryVM(["-machine", "q35", "-nodefaults"])
        self.assertRaises(KeyError, vm.connect_console)


class PanicTests(_GuestSideTestCase):
    """A guest kernel panic, with and without a pvpanic device."""

    def panic(self) -> bytes:
        """The guest panics through its control channel; what the channel answered."""
        control = self.vm.connect_control()
        self.vm.flush()
        control.write(b"panic\n")
        self.vm.flush()
        return control.received

    def test_withPvpanicTheHostSeesItAndQEMUPowersOff(self) -> None:
        self.other_vm("-device", "pvpanic")
        self.panic()
        self.vm.advance()
        self.assertEqual(
            (self.events(), self.vm.exits),
            (
                [
                    ("GUEST_PANICKED", {"action": "poweroff"}),
                    ("SHUTDOWN", {"guest": True, "reason": "guest-panic"}),
                ],
                [(0, [])],
            ),
        )

    def test_pciPvpanicToo(self) -> None:
        self.other_vm("-device", "pvpanic-pci")
        self.panic()
        self.vm.advance()
        self.assertEqual(self.client.event_names(), ["GUEST_PANICKED", "SHUTDOWN"])

    def test_pvpanicWithoutThePanickedEventIsSilent(self) -> None:
        self.other_vm("-device", "pvpanic,events=2")
        self.panic()
        self.vm.advance(60)
        self.assertEqual((self.events(), self.vm.exits), ([], []))

    def test_withoutPvpanicTheGuestHangsUnseen(self) -> None:
        guest = self.guest(PORT)
        self.client.messages.clear()
        self.panic()
        guest.write(b"STARTED\n")
        self.vm.advance(3600)
        self.assertEqual(
            (self.events(), self.status(), self.read(), self.vm.exits, guest.open),
            ([], "running", "", [], True),
        )

    def test_aHungGuestOpensNothingAndIgnoresTheButton(self) -> None:
        control = self.vm.connect_control()
        self.vm.flush()
        control.write(b"panic\n")
        self.vm.flush()
        self.execute("system_powerdown")
        late = self.guest(PORT)
        control.write(b"poweroff\n")
        self.vm.flush()
        self.assertEqual(
            (control.received, late.open, self.vm.exits),
            (
                b"ok\nerror: the guest kernel panicked and hangs (no pvpanic device)\n",
                False,
                [],
            ),
        )

    def test_resetRevivesAHungGuest(self) -> None:
        self.panic()
        self.execute("system_reset")
        guest = self.guest(PORT)
        guest.write(b"STARTED\n")
        self.vm.flush()
        self.assertEqual(self.read(), "STARTED\n")

    def test_panicTimeoutOnTheKernelCommandLineReboots(self) -> None:
        write_kernel(self.path("vmlinuz"))
        self.other_vm("-kernel", self.path("vmlinuz"), "-append", "console=ttyS0 panic=3")
        self.panic()
        self.vm.advance(2.9)
        before = self.events()
        self.vm.advance(0.1)
        self.assertEqual(
            (before, self.events(), self.vm.machine.guest_hung),
            ([], [("RESET", {"guest": True, "reason": "guest-reset"})], False),
        )

    def test_pvpanicWinsOverThePanicTimeout(self) -> None:
        write_kernel(self.path("vmlinuz"))
        self.other_vm("-device", "pvpanic", "-kernel", self.path("vmlinuz"), "-append", "panic=3")
        self.panic()
        self.vm.advance(10)
        self.assertEqual(self.client.event_names(), ["GUEST_PANICKED", "SHUTDOWN"])


class ForwardTests(_GuestSideTestCase):
    """guestfwd: a guest connection runs the command, relayed both ways."""

    def test_connectionRunsTheCommandSplitWithoutAShell(self) -> None:
        self.vm.connect_forward(FORWARD)
        self.vm.flush()
        [command] = self.vm.commands
        self.assertEqual(
            (os.path.basename(command.executable), command.argv, command.cwd),
            ("socat", ["socat", "-", "UNIX-CONNECT:/a"], self.vm.config.cwd),
        )

    def test_bytesAreRelayedBothWays(self) -> None:
        guest = self.vm.connect_forward(FORWARD)
        self.vm.flush()
        process = self.vm.commands[0].process
        guest.write(b"GET /1.0\r\n")
        self.vm.flush()
        process.write(b"HTTP/1.1 200 OK\r\n")
        self.vm.flush()
        self.assertEqual(
            (process.received, guest.received), (b"GET /1.0\r\n", b"HTTP/1.1 200 OK\r\n")
        )

    def test_eachConnectionRunsItsOwnCommand(self) -> None:
        first, second = self.vm.connect_forward(FORWARD), self.vm.connect_forward(FORWARD)
        self.vm.flush()
        first.write(b"one")
        second.write(b"two")
        self.vm.flush()
        self.assertEqual([c.process.received for c in self.vm.commands], [b"one", b"two"])

    def test_commandEndingClosesTheGuestsConnection(self) -> None:
        guest = self.vm.connect_forward(FORWARD)
        self.vm.flush()
        self.vm.commands[0].process.close()
        self.vm.flush()
        self.assertFalse(guest.open)

    def test_guestClosingEndsTheCommandsConnection(self) -> None:
        guest = self.vm.connect_forward(FORWARD)
        self.vm.flush()
        guest.close()
        self.vm.flush()
        self.assertFalse(self.vm.commands[0].process.open)

    def test_rebootDropsForwardedConnections(self) -> None:
        guest = self.vm.connect_forward(FORWARD)
        self.vm.flush()
        self.execute("system_reset")
        self.assertEqual((guest.open, self.vm.commands[0].process.open), (False, False))

    def test_daemonizedQEMURunsCommandsFromTheRoot(self) -> None:
        self.other_vm("-daemonize")
        self.vm.connect_forward(FORWARD)
        self.vm.flush()
        self.assertEqual(self.vm.commands[0].cwd, "/")

    def test_commandThatCannotStartClosesTheConnectionAndSaysWhy(self) -> None:
        self.other_vm(
            "-netdev",
            "user,id=n1,guestfwd=tcp:10.0.2.101:1-cmd:nonexistent-command-xyz,"
            "guestfwd=tcp:10.0.2.101:2-cmd:sh -c 'echo x",
            "-device",
            "virtio-net-pci,netdev=n1",
        )
        missing = self.vm.connect_forward("10.0.2.101:1")
        unparsable = self.vm.connect_forward("10.0.2.101:2")
        self.vm.flush()
        self.assertEqual(
            (missing.open, unparsable.open, self.vm.commands, self.vm.messages),
            (
                False,
                False,
                [],
                [
                    "Slirp: fork_exec: Failed to execute child process "
                    "\u201cnonexistent-command-xyz\u201d (No such file or directory)",
                    "Slirp: fork_exec invalid command: sh -c 'echo x\n"
                    "error: Text ended before matching quote was found for '. "
                    "(The text was \u201csh -c 'echo x\u201d)",
                ],
            ),
        )

    def test_commandIsLookedUpOnQEMUsPath(self) -> None:
        vm = InMemoryVM(
            [
                "-machine",
                "q35",
                "-nodefaults",
                "-netdev",
                "user,id=n,guestfwd=tcp:10.0.2.100:1-cmd:sh -c true",
                "-device",
                "virtio-net-pci,netdev=n",
            ],
            environ={"PATH": "/nonexistent"},
        )
        vm.connect_forward("10.0.2.100:1")
        vm.flush()
        self.assertEqual(
            vm.messages,
            [
                "Slirp: fork_exec: Failed to execute child process \u201csh\u201d "
                "(No such file or directory)"
            ],
        )

    def test_unknownAddressIsAKeyError(self) -> None:
        self.assertRaises(KeyError, self.vm.connect_forward, "10.0.2.100:22")


class ShareTests(_GuestSideTestCase):
    """9p exports as a fake guest finds them."""

    def test_sharePathIsTheExportDirectory(self) -> None:
        self.assertEqual(self.vm.share_path("config"), self.path("config-drive"))

    def test_unknownTagIsAKeyError(self) -> None:
        self.assertRaises(KeyError, self.vm.share_path, "other")


class DeviceMigrationTests(_GuestSideTestCase):
    """A saved state names its PCI devices; a destination lacking one refuses it as QEMU does."""

    def saved(self) -> bytes:
        """The state of this test's VM, migrated to a file."""
        self.vm.machine.migration.migrate("exec:cat > /vm/state", self.vm.files.__setitem__)
        self.vm.advance()
        return self.vm.files["/vm/state"]

    def test_sameDevicesRestore(self) -> None:
        state = self.saved()
        vm = InMemoryVM(
            [*self.arguments(), "-incoming", "exec:cat /vm/state"], files={"/vm/state": state}
        )
        vm.clock.advance(EPOCH)
        client = RecordingQMPClient()
        vm.connect_qmp(client)
        vm.flush()
        self.assertEqual((vm.exits, vm.machine.run_state.value), ([], "running"))

    def test_missingNicIsAnUnknownRamBlock(self) -> None:
        state = self.saved()
        args = self.arguments()
        destination = args[: args.index("-netdev")]
        error_lines = self.refused(destination, state)
        self.assertEqual(
            error_lines,
            [
                'Unknown ramblock "0000:00:03.0/virtio-net-pci.rom", cannot accept migration',
                "error while loading state for instance 0x0 of device 'ram'",
                "load of migration failed: Invalid argument",
            ],
        )

    def test_missingLastDeviceIsAnUnknownSection(self) -> None:
        self.other_vm("-blockdev", self.disk(), "-device", "virtio-blk-pci,drive=root")
        state = self.saved()
        self.assertEqual(
            self.refused(self.arguments(), state),
            [
                "Unknown savevm section or instance '0000:00:04.0/virtio-blk' 0. Make sure that "
                "your current VM setup matches your saved VM setup, including any hotplugged "
                "devices",
                "load of migration failed: Invalid argument",
            ],
        )

    def test_isaPvpanicIsNotInTheStream(self) -> None:
        self.other_vm("-device", "pvpanic")
        state = self.saved()
        self.assertEqual(self.refused(self.arguments(), state), [])

    def disk(self) -> str:
        """A -blockdev on a fresh image."""
        write_qcow2(self.path("disk.qcow2"))
        return (
            f"driver=qcow2,node-name=root,file.driver=file,file.filename={self.path('disk.qcow2')}"
        )

    def refused(self, argv: list[str], state: bytes) -> list[str]:
        """The lines a destination built from ``argv`` refuses ``state`` with ([]: it loads)."""
        config = parse_command_line([*argv, "-incoming", "exec:cat /vm/state"])
        try:
            check_incoming(config, "/vm/state", state)
        except IncomingMigrationError as e:
            return e.lines
        return []
