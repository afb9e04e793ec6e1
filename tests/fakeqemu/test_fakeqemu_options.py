"""The options of vmready's real-guest command line (issue 11), taken and refused as QEMU does.

Every refusal text here was measured on qemu-system-x86_64 7.2 (Debian) with
the same arguments, unless the test says the refusal is fakeqemu's own
(something QEMU has but fakeqemu does not emulate).  Files are real: a
``-chardev file`` is created, images and kernels are read.
"""

from __future__ import annotations

import os
import struct

from twisted.trial.unittest import SynchronousTestCase

from fakeqemu._cmdline import (
    CommandLineError,
    FileChardevSpec,
    GuestForwardSpec,
    MachineConfig,
    PciDeviceSpec,
    parse_arguments,
    parse_command_line,
    program_name,
)
from fakeqemu._devices import VHOST_VSOCK_VARIABLE
from fakeqemu.testing import write_kernel, write_qcow2

BASE = ["-machine", "q35", "-nodefaults", "-display", "none", "-m", "64"]
FORWARD = "tcp:10.0.2.100:8443-cmd:socat - UNIX-CONNECT:/run/api.sock"
NETDEV = f"user,id=n0,restrict=on,net=10.0.2.0/24,ipv6=off,guestfwd={FORWARD}"
SECURITY_HINT = "Valid options are: security_model=[passthrough|mapped-xattr|mapped-file|none]"


class _OptionsTestCase(SynchronousTestCase):
    """A scratch directory for files, and helpers to parse in it."""

    def setUp(self) -> None:
        self.directory = os.path.abspath(self.mktemp())
        os.makedirs(self.directory)

    def path(self, name: str) -> str:
        """A path in the scratch directory."""
        return os.path.join(self.directory, name)

    def write(self, name: str, data: bytes) -> str:
        """A file in the scratch directory holding ``data``."""
        path = self.path(name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def parse(self, *argv: str) -> MachineConfig:
        """The configuration of ``BASE`` plus ``argv``."""
        return parse_command_line([*BASE, *argv], cwd=self.directory)

    def refusal(self, *argv: str) -> str:
        """The message ``BASE`` plus ``argv`` is refused with."""
        error: CommandLineError = self.assertRaises(
            CommandLineError, parse_command_line, [*BASE, *argv], self.directory
        )
        return str(error)

    def first_pass_refusal(self, *argv: str) -> str:
        """The message QEMU's option loop (to stderr, before -D opens) refuses ``argv`` with."""
        error: CommandLineError = self.assertRaises(
            CommandLineError, parse_arguments, [*BASE, *argv]
        )
        return str(error)

    def second_pass_refusal(self, *argv: str) -> str:
        """The message ``argv`` passes the option loop with, then is refused with."""
        parsed = parse_arguments([*BASE, *argv])
        error: CommandLineError = self.assertRaises(
            CommandLineError, parsed.configure, self.directory
        )
        return str(error)


class PortIdTests(_OptionsTestCase):
    """``id=`` on virtserialport: recorded, in the one namespace of device ids."""

    def test_portIdIsRecorded(self) -> None:
        config = self.parse(
            "-device",
            "virtio-serial-pci,id=vs0",
            "-device",
            "virtserialport,name=com.canonical.lxd,bus=vs0.0,id=com.canonical.lxd",
        )
        self.assertEqual(config.serial_ports[0].device_id, "com.canonical.lxd")

    def test_portIdSharesTheNamespaceOfDeviceIds(self) -> None:
        self.assertEqual(
            [
                self.first_pass_refusal(
                    "-device",
                    "virtio-serial-pci,id=vs0",
                    "-device",
                    "virtserialport,name=a,bus=vs0.0,id=vs0",
                ),
                self.first_pass_refusal(
                    "-device",
                    "virtio-serial-pci,id=vs0",
                    "-device",
                    "virtserialport,name=a,bus=vs0.0,id=a",
                    "-device",
                    "pvpanic,id=a",
                ),
            ],
            [
                "-device virtserialport,name=a,bus=vs0.0,id=vs0: Duplicate ID 'vs0' for device",
                "-device pvpanic,id=a: Duplicate ID 'a' for device",
            ],
        )


class FileChardevTests(_OptionsTestCase):
    """``-chardev file``: opened when QEMU creates its chardevs, truncated unless append=on."""

    def test_fileIsCreatedEmpty(self) -> None:
        config = self.parse("-chardev", "file,id=console,path=console.log,append=on")
        self.assertEqual(
            (config.file_chardevs, os.path.getsize(self.path("console.log"))),
            ((FileChardevSpec("console", "console.log", True),), 0),
        )

    def test_appendKeepsWhatTheFileHeld(self) -> None:
        self.write("console.log", b"earlier boot\n")
        self.parse("-chardev", "file,id=console,path=console.log,append=on")
        with open(self.path("console.log"), "rb") as f:
            self.assertEqual(f.read(), b"earlier boot\n")

    def test_withoutAppendTheFileIsTruncated(self) -> None:
        self.write("console.log", b"earlier boot\n")
        self.parse("-chardev", "file,id=console,path=console.log")
        self.assertEqual(os.path.getsize(self.path("console.log")), 0)

    def test_missingDirectoryIsRefused(self) -> None:
        self.assertEqual(
            self.second_pass_refusal("-chardev", "file,id=c,path=nodir/c.log,append=on"),
            "-chardev file,id=c,path=nodir/c.log,append=on: "
            "Could not open 'nodir/c.log': No such file or directory",
        )

    def test_missingPathIsRefused(self) -> None:
        self.assertEqual(
            self.second_pass_refusal("-chardev", "file,id=c"),
            "-chardev file,id=c: chardev: file: no filename given",
        )

    def test_appendMustBeABooleanInTheOptionLoop(self) -> None:
        self.assertEqual(
            self.first_pass_refusal("-chardev", "file,id=c,path=x.log,append=bogus"),
            "-chardev file,id=c,path=x.log,append=bogus: Parameter 'append' expects 'on' or 'off'",
        )

    def test_fileChardevIsNotARingBuffer(self) -> None:
        config = self.parse("-chardev", "file,id=console,path=c.log", "-serial", "chardev:console")
        self.assertEqual(config.ringbufs, ())


class SerialOptionTests(_OptionsTestCase):
    """``-serial chardev:ID``: the first UART's backend, found after the accelerator."""

    def test_serialConnectsTheChardev(self) -> None:
        config = self.parse("-chardev", "file,id=console,path=c.log", "-serial", "chardev:console")
        self.assertEqual(config.serial_chardev, "console")

    def test_chardevMayComeAfterTheSerialOption(self) -> None:
        config = self.parse("-serial", "chardev:console", "-chardev", "file,id=console,path=c.log")
        self.assertEqual(config.serial_chardev, "console")

    def test_serialNoneConnectsNothing(self) -> None:
        self.assertIsNone(self.parse("-serial", "none").serial_chardev)

    def test_unknownChardevIsRefused(self) -> None:
        self.assertEqual(
            self.second_pass_refusal("-serial", "chardev:nope"),
            "-serial chardev:nope: could not connect serial device to character backend "
            "'chardev:nope'",
        )

    def test_unknownBackendGetsQEMUsTwoLines(self) -> None:
        self.assertEqual(
            self.second_pass_refusal("-serial", "bogus:x"),
            "-serial bogus:x: 'bogus:x' is not a valid char driver\n"
            f"{program_name()}: -serial bogus:x: "
            "could not connect serial device to character backend 'bogus:x'",
        )

    def test_otherBackendsAreNotEmulated(self) -> None:
        # fakeqemu's own refusal: QEMU would write the serial port to stdio.
        self.assertEqual(
            self.refusal("-serial", "stdio"),
            "-serial stdio: fakeqemu connects serial ports only to 'chardev:ID'",
        )

    def test_serialChardevCannotAlsoBackAPort(self) -> None:
        self.assertEqual(
            self.refusal(
                "-chardev",
                "ringbuf,id=console",
                "-serial",
                "chardev:console",
                "-device",
                "virtio-serial-pci",
                "-device",
                "virtserialport,chardev=console,name=x",
            ),
            "-device virtserialport,chardev=console,name=x: Property 'virtserialport.chardev' "
            "can't take value 'console': Device 'console' is in use",
        )

    def test_serialErrorsComeAfterTheAccelerator(self) -> None:
        self.assertEqual(
            self.refusal("-serial", "chardev:nope", "-accel", "bogus"),
            "-accel bogus: invalid accelerator bogus",
        )


class PvpanicTests(_OptionsTestCase):
    """``-device pvpanic`` (ISA) and ``pvpanic-pci``."""

    def test_pvpanicIsRecordedWithBothEvents(self) -> None:
        self.assertEqual(self.parse("-device", "pvpanic").pvpanic_events, 3)

    def test_noPvpanicByDefault(self) -> None:
        self.assertIsNone(self.parse().pvpanic_events)

    def test_isaPvpanicTakesNoPciSlot(self) -> None:
        config = self.parse("-device", "pvpanic", "-device", "virtio-serial-pci")
        self.assertEqual(config.serial_buses[0].pci_address, "0000:00:01.0")

    def test_pciPvpanicTakesASlotAndMigrates(self) -> None:
        self.assertEqual(
            self.parse("-device", "pvpanic-pci").pci_devices,
            (PciDeviceSpec("0000:00:01.0", "pvpanic-pci"),),
        )

    def test_secondIsaPvpanicIsRefused(self) -> None:
        self.assertEqual(
            self.refusal("-device", "pvpanic", "-device", "pvpanic"),
            "-device pvpanic: duplicate fw_cfg file name: etc/pvpanic-port",
        )

    def test_pvpanicNeedsAnIsaBus(self) -> None:
        error = self.assertRaises(
            CommandLineError,
            parse_command_line,
            ["-machine", "none", "-device", "pvpanic"],
            self.directory,
        )
        self.assertEqual(str(error), "-device pvpanic: No 'ISA' bus found for device 'pvpanic'")

    def test_unknownPropertyIsRefused(self) -> None:
        self.assertEqual(
            self.refusal("-device", "pvpanic,foo=1"),
            "-device pvpanic,foo=1: Property 'pvpanic.foo' not found",
        )


class RngTests(_OptionsTestCase):
    """``-device virtio-rng-pci``: a PCI slot and a migration section, as QEMU 7.2 gives it."""

    def test_takesTheNextSlotAndMigratesAsVirtioRng(self) -> None:
        # Measured: a q35 with only this device saves '0000:00:01.0/virtio-rng'.
        self.assertEqual(
            self.parse("-device", "virtio-rng-pci").pci_devices,
            (PciDeviceSpec("0000:00:01.0", "virtio-rng"),),
        )

    def test_aliasAndIdAreAccepted(self) -> None:
        config = self.parse("-device", "virtio-serial-pci", "-device", "virtio-rng,id=rng0")
        self.assertEqual(
            [device.address for device in config.pci_devices], ["0000:00:01.0", "0000:00:02.0"]
        )

    def test_unmodelledPropertyIsRefused(self) -> None:
        self.assertEqual(
            self.refusal("-device", "virtio-rng-pci,max-bytes=1024"),
            "-device virtio-rng-pci,max-bytes=1024: Property 'virtio-rng-pci.max-bytes' not found",
        )


class FsdevTests(_OptionsTestCase):
    """``-fsdev local`` and ``virtio-9p-pci``."""

    def share(self) -> str:
        """An export directory."""
        path = self.path("config-drive")
        os.makedirs(path, exist_ok=True)
        return path

    def test_exportIsRecorded(self) -> None:
        share = self.share()
        config = self.parse(
            "-fsdev",
            f"local,id=config,path={share},security_model=none,readonly=on",
            "-device",
            "virtio-9p-pci,fsdev=config,mount_tag=config",
        )
        [export] = config.shares
        self.assertEqual(
            (export.mount_tag, export.fsdev.path, export.fsdev.readonly, config.pci_devices),
            ("config", share, True, (PciDeviceSpec("0000:00:01.0", "virtio-9p"),)),
        )

    def test_missingExportIsRefusedByTheDevice(self) -> None:
        missing = self.path("nope")
        self.assertEqual(
            self.second_pass_refusal(
                "-fsdev",
                f"local,id=config,path={missing},security_model=none,readonly=on",
                "-device",
                "virtio-9p-pci,fsdev=config,mount_tag=config",
            ),
            "-device virtio-9p-pci,fsdev=config,mount_tag=config: cannot initialize fsdev "
            f"'config': failed to open '{missing}': No such file or directory",
        )

    def test_missingExportWithoutADeviceIsFine(self) -> None:
        config = self.parse("-fsdev", "local,id=c,path=nope,security_model=none")
        self.assertEqual(config.shares, ())

    def test_exportThatIsAFileIsRefused(self) -> None:
        self.write("file", b"x")
        self.assertEqual(
            self.refusal(
                "-fsdev",
                "local,id=c,path=file,security_model=none",
                "-device",
                "virtio-9p-pci,fsdev=c,mount_tag=t",
            ),
            "-device virtio-9p-pci,fsdev=c,mount_tag=t: cannot initialize fsdev 'c': "
            "failed to open 'file': Not a directory",
        )

    def test_fsdevBackendErrors(self) -> None:
        share = self.share()
        self.assertEqual(
            [
                self.second_pass_refusal("-fsdev", "local,id=c,security_model=none"),
                self.second_pass_refusal("-fsdev", f"local,id=c,path={share}"),
                self.second_pass_refusal("-fsdev", f"local,id=c,path={share},security_model=x"),
                self.second_pass_refusal("-fsdev", f"local,path={share},security_model=none"),
                self.second_pass_refusal("-fsdev", f"bogus,id=c,path={share}"),
                self.second_pass_refusal("-fsdev", f"id=c,path={share},security_model=none"),
                self.second_pass_refusal(
                    "-fsdev", f"local,id=c,path={share},security_model=none,socket=/x"
                ),
                self.second_pass_refusal(
                    "-fsdev", f"local,id=c,path={share},security_model=none,multidevs=x"
                ),
                self.second_pass_refusal(
                    "-fsdev", f"local,id=c,path={share},security_model=none,fmode=0600"
                ),
            ],
            [
                "-fsdev local,id=c,security_model=none: path property not set",
                f"-fsdev local,id=c,path={share}: security_model property not set\n"
                + SECURITY_HINT,
                f"-fsdev local,id=c,path={share},security_model=x: "
                f"invalid security_model property 'x'\n{SECURITY_HINT}",
                f"-fsdev local,path={share},security_model=none: fsdev: No id specified",
                f"-fsdev bogus,id=c,path={share}: fsdev: fsdriver bogus not found",
                f"-fsdev id=c,path={share},security_model=none: fsdev: No fsdriver specified",
                f"-fsdev local,id=c,path={share},security_model=none,socket=/x: "
                "'socket' is invalid for fsdriver 'local'",
                f"-fsdev local,id=c,path={share},security_model=none,multidevs=x: "
                "invalid multidevs property 'x'\nValid options are: multidevs=[remap|forbid|warn]",
                f"-fsdev local,id=c,path={share},security_model=none,fmode=0600: "
                "fmode is only valid for mapped security modes",
            ],
        )

    def test_fsdevOptionLoopErrors(self) -> None:
        share = self.share()
        self.assertEqual(
            [
                self.first_pass_refusal(
                    "-fsdev",
                    f"local,id=c,path={share},security_model=none",
                    "-fsdev",
                    f"local,id=c,path={share},security_model=none",
                ),
                self.first_pass_refusal(
                    "-fsdev", f"local,id=c,path={share},security_model=none,foo=1"
                ),
                self.first_pass_refusal(
                    "-fsdev", f"local,id=c,path={share},security_model=none,readonly=x"
                ),
            ],
            [
                f"-fsdev local,id=c,path={share},security_model=none: Duplicate ID 'c' for fsdev",
                f"-fsdev local,id=c,path={share},security_model=none,foo=1: "
                "Invalid parameter 'foo'",
                f"-fsdev local,id=c,path={share},security_model=none,readonly=x: "
                "Parameter 'readonly' expects 'on' or 'off'",
            ],
        )

    def test_nineDeviceErrors(self) -> None:
        fsdev = f"local,id=c,path={self.share()},security_model=none"
        long_tag = "a" * 40
        self.assertEqual(
            [
                self.refusal("-fsdev", fsdev, "-device", "virtio-9p-pci,fsdev=other,mount_tag=t"),
                self.refusal("-device", "virtio-9p-pci,mount_tag=t"),
                self.refusal("-fsdev", fsdev, "-device", "virtio-9p-pci,fsdev=c"),
                self.refusal(
                    "-fsdev", fsdev, "-device", f"virtio-9p-pci,fsdev=c,mount_tag={long_tag}"
                ),
                self.refusal(
                    "-fsdev", fsdev, "-device", "virtio-9p-pci,fsdev=c,mount_tag=t,foo=1"
                ),
            ],
            [
                "-device virtio-9p-pci,fsdev=other,mount_tag=t: "
                "9pfs device couldn't find fsdev with the id = other",
                "-device virtio-9p-pci,mount_tag=t: "
                "9pfs device couldn't find fsdev with the id = NULL",
                "-device virtio-9p-pci,fsdev=c: fsdev with id c needs mount_tag arguments",
                f"-device virtio-9p-pci,fsdev=c,mount_tag={long_tag}: mount tag '{long_tag}' "
                "(40 bytes) is longer than maximum (31 bytes)",
                "-device virtio-9p-pci,fsdev=c,mount_tag=t,foo=1: "
                "Property 'virtio-9p-pci.foo' not found",
            ],
        )

    def test_thirtyOneByteTagIsTheLongest(self) -> None:
        fsdev = f"local,id=c,path={self.share()},security_model=none"
        config = self.parse(
            "-fsdev", fsdev, "-device", f"virtio-9p-pci,fsdev=c,mount_tag={'a' * 31}"
        )
        self.assertEqual(config.shares[0].mount_tag, "a" * 31)

    def test_twoDevicesMayExportOneFsdev(self) -> None:
        fsdev = f"local,id=c,path={self.share()},security_model=none"
        config = self.parse(
            "-fsdev",
            fsdev,
            "-device",
            "virtio-9p-pci,fsdev=c,mount_tag=a",
            "-device",
            "virtio-9p-pci,fsdev=c,mount_tag=b",
        )
        self.assertEqual([s.mount_tag for s in config.shares], ["a", "b"])

    def test_tagThatCannotNameAFileIsRefused(self) -> None:
        # fakeqemu's own refusal: QEMU takes the tag, fakeqemu cannot show it as 9p/<tag>.
        fsdev = f"local,id=c,path={self.share()},security_model=none"
        self.assertEqual(
            self.refusal("-fsdev", fsdev, "-device", "virtio-9p-pci,fsdev=c,mount_tag=a/b"),
            "-device virtio-9p-pci,fsdev=c,mount_tag=a/b: fakeqemu shows a 9p export as a file "
            "named after its mount tag; 'a/b' cannot be one",
        )

    def test_fsdevErrorsComeAfterChardevsAndBeforeMachineProperties(self) -> None:
        self.assertEqual(
            [
                self.refusal(
                    "-fsdev", "local,id=c,security_model=none", "-chardev", "ringbuf,id=r,size=3"
                ),
                self.refusal("-fsdev", "local,id=c,security_model=none", "-machine", "q35,foo=1"),
            ],
            [
                "-chardev ringbuf,id=r,size=3: size of ringbuf chardev must be power of two",
                "-fsdev local,id=c,security_model=none: path property not set",
            ],
        )


class UserNetdevTests(_OptionsTestCase):
    """``-netdev user`` with guestfwd rules, and ``virtio-net-pci``."""

    def test_fallbackNetdevAndNic(self) -> None:
        config = self.parse(
            "-netdev", NETDEV, "-device", "virtio-net-pci,netdev=n0,mac=52:54:00:76:6d:01"
        )
        self.assertEqual(
            (config.guest_forwards, config.nics[0].mac, config.warnings),
            (
                (GuestForwardSpec("10.0.2.100", 8443, "socat - UNIX-CONNECT:/run/api.sock"),),
                "52:54:00:76:6d:01",
                (),
            ),
        )

    def test_doubledCommasInTheCommandAreCommas(self) -> None:
        config = self.parse(
            "-netdev",
            "user,id=n0,guestfwd=tcp:10.0.2.100:1-cmd:socat - UNIX-CONNECT:/a,,b",
            "-device",
            "virtio-net-pci,netdev=n0",
        )
        self.assertEqual(config.guest_forwards[0].command, "socat - UNIX-CONNECT:/a,b")

    def test_everyGuestfwdRuleIsKept(self) -> None:
        config = self.parse(
            "-netdev",
            "user,id=n0,guestfwd=tcp:10.0.2.100:1-cmd:a,guestfwd=tcp:10.0.2.101:2-cmd:b",
            "-device",
            "virtio-net-pci,netdev=n0",
        )
        self.assertEqual(
            [f.socket_name for f in config.guest_forwards], ["10.0.2.100:1", "10.0.2.101:2"]
        )

    def test_emptyAddressIsTheNetworksFourthHost(self) -> None:
        # libslirp's slirp_add_exec (QEMU accepts the rule, measured).
        config = self.parse(
            "-netdev",
            "user,id=n0,guestfwd=tcp::80-cmd:true",
            "-device",
            "virtio-net-pci,netdev=n0",
        )
        self.assertEqual(config.guest_forwards[0].address, "10.0.2.4")

    def test_rulesOfANetdevWithoutNicReachNoGuest(self) -> None:
        config = self.parse("-netdev", NETDEV)
        self.assertEqual(
            (config.guest_forwards, config.warnings), ((), ("warning: netdev n0 has no peer",))
        )

    def test_nicWithoutNetdevWarns(self) -> None:
        self.assertEqual(
            [
                self.parse("-device", "virtio-net-pci").warnings,
                self.parse("-device", "virtio-net-pci,id=nic0").warnings,
            ],
            [("warning: nic virtio-net-pci.0 has no peer",), ("warning: nic nic0 has no peer",)],
        )

    def test_malformedRules(self) -> None:
        rules = [
            "tcp:10.0.2.100-cmd:true",
            "tcp:10.0.2.100:8443",
            "udp:10.0.2.100:8443-cmd:true",
            "tcp:10.0.2.300:8443-cmd:true",
            "tcp:10.0.2.100:99999-cmd:true",
        ]
        self.assertEqual(
            [self.second_pass_refusal("-netdev", f"user,id=n,guestfwd={r}") for r in rules],
            [
                f"-netdev user,id=n,guestfwd={r}: Invalid guest forwarding rule '{r}'"
                for r in rules
            ],
        )

    def test_conflictingAddresses(self) -> None:
        rules = [
            "tcp:10.0.2.2:80-cmd:true",
            "tcp:10.0.2.3:80-cmd:true",
            "tcp:192.168.0.1:80-cmd:true",
        ]
        self.assertEqual(
            [self.refusal("-netdev", f"user,id=n,guestfwd={r}") for r in rules],
            [
                f"-netdev user,id=n,guestfwd={r}: "
                f"Conflicting/invalid host:port in guest forwarding rule '{r}'"
                for r in rules
            ],
        )

    def test_invalidCharDriverRuleGetsQEMUsTwoLines(self) -> None:
        self.assertEqual(
            self.refusal("-netdev", "user,id=n,guestfwd=tcp:10.0.2.100:80-bogus:x"),
            "-netdev user,id=n,guestfwd=tcp:10.0.2.100:80-bogus:x: "
            "'bogus:x' is not a valid char driver\n"
            f"{program_name()}: -netdev user,id=n,guestfwd=tcp:10.0.2.100:80-bogus:x: "
            "Could not open guest forwarding device 'guestfwd.tcp.80'",
        )

    def test_netdevErrors(self) -> None:
        self.assertEqual(
            [
                self.second_pass_refusal("-netdev", "user,restrict=on"),
                self.second_pass_refusal("-netdev", "id=n"),
                self.second_pass_refusal("-netdev", "bogus,id=n"),
                self.second_pass_refusal("-netdev", "user,id=n,restrict=bogus"),
                self.second_pass_refusal("-netdev", "user,id=n,ipv6=bogus"),
                self.second_pass_refusal("-netdev", "user,id=n,foo=1"),
                self.second_pass_refusal("-netdev", "user,id=n,net=10.0.2.0/33"),
                self.second_pass_refusal("-netdev", "user,id=n,net=foo"),
            ],
            [
                "-netdev user,restrict=on: Parameter 'id' is missing",
                "-netdev id=n: Parameter 'type' is missing",
                "-netdev bogus,id=n: Parameter 'type' does not accept value 'bogus'",
                "-netdev user,id=n,restrict=bogus: Parameter 'restrict' expects 'on' or 'off'",
                "-netdev user,id=n,ipv6=bogus: Parameter 'ipv6' expects 'on' or 'off'",
                "-netdev user,id=n,foo=1: Invalid parameter 'foo'",
                "-netdev user,id=n,net=10.0.2.0/33: "
                "Invalid netmask provided (must be in range 4-32)",
                "-netdev user,id=n,net=foo: Failed to parse netmask",
            ],
        )

    def test_duplicateNetdevIdIsAnOptionLoopError(self) -> None:
        self.assertEqual(
            self.first_pass_refusal("-netdev", "user,id=n", "-netdev", "user,id=n"),
            "-netdev user,id=n: Duplicate ID 'n' for netdev",
        )

    def test_otherNetdevTypesAndOptionsAreNotEmulated(self) -> None:
        # fakeqemu's own refusals: QEMU has these.
        self.assertEqual(
            [
                self.refusal("-netdev", "tap,id=n"),
                self.refusal("-netdev", "user,id=n,hostfwd=tcp::2222-:22"),
            ],
            [
                "-netdev tap,id=n: fakeqemu does not emulate the 'tap' netdev",
                "-netdev user,id=n,hostfwd=tcp::2222-:22: "
                "fakeqemu does not emulate the user netdev's 'hostfwd'",
            ],
        )

    def test_nicErrors(self) -> None:
        self.assertEqual(
            [
                self.refusal(
                    "-netdev",
                    "user,id=n",
                    "-device",
                    "virtio-net-pci,netdev=other,mac=52:54:00:76:6d:01",
                ),
                self.refusal(
                    "-netdev", "user,id=n", "-device", "virtio-net-pci,netdev=n,mac=52:54:00:76:6d"
                ),
                self.refusal(
                    "-netdev",
                    "user,id=n",
                    "-device",
                    "virtio-net-pci,netdev=n,mac=zz:54:00:76:6d:01",
                ),
                self.refusal(
                    "-netdev",
                    "user,id=n",
                    "-device",
                    "virtio-net-pci,netdev=n",
                    "-device",
                    "virtio-net-pci,netdev=n",
                ),
                self.refusal("-device", "virtio-net-pci,foo=1"),
            ],
            [
                "-device virtio-net-pci,netdev=other,mac=52:54:00:76:6d:01: "
                "Property 'virtio-net-device.netdev' can't find value 'other'",
                "-device virtio-net-pci,netdev=n,mac=52:54:00:76:6d: "
                "Property 'virtio-net-device.mac' doesn't take value '52:54:00:76:6d'",
                "-device virtio-net-pci,netdev=n,mac=zz:54:00:76:6d:01: "
                "Property 'virtio-net-device.mac' doesn't take value 'zz:54:00:76:6d:01'",
                "-device virtio-net-pci,netdev=n: "
                "Property 'virtio-net-device.netdev' can't take value 'n', it's in use",
                "-device virtio-net-pci,foo=1: Property 'virtio-net-pci.foo' not found",
            ],
        )

    def test_macSpellings(self) -> None:
        macs = ["52-54-00-76-6d-01", "52:54:00:76:6D:01", "01:54:00:76:6d:01"]
        self.assertEqual(
            [self.parse("-device", f"virtio-net-pci,mac={mac}").nics[0].mac for mac in macs],
            ["52:54:00:76:6d:01", "52:54:00:76:6d:01", "01:54:00:76:6d:01"],
        )

    def test_nicHasAnOptionRom(self) -> None:
        self.assertEqual(
            self.parse("-device", "virtio-net-pci").pci_devices,
            (PciDeviceSpec("0000:00:01.0", "virtio-net", "virtio-net-pci.rom"),),
        )

    def test_netdevErrorsComeAfterTheAcceleratorAndBeforeSerial(self) -> None:
        self.assertEqual(
            [
                self.refusal("-netdev", "user,id=n,restrict=x", "-accel", "bogus"),
                self.refusal("-serial", "chardev:nope", "-netdev", "user,id=n,restrict=x"),
            ],
            [
                "-accel bogus: invalid accelerator bogus",
                "-netdev user,id=n,restrict=x: Parameter 'restrict' expects 'on' or 'off'",
            ],
        )


class VhostVsockTests(_OptionsTestCase):
    """``vhost-vsock-pci``: refused as QEMU refuses it where /dev/vhost-vsock is missing."""

    def vsock_device(self, path: str) -> None:
        """Make vhost-vsock open ``path`` instead of /dev/vhost-vsock."""
        self.patch(os, "environ", {**os.environ, VHOST_VSOCK_VARIABLE: path})

    def test_missingDeviceIsRefusedInQEMUsWords(self) -> None:
        self.vsock_device(self.path("no-vhost-vsock"))
        self.assertEqual(
            self.second_pass_refusal("-device", "vhost-vsock-pci,guest-cid=5"),
            "-device vhost-vsock-pci,guest-cid=5: "
            "vhost-vsock: failed to open vhost device: No such file or directory",
        )

    def test_deviceThatOpensIsAccepted(self) -> None:
        self.vsock_device(self.write("vhost-vsock", b""))
        config = self.parse("-device", "vhost-vsock-pci,guest-cid=5")
        self.assertEqual(
            (config.vsock_cid, config.pci_devices),
            (5, (PciDeviceSpec("0000:00:01.0", "vhost-vsock"),)),
        )

    def test_guestCidChecks(self) -> None:
        self.vsock_device(self.write("vhost-vsock", b""))
        values = ["2", "0", "4294967296", "-1", "x"]
        self.assertEqual(
            [self.refusal("-device", f"vhost-vsock-pci,guest-cid={v}") for v in values]
            + [self.refusal("-device", "vhost-vsock-pci")],
            [
                "-device vhost-vsock-pci,guest-cid=2: guest-cid property must be greater than 2",
                "-device vhost-vsock-pci,guest-cid=0: guest-cid property must be greater than 2",
                "-device vhost-vsock-pci,guest-cid=4294967296: "
                "guest-cid property must be a 32-bit number",
                "-device vhost-vsock-pci,guest-cid=-1: guest-cid property must be a 32-bit number",
                "-device vhost-vsock-pci,guest-cid=x: Parameter 'guest-cid' expects integer",
                "-device vhost-vsock-pci: guest-cid property must be greater than 2",
            ],
        )

    def test_largestCidIsAccepted(self) -> None:
        self.vsock_device(self.write("vhost-vsock", b""))
        self.assertEqual(
            self.parse("-device", "vhost-vsock-pci,guest-cid=4294967295").vsock_cid, 4294967295
        )


class BlockdevTests(_OptionsTestCase):
    """``-blockdev driver=qcow2,…,file.driver=file,file.filename=P`` and ``virtio-blk-pci``."""

    def blockdev(self, filename: str, node: str = "root") -> str:
        """The contract's -blockdev for ``filename``."""
        return f"driver=qcow2,node-name={node},file.driver=file,file.filename={filename}"

    def disk(self, filename: str) -> list[str]:
        """-blockdev and the virtio-blk-pci using it."""
        return ["-blockdev", self.blockdev(filename), "-device", "virtio-blk-pci,drive=root"]

    def image_refusal(self, filename: str) -> str:
        """The message a disk on ``filename`` is refused with, without the option prefix."""
        message = self.second_pass_refusal(*self.disk(filename))
        prefix = f"-blockdev {self.blockdev(filename)}: "
        self.assertTrue(message.startswith(prefix), message)
        return message[len(prefix) :]

    def test_imageAndDiskAreRecorded(self) -> None:
        write_qcow2(self.path("base.qcow2"))
        write_qcow2(self.path("disk.qcow2"), backing_file="base.qcow2", backing_format="qcow2")
        config = self.parse(*self.disk("disk.qcow2"))
        self.assertEqual(
            (config.blockdevs[0].backing_chain, config.disks[0].drive, config.pci_devices),
            (("base.qcow2",), "root", (PciDeviceSpec("0000:00:01.0", "virtio-blk"),)),
        )

    def test_missingImage(self) -> None:
        self.assertEqual(
            self.image_refusal("nope.qcow2"),
            "Could not open 'nope.qcow2': No such file or directory",
        )

    def test_imageThatIsNotQcow2(self) -> None:
        self.write("text.txt", b"hello\n")
        self.write("raw.img", bytes(1 << 20))
        self.write("empty.qcow2", b"")
        self.assertEqual(
            [self.image_refusal(name) for name in ("text.txt", "raw.img", "empty.qcow2")],
            ["Image is not in qcow2 format"] * 3,
        )

    def test_directoryAndDeviceAreNotImages(self) -> None:
        os.makedirs(self.path("dir"))
        self.assertEqual(
            [self.image_refusal("dir"), self.image_refusal("/dev/null")],
            [
                "Could not open 'dir': Is a directory",
                "'file' driver requires '/dev/null' to be a regular file",
            ],
        )

    def test_missingBackingFile(self) -> None:
        write_qcow2(
            self.path("disk.qcow2"), backing_file=self.path("gone.qcow2"), backing_format="qcow2"
        )
        self.assertEqual(
            self.image_refusal("disk.qcow2"),
            f"Could not open backing file: Could not open '{self.path('gone.qcow2')}': "
            "No such file or directory",
        )

    def test_relativeBackingFileIsRelativeToTheImage(self) -> None:
        os.makedirs(self.path("sub"))
        write_qcow2(self.path("sub/disk.qcow2"), backing_file="gone.qcow2", backing_format="qcow2")
        self.assertEqual(
            self.image_refusal("sub/disk.qcow2"),
            "Could not open backing file: "
            "Could not open 'sub/gone.qcow2': No such file or directory",
        )

    def test_missingFileDeeperInTheChainNamesEveryLevel(self) -> None:
        write_qcow2(
            self.path("middle.qcow2"), backing_file=self.path("gone.qcow2"), backing_format="qcow2"
        )
        write_qcow2(
            self.path("top.qcow2"), backing_file=self.path("middle.qcow2"), backing_format="qcow2"
        )
        self.assertEqual(
            self.image_refusal("top.qcow2"),
            "Could not open backing file: Could not open backing file: "
            f"Could not open '{self.path('gone.qcow2')}': No such file or directory",
        )

    def test_backingFileInTheWrongFormat(self) -> None:
        self.write("text.txt", b"hello\n")
        write_qcow2(self.path("disk.qcow2"), backing_file="text.txt", backing_format="qcow2")
        self.assertEqual(
            self.image_refusal("disk.qcow2"),
            "Could not open backing file: Image is not in qcow2 format",
        )

    def test_rawBackingFileIsNotRead(self) -> None:
        self.write("text.txt", b"hello\n")
        write_qcow2(self.path("disk.qcow2"), backing_file="text.txt", backing_format="raw")
        self.assertEqual(
            self.parse(*self.disk("disk.qcow2")).blockdevs[0].backing_chain, ("text.txt",)
        )

    def test_backingFileThatIsADirectory(self) -> None:
        os.makedirs(self.path("dir"))
        write_qcow2(self.path("disk.qcow2"), backing_file=self.path("dir"), backing_format="raw")
        self.assertEqual(
            self.image_refusal("disk.qcow2"),
            f"Could not open backing file: 'file' driver requires '{self.path('dir')}' "
            "to be a regular file",
        )

    def test_unknownDriveAndMissingDrive(self) -> None:
        write_qcow2(self.path("disk.qcow2"))
        self.assertEqual(
            [
                self.refusal(
                    "-blockdev",
                    self.blockdev("disk.qcow2"),
                    "-device",
                    "virtio-blk-pci,drive=other",
                ),
                self.refusal("-device", "virtio-blk-pci"),
            ],
            [
                "-device virtio-blk-pci,drive=other: "
                "Property 'virtio-blk-device.drive' can't find value 'other'",
                "-device virtio-blk-pci: drive property not set",
            ],
        )

    def test_secondWriterOfANodeIsRefused(self) -> None:
        write_qcow2(self.path("disk.qcow2"))
        self.assertEqual(
            self.refusal(
                "-blockdev",
                self.blockdev("disk.qcow2"),
                "-device",
                "pvpanic",
                "-device",
                "virtio-blk-pci,drive=root,id=d0",
                "-device",
                "virtio-blk-pci,drive=root",
            ),
            "-device virtio-blk-pci,drive=root: Permission conflict on node 'root': permissions "
            "'write' are both required by block device '/machine/peripheral/d0/virtio-backend' "
            "(uses node 'root' as 'root' child) and unshared by block device "
            "'/machine/peripheral-anon/device[1]/virtio-backend' "
            "(uses node 'root' as 'root' child).",
        )

    def test_readOnlyNodeMayBackTwoDisks(self) -> None:
        write_qcow2(self.path("disk.qcow2"))
        config = self.parse(
            "-blockdev",
            self.blockdev("disk.qcow2") + ",read-only=on",
            "-device",
            "virtio-blk-pci,drive=root",
            "-device",
            "virtio-blk-pci,drive=root",
        )
        self.assertEqual(len(config.disks), 2)

    def test_nodeNameErrors(self) -> None:
        write_qcow2(self.path("disk.qcow2"))
        self.write("text.txt", b"hello\n")
        self.assertEqual(
            [
                self.refusal("-blockdev", "driver=qcow2,file.driver=file,file.filename=nope"),
                self.refusal("-blockdev", self.blockdev("nope", node="1root")),
                self.refusal("-blockdev", self.blockdev("text.txt", node="1root")),
                self.refusal("-blockdev", self.blockdev("disk.qcow2", node="a" * 41)),
                self.refusal(
                    "-blockdev",
                    self.blockdev("disk.qcow2"),
                    "-blockdev",
                    self.blockdev("text.txt"),
                ),
            ],
            [
                "-blockdev driver=qcow2,file.driver=file,file.filename=nope: "
                "'node-name' must be specified for the root node",
                f"-blockdev {self.blockdev('nope', node='1root')}: "
                "Could not open 'nope': No such file or directory",
                f"-blockdev {self.blockdev('text.txt', node='1root')}: Invalid node-name: '1root'",
                f"-blockdev {self.blockdev('disk.qcow2', node='a' * 41)}: Node name too long",
                f"-blockdev {self.blockdev('text.txt')}: Duplicate nodes with node-name='root'",
            ],
        )

    def test_schemaErrorsAreOptionLoopErrors(self) -> None:
        self.assertEqual(
            [
                self.first_pass_refusal(
                    "-blockdev", "node-name=root,file.driver=file,file.filename=x"
                ),
                self.first_pass_refusal("-blockdev", "driver=bogus,node-name=root"),
                self.first_pass_refusal(
                    "-blockdev", "driver=qcow2,node-name=root,file.filename=x"
                ),
                self.first_pass_refusal(
                    "-blockdev", "driver=qcow2,node-name=root,file.driver=file"
                ),
                self.first_pass_refusal("-blockdev", self.blockdev("x") + ",foo=1"),
                self.first_pass_refusal("-blockdev", self.blockdev("x") + ",bogus"),
            ],
            [
                "-blockdev node-name=root,file.driver=file,file.filename=x: "
                "Parameter 'driver' is missing",
                "-blockdev driver=bogus,node-name=root: "
                "Parameter 'driver' does not accept value 'bogus'",
                "-blockdev driver=qcow2,node-name=root,file.filename=x: "
                "Parameter 'file.driver' is missing",
                "-blockdev driver=qcow2,node-name=root,file.driver=file: "
                "Parameter 'file.filename' is missing",
                f"-blockdev {self.blockdev('x')},foo=1: Parameter 'foo' is unexpected",
                f"-blockdev {self.blockdev('x')},bogus: Expected '=' after parameter 'bogus'",
            ],
        )

    def test_blockdevsOpenAfterFsdevsAndBeforeMachineProperties(self) -> None:
        self.assertEqual(
            [
                self.refusal(
                    "-blockdev", self.blockdev("nope"), "-fsdev", "local,id=c,security_model=none"
                ),
                self.refusal("-blockdev", self.blockdev("nope"), "-machine", "q35,foo=1"),
            ],
            [
                "-fsdev local,id=c,security_model=none: path property not set",
                f"-blockdev {self.blockdev('nope')}: "
                "Could not open 'nope': No such file or directory",
            ],
        )


class Qcow2HeaderRefusalTests(_OptionsTestCase):
    """Broken headers, refused with the text QEMU 7.2 printed for the same bytes."""

    def patched(self, name: str, offset: int, fmt: str, value: int) -> str:
        """An empty image with one header field changed."""
        path = self.path(name)
        write_qcow2(path)
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(struct.pack(fmt, value))
        return name

    def refused(self, name: str) -> str:
        """The image's refusal, without the option prefix."""
        blockdev = f"driver=qcow2,node-name=root,file.driver=file,file.filename={name}"
        return self.refusal("-blockdev", blockdev)[len(f"-blockdev {blockdev}: ") :]

    def test_headerFieldChecks(self) -> None:
        self.write("magic-only.qcow2", b"QFI\xfb")
        cases = [
            ("magic-only.qcow2", "Unsupported qcow2 version 0"),
            (self.patched("v4.qcow2", 4, ">I", 4), "Unsupported qcow2 version 4"),
            (self.patched("v1.qcow2", 4, ">I", 1), "Unsupported qcow2 version 1"),
            (self.patched("cb8.qcow2", 20, ">I", 8), "Unsupported cluster size: 2^8"),
            (self.patched("cb22.qcow2", 20, ">I", 22), "Unsupported cluster size: 2^22"),
            (self.patched("hl100.qcow2", 100, ">I", 100), "qcow2 header too short"),
            (self.patched("bo.qcow2", 8, ">Q", 70000), "Invalid backing file offset"),
            (self.patched("crypt3.qcow2", 32, ">I", 3), "Unsupported encryption method 3"),
        ]
        self.assertEqual([(n, self.refused(n)) for n, _ in cases], cases)

    def test_headerLongerThanAClusterAndLongBackingName(self) -> None:
        small = self.patched("hlbig.qcow2", 20, ">I", 9)
        with open(self.path(small), "r+b") as f:
            f.seek(100)
            f.write(struct.pack(">I", 600))
        long_name = self.patched("bn.qcow2", 8, ">Q", 1024)
        with open(self.path(long_name), "r+b") as f:
            f.seek(16)
            f.write(struct.pack(">I", 1024))
        self.assertEqual(
            [self.refused(small), self.refused(long_name)],
            ["qcow2 header exceeds cluster size", "Backing file name too long"],
        )


class KernelTests(_OptionsTestCase):
    """``-kernel``, ``-initrd``, ``-append``: the x86 loader's checks, its ``qemu:`` lines."""

    def test_kernelInitrdAndAppendAreRecorded(self) -> None:
        write_kernel(self.path("vmlinuz"))
        self.write("initrd.img", b"\0" * 1024)
        config = self.parse(
            "-kernel", "vmlinuz", "-initrd", "initrd.img", "-append", "root=/dev/vda console=ttyS0"
        )
        assert config.kernel is not None
        self.assertEqual(
            (config.kernel.kernel, config.kernel.initrd, config.kernel.cmdline),
            ("vmlinuz", "initrd.img", "root=/dev/vda console=ttyS0"),
        )

    def test_appendOrInitrdWithoutKernelIsAnOptionLoopError(self) -> None:
        self.assertEqual(
            [
                self.first_pass_refusal("-append", "console=ttyS0"),
                self.first_pass_refusal("-initrd", "initrd.img"),
                self.first_pass_refusal("-initrd", "initrd.img", "-append", "x"),
                self.first_pass_refusal("-append", ""),
            ],
            [
                "-append only allowed with -kernel option",
                "-initrd only allowed with -kernel option",
                "-append only allowed with -kernel option",
                "-append only allowed with -kernel option",
            ],
        )

    def test_kernelRefusals(self) -> None:
        self.write("text.txt", b"hello\n")
        self.write("empty", b"")
        self.write("small", bytes(2559))
        os.makedirs(self.path("dir"))
        self.assertEqual(
            [
                self.second_pass_refusal("-kernel", "nokernel"),
                self.second_pass_refusal("-kernel", "text.txt"),
                self.second_pass_refusal("-kernel", "empty"),
                self.second_pass_refusal("-kernel", "dir"),
                self.second_pass_refusal("-kernel", "small"),
                self.second_pass_refusal("-kernel", "text.txt", "-initrd", "text.txt"),
            ],
            [
                "qemu: could not open kernel file 'nokernel': No such file or directory",
                "qemu: invalid kernel header",
                "qemu: could not load kernel 'empty': No such file or directory",
                "qemu: could not load kernel 'dir': Is a directory",
                "qemu: invalid kernel header",
                "qemu: linux kernel too old to load a ram disk",
            ],
        )

    def test_largeFileWithoutABootHeaderIsLoadedAsQEMULoadsIt(self) -> None:
        self.write("zeros", bytes(4096))
        self.assertEqual(self.parse("-kernel", "zeros").kernel.kernel, "zeros")  # type: ignore[union-attr]

    def test_initrdRefusals(self) -> None:
        write_kernel(self.path("vmlinuz"))
        os.makedirs(self.path("dir"))
        with open(self.path("big"), "wb") as f:
            f.truncate(70 * 1024 * 1024)
        self.assertEqual(
            [
                self.second_pass_refusal("-kernel", "vmlinuz", "-initrd", "noinitrd"),
                self.second_pass_refusal("-kernel", "vmlinuz", "-initrd", "dir"),
                self.second_pass_refusal("-kernel", "vmlinuz", "-initrd", "big"),
            ],
            [
                "qemu: error reading initrd noinitrd: Failed to open file \u201cnoinitrd\u201d: "
                "open() failed: No such file or directory",
                "qemu: error reading initrd dir: "
                "Failed to map dir' dir': mmap() failed: No such device",
                # -m 64: 64 MiB less QEMU's 160 KiB of ACPI tables, less one.
                "qemu: initrd is too large, cannot support.(max: 66945023, need 73400320)",
            ],
        )

    def test_kernelErrorsComeAfterTheCpuAndBeforeDevices(self) -> None:
        self.assertEqual(
            [
                self.refusal("-cpu", "host", "-kernel", "nokernel"),
                self.refusal("-kernel", "nokernel", "-device", "bogus"),
            ],
            [
                "CPU model 'host' requires KVM or HVF",
                "qemu: could not open kernel file 'nokernel': No such file or directory",
            ],
        )

    def test_panicTimeoutComesFromTheKernelCommandLine(self) -> None:
        write_kernel(self.path("vmlinuz"))
        timeouts = [
            self.parse("-kernel", "vmlinuz", "-append", append).kernel.panic_timeout()  # type: ignore[union-attr]
            for append in ("console=ttyS0", "panic=5 quiet", "panic=-1", "oops=panic panic=3")
        ]
        self.assertEqual(timeouts, [0, 5, -1, 3])


class CpuTests(_OptionsTestCase):
    """``-cpu`` and its accelerator."""

    def kvm(self) -> None:
        """Make the kvm accelerator's device open."""
        self.patch(os, "environ", {**os.environ, "FAKEQEMU_KVM_DEVICE": self.write("kvm", b"")})

    def test_hostNeedsKvm(self) -> None:
        self.assertEqual(
            [
                self.second_pass_refusal("-accel", "tcg", "-cpu", "host"),
                self.refusal("-cpu", "host"),
            ],
            ["CPU model 'host' requires KVM or HVF"] * 2,
        )

    def test_hostUnderKvmIsAccepted(self) -> None:
        self.kvm()
        config = self.parse("-accel", "kvm", "-cpu", "host")
        self.assertEqual((config.accelerator, config.cpu_model), ("kvm", "host"))

    def test_otherModelsRunUnderTcg(self) -> None:
        self.assertEqual(
            [
                self.parse("-accel", "tcg", "-cpu", m).cpu_model
                for m in ("max", "qemu64", "Skylake-Client-v4")
            ],
            ["max", "qemu64", "Skylake-Client-v4"],
        )

    def test_unknownModel(self) -> None:
        self.assertEqual(self.refusal("-cpu", "bogus"), "unable to find CPU model 'bogus'")

    def test_cpuPropertiesAreNotEmulated(self) -> None:
        # fakeqemu's own refusal: QEMU would apply the CPU property.
        self.assertEqual(
            self.refusal("-cpu", "max,-arch-capabilities"),
            "fakeqemu does not emulate CPU properties",
        )

    def test_cpuIsCheckedAfterTheSerialPort(self) -> None:
        self.assertEqual(
            self.refusal("-cpu", "host", "-serial", "chardev:nope"),
            "-serial chardev:nope: could not connect serial device to character backend "
            "'chardev:nope'",
        )


class ContractCommandLineTests(_OptionsTestCase):
    """The whole line of the issue 11 contract, accepted at once."""

    def test_wholeLineIsAccepted(self) -> None:
        run = self.path("run")
        os.makedirs(os.path.join(run, "config-drive"))
        write_qcow2(self.path("disk.qcow2"))
        write_kernel(self.path("vmlinuz"))
        config = parse_command_line(
            [
                "-name",
                "guest=demo",
                "-machine",
                "q35",
                "-accel",
                "tcg",
                "-nodefaults",
                "-display",
                "none",
                "-m",
                "256M",
                "-smp",
                "2",
                "-qmp",
                "unix:run/qmp.sock,server=on,wait=off",
                "-device",
                "virtio-serial-pci,id=vs0",
                "-chardev",
                "ringbuf,id=vmready,size=65536",
                "-device",
                "virtserialport,chardev=vmready,name=com.canonical.lxd,bus=vs0.0,id=com.canonical.lxd",
                "-device",
                "virtserialport,name=org.linuxcontainers.lxd,bus=vs0.0,id=org.linuxcontainers.lxd",
                "-chardev",
                f"file,id=console,path={run}/console.log,append=on",
                "-serial",
                "chardev:console",
                "-device",
                "pvpanic",
                "-fsdev",
                f"local,id=config,path={run}/config-drive,security_model=none,readonly=on",
                "-device",
                "virtio-9p-pci,fsdev=config,mount_tag=config",
                "-netdev",
                NETDEV,
                "-device",
                "virtio-net-pci,netdev=n0,mac=52:54:00:76:6d:01",
                "-blockdev",
                "driver=qcow2,node-name=root,file.driver=file,file.filename=disk.qcow2",
                "-device",
                "virtio-blk-pci,drive=root",
                "-kernel",
                "vmlinuz",
                "-append",
                "root=/dev/vda rw console=ttyS0",
                "-daemonize",
                "-pidfile",
                f"{run}/vm.pid",
                "-D",
                f"{run}/qemu.log",
                "-S",
            ],
            cwd=self.directory,
        )
        self.assertEqual(
            (
                config.warnings,
                [p.device_id for p in config.serial_ports],
                config.serial_chardev,
                config.pvpanic_events,
                [d.section for d in config.pci_devices],
                [d.address for d in config.pci_devices],
            ),
            (
                (),
                ["com.canonical.lxd", "org.linuxcontainers.lxd"],
                "console",
                3,
                ["virtio-console", "virtio-9p", "virtio-net", "virtio-blk"],
                ["0000:00:01.0", "0000:00:02.0", "0000:00:03.0", "0000:00:04.0"],
            ),
        )
