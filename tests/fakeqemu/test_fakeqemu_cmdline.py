"""Tests for fakeqemu._cmdline: QEMU's command line, accepted and refused in QEMU's words.

Every refusal text here was measured on qemu-system-x86_64 7.2 (Debian), unless
the test says the refusal is fakeqemu's own (something QEMU has but fakeqemu does
not emulate).
"""

from __future__ import annotations

import os

from twisted.trial.unittest import SynchronousTestCase

from fakeqemu._cmdline import (
    CommandLineError,
    MachineConfig,
    RingbufSpec,
    SerialBusSpec,
    SerialPortSpec,
    SocketChardevSpec,
    parse_arguments,
    parse_command_line,
    program_name,
    split_options,
)

BASE = ["-machine", "q35", "-nodefaults", "-display", "none"]
SERIAL = [*BASE, "-device", "virtio-serial-pci"]
NO_KVM = "/nonexistent/fakeqemu-test-kvm"
SIZE_ERROR = (
    "Parameter 'size' expects a non-negative number below 2^64\n"
    "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n"
    "and exabytes, respectively."
)
IDENTIFIER_ERROR = (
    "Parameter 'id' expects an identifier\n"
    "Identifiers consist of letters, digits, '-', '.', '_', starting with a letter."
)


def parse(*argv: str) -> MachineConfig:
    """Parse a command line given as separate words."""
    return parse_command_line(list(argv))


class _CommandLineTestCase(SynchronousTestCase):
    """Helpers shared by the command-line tests."""

    def refusal(self, *argv: str) -> str:
        """The message a refused command line carries."""
        error: CommandLineError = self.assertRaises(
            CommandLineError, parse_command_line, list(argv)
        )
        return str(error)

    def kvm_device(self, path: str) -> None:
        """Make the kvm accelerator look for its device at ``path``."""
        self.patch(os, "environ", {**os.environ, "FAKEQEMU_KVM_DEVICE": path})

    def existing_file(self) -> str:
        """A path that opens read-write, standing in for /dev/kvm."""
        path: str = self.mktemp()
        open(path, "wb").close()
        return path


class DefaultsTests(_CommandLineTestCase):
    """An empty command line means what it means to QEMU."""

    def test_emptyCommandLineIsAPcWith128MiBAndOneCpuOnTcg(self) -> None:
        config = parse()
        self.assertEqual(
            (config.machine_type, config.accelerator, config.memory_bytes, config.cpus),
            ("pc-i440fx-7.2", "tcg", 128 * 1024 * 1024, 1),
        )

    def test_emptyCommandLineHasNoDevicesSocketsOrFlags(self) -> None:
        config = parse()
        self.assertEqual(
            (
                config.name,
                config.qmp_sockets,
                config.ringbufs,
                config.serial_buses,
                config.serial_ports,
                config.nodefaults,
                config.start_paused,
                config.daemonize,
                config.incoming_path,
                config.warnings,
            ),
            (None, (), (), (), (), False, False, False, None, ()),
        )

    def test_doubleDashOptionsAreAccepted(self) -> None:
        config = parse("--nodefaults", "--machine", "q35")
        self.assertEqual((config.nodefaults, config.machine_type), (True, "pc-q35-7.2"))


class OptionSplittingTests(SynchronousTestCase):
    """QemuOpts strings split on commas, with ``,,`` for a literal comma."""

    def test_commasSeparateOptions(self) -> None:
        self.assertEqual(split_options("a,b=c,d"), ["a", "b=c", "d"])

    def test_doubledCommaIsALiteralComma(self) -> None:
        self.assertEqual(split_options("a,,b,c=d,,e"), ["a,b", "c=d,e"])

    def test_doubledCommaInGuestNameIsKept(self) -> None:
        self.assertEqual(parse("-name", "a,,b").name, "a,b")

    def test_doubledCommaInQmpSocketPathIsKept(self) -> None:
        config = parse("-qmp", "unix:/tmp/q,,2,server=on,wait=off")
        self.assertEqual(config.qmp_sockets, ("/tmp/q,2",))


class SimpleOptionTests(_CommandLineTestCase):
    """-name, -machine, -m, -smp, flags and -display in QEMU's syntax."""

    def test_nameIsTheGuestName(self) -> None:
        self.assertEqual(parse("-name", "vm1").name, "vm1")

    def test_nameAcceptsGuestProcessAndDebugThreads(self) -> None:
        config = parse("-name", "guest=vm2,process=qemu-vm2,debug-threads=on")
        self.assertEqual(config.name, "vm2")

    def test_machineAliasesNameQemu72Types(self) -> None:
        self.assertEqual(
            [parse("-machine", alias).machine_type for alias in ("q35", "pc", "none")],
            ["pc-q35-7.2", "pc-i440fx-7.2", "none"],
        )

    def test_versionedMachineTypesAreAccepted(self) -> None:
        self.assertEqual(
            [parse("-machine", t).machine_type for t in ("pc-q35-7.2", "pc-i440fx-7.2")],
            ["pc-q35-7.2", "pc-i440fx-7.2"],
        )

    def test_machineTypeKeyAndShortOptionAreAccepted(self) -> None:
        self.assertEqual(
            [parse("-machine", "type=q35").machine_type, parse("-M", "q35").machine_type],
            ["pc-q35-7.2", "pc-q35-7.2"],
        )

    def test_bareMemorySizeIsMebibytes(self) -> None:
        self.assertEqual(parse("-m", "64").memory_bytes, 64 * 1024 * 1024)

    def test_memorySizeSuffixes(self) -> None:
        self.assertEqual(
            [parse("-m", v).memory_bytes for v in ("64M", "1G", "2048K", "size=512M")],
            [64 << 20, 1 << 30, 2 << 20, 512 << 20],
        )

    def test_smpCountIsTheCpuCount(self) -> None:
        self.assertEqual(parse("-smp", "4").cpus, 4)

    def test_smpTopologyKeysAreAccepted(self) -> None:
        self.assertEqual(parse("-smp", "cpus=2,maxcpus=2,sockets=1,cores=2,threads=1").cpus, 2)

    def test_smpZeroWarnsAndMeansOneCpu(self) -> None:
        config = parse("-smp", "0")
        self.assertEqual(
            (config.cpus, config.warnings),
            (
                1,
                (
                    "warning: Deprecated CPU topology (considered invalid): "
                    "CPU topology parameters must be greater than zero",
                ),
            ),
        )

    def test_flagsAreRecorded(self) -> None:
        config = parse("-nodefaults", "-S", "-daemonize", "-pidfile", "/run/vm.pid")
        self.assertEqual(
            (config.nodefaults, config.start_paused, config.daemonize, config.pidfile),
            (True, True, True, "/run/vm.pid"),
        )

    def test_displayNoneIsAccepted(self) -> None:
        self.assertEqual(parse("-display", "none").machine_type, "pc-i440fx-7.2")

    def test_versionSkipsValidationOfTheRest(self) -> None:
        # QEMU prints its version as soon as it meets -version.
        self.assertTrue(parse("-version", "-machine", "nope").show_version)


class LogfileOptionTests(_CommandLineTestCase):
    """-D FILE: recorded, the last one wins; QEMU opens it between its two passes."""

    def test_logfileIsRecorded(self) -> None:
        self.assertEqual(parse("-D", "/tmp/vm.log").logfile, "/tmp/vm.log")

    def test_noLogfileByDefault(self) -> None:
        self.assertIsNone(parse().logfile)

    def test_lastLogfileWins(self) -> None:
        self.assertEqual(parse("-D", "/tmp/a.log", "-D", "/tmp/b.log").logfile, "/tmp/b.log")

    def test_logfileNeedsAnArgument(self) -> None:
        self.assertEqual(self.refusal("-D"), "-D: requires an argument")

    def test_firstPassKnowsTheLogfileAndDaemonizeBeforeTheChecks(self) -> None:
        parsed = parse_arguments(
            ["-chardev", "ringbuf,id=r,size=3", "-daemonize", "-D", "/tmp/vm.log"]
        )
        self.assertEqual((parsed.logfile, parsed.daemonize), ("/tmp/vm.log", True))
        error = self.assertRaises(CommandLineError, parsed.configure)
        self.assertEqual(
            str(error),
            "-chardev ringbuf,id=r,size=3: size of ringbuf chardev must be power of two",
        )


class TwoPassTests(_CommandLineTestCase):
    """Which errors QEMU finds in its option loop, and the order of the checks after it.

    Measured on QEMU 7.2 with ``-daemonize -D FILE``: option-loop errors reach
    stderr and leave FILE untouched; the others land in FILE.
    """

    def first_pass_refusal(self, *argv: str) -> str:
        """The message the option loop (parse_arguments) refuses ``argv`` with."""
        error = self.assertRaises(CommandLineError, parse_arguments, list(argv))
        return str(error)

    def second_pass_refusal(self, *argv: str) -> str:
        """The message ``argv`` passes the option loop with, then is refused with."""
        parsed = parse_arguments(list(argv))
        error = self.assertRaises(CommandLineError, parsed.configure)
        return str(error)

    def test_optionLoopErrors(self) -> None:
        self.assertEqual(
            [
                self.first_pass_refusal("-bogus"),
                self.first_pass_refusal("-m", "12x").split("\n")[0],
                self.first_pass_refusal("-name", "x,foo=1"),
                self.first_pass_refusal("-display", "none,foo=1"),
                self.first_pass_refusal("-chardev", "ringbuf,id=1x").split("\n")[0],
                self.first_pass_refusal("-chardev", "ringbuf,id=r,foo=1"),
                self.first_pass_refusal("-chardev", "ringbuf,id=r,size=3x").split("\n")[0],
                self.first_pass_refusal("-chardev", "ringbuf,id=r", "-chardev", "ringbuf,id=r"),
                self.first_pass_refusal("-device", "virtio-serial-pci,id=1a").split("\n")[0],
                self.first_pass_refusal(
                    "-device", "virtio-serial-pci,id=a", "-device", "virtio-serial-pci,id=a"
                ),
            ],
            [
                "-bogus: invalid option",
                "-m 12x: Parameter 'size' expects a non-negative number below 2^64",
                "-name x,foo=1: Invalid parameter 'foo'",
                "-display none,foo=1: Parameter 'foo' is unexpected",
                "-chardev ringbuf,id=1x: Parameter 'id' expects an identifier",
                "-chardev ringbuf,id=r,foo=1: Invalid parameter 'foo'",
                "-chardev ringbuf,id=r,size=3x: "
                "Parameter 'size' expects a non-negative number below 2^64",
                "-chardev ringbuf,id=r: Duplicate ID 'r' for chardev",
                "-device virtio-serial-pci,id=1a: Parameter 'id' expects an identifier",
                "-device virtio-serial-pci,id=a: Duplicate ID 'a' for device",
            ],
        )

    def test_checksAfterTheOptionLoop(self) -> None:
        self.assertEqual(
            [
                self.second_pass_refusal("-machine", "bogus").split("\n")[0],
                self.second_pass_refusal("-display", "gtk"),
                self.second_pass_refusal("-chardev", "bogus,id=x"),
                self.second_pass_refusal("-chardev", "ringbuf"),
                self.second_pass_refusal("-chardev", "ringbuf,id=x,size=3"),
                self.second_pass_refusal("-smp", "foo=1"),
                self.second_pass_refusal("-machine", "q35,foo=1"),
                self.second_pass_refusal("-accel", "bogus"),
                self.second_pass_refusal("-device", "bogus"),
                self.second_pass_refusal("-incoming", "file:/x"),
            ],
            [
                "unsupported machine type",
                "Display 'gtk' is not available.",
                "-chardev bogus,id=x: 'bogus' is not a valid char driver name",
                "-chardev ringbuf: chardev: no id specified",
                "-chardev ringbuf,id=x,size=3: size of ringbuf chardev must be power of two",
                "Parameter 'smp.foo' is unexpected",
                "Property 'pc-q35-7.2-machine.foo' not found",
                "-accel bogus: invalid accelerator bogus",
                "-device bogus: 'bogus' is not a valid device model name",
                "-incoming file:/x: unknown migration protocol: file:/x",
            ],
        )

    def test_machineTypeIsCheckedFirst(self) -> None:
        self.assertEqual(
            self.refusal("-chardev", "ringbuf,id=x,size=3", "-display", "gtk", "-machine", "nope"),
            "unsupported machine type\nUse -machine help to list supported machines",
        )

    def test_displayBeforeChardevs(self) -> None:
        self.assertEqual(
            self.refusal("-chardev", "ringbuf,id=x,size=3", "-display", "gtk"),
            "Display 'gtk' is not available.",
        )

    def test_chardevsAndMonitorsInCommandLineOrder(self) -> None:
        long_path = "/tmp/" + "x" * 120
        monitor = f"unix:{long_path},server=on,wait=off"
        self.assertEqual(
            [
                self.refusal("-qmp", monitor, "-chardev", "ringbuf,id=x,size=3").split(":")[0],
                self.refusal("-chardev", "ringbuf,id=x,size=3", "-qmp", monitor).split(":")[0],
            ],
            ["-qmp unix", "-chardev ringbuf,id=x,size=3"],
        )

    def test_chardevsBeforeTopologyBeforeMachineProperties(self) -> None:
        self.assertEqual(
            [
                self.refusal("-machine", "q35,foo=1", "-smp", "foo=1", "-chardev", "ringbuf"),
                self.refusal("-machine", "q35,foo=1", "-smp", "foo=1"),
                self.refusal("-machine", "q35,foo=1", "-accel", "bogus"),
            ],
            [
                "-chardev ringbuf: chardev: no id specified",
                "Parameter 'smp.foo' is unexpected",
                "Property 'pc-q35-7.2-machine.foo' not found",
            ],
        )

    def test_acceleratorBeforeDevicesBeforeIncoming(self) -> None:
        self.assertEqual(
            [
                self.refusal("-device", "bogus", "-accel", "bogus"),
                self.refusal("-incoming", "file:/x", "-device", "bogus"),
            ],
            [
                "-accel bogus: invalid accelerator bogus",
                "-device bogus: 'bogus' is not a valid device model name",
            ],
        )

    def test_warningsBeforeARefusalAreKept(self) -> None:
        error = self.assertRaises(
            CommandLineError, parse_command_line, ["-smp", "0", "-device", "bogus"]
        )
        self.assertEqual(
            error.messages,
            [
                "warning: Deprecated CPU topology (considered invalid): "
                "CPU topology parameters must be greater than zero",
                "-device bogus: 'bogus' is not a valid device model name",
            ],
        )


class AcceleratorTests(_CommandLineTestCase):
    """-accel: tried in order; kvm needs its device to open."""

    def test_tcgIsTheDefault(self) -> None:
        self.kvm_device(self.existing_file())
        self.assertEqual(parse().accelerator, "tcg")

    def test_kvmIsUsedWhenItsDeviceOpens(self) -> None:
        self.kvm_device(self.existing_file())
        self.assertEqual(parse("-accel", "kvm").accelerator, "kvm")

    def test_accelKeyFormIsAccepted(self) -> None:
        self.assertEqual(parse("-accel", "accel=tcg").accelerator, "tcg")

    def test_firstWorkingAcceleratorWins(self) -> None:
        self.kvm_device(self.existing_file())
        self.assertEqual(parse("-accel", "tcg", "-accel", "kvm").accelerator, "tcg")

    def test_kvmWithoutItsDeviceRefusesToStart(self) -> None:
        self.kvm_device(NO_KVM)
        self.assertEqual(
            self.refusal("-accel", "kvm"),
            "Could not access KVM kernel module: No such file or directory\n"
            f"{program_name()}: -accel kvm: failed to initialize kvm: No such file or directory",
        )

    def test_kvmWithoutItsDeviceFallsBackToTheNextAccelerator(self) -> None:
        self.kvm_device(NO_KVM)
        config = parse("-accel", "kvm", "-accel", "tcg")
        self.assertEqual(config.accelerator, "tcg")

    def test_fallbackWarnsAsQemuDoes(self) -> None:
        self.kvm_device(NO_KVM)
        config = parse("-accel", "kvm", "-accel", "tcg")
        self.assertEqual(
            config.warnings,
            (
                "Could not access KVM kernel module: No such file or directory\n"
                f"{program_name()}: -accel kvm: failed to initialize kvm: "
                "No such file or directory",
                "falling back to tcg",
            ),
        )

    def test_unknownAcceleratorFallsBackToTheNext(self) -> None:
        config = parse("-accel", "bogus", "-accel", "tcg")
        self.assertEqual(
            (config.accelerator, config.warnings),
            ("tcg", ("-accel bogus: invalid accelerator bogus", "falling back to tcg")),
        )

    def test_unknownAcceleratorAfterAWorkingOneIsNeverLookedAt(self) -> None:
        self.assertEqual(parse("-accel", "tcg", "-accel", "bogus").warnings, ())

    def test_everyFailedAcceleratorIsReported(self) -> None:
        error = self.assertRaises(
            CommandLineError, parse_command_line, ["-accel", "bogus", "-accel", "bogus2"]
        )
        self.assertEqual(
            error.messages,
            [
                "-accel bogus: invalid accelerator bogus",
                "-accel bogus2: invalid accelerator bogus2",
            ],
        )

    def test_unknownPropertyIsFatalEvenWithAFallback(self) -> None:
        error = self.assertRaises(
            CommandLineError,
            parse_command_line,
            ["-accel", "bogus", "-accel", "tcg,foo=1", "-accel", "kvm"],
        )
        self.assertEqual(
            error.messages,
            [
                "-accel bogus: invalid accelerator bogus",
                "-accel tcg,foo=1: Property 'tcg-accel.foo' not found",
            ],
        )

    def test_noFallbackWarningWhenKvmOpens(self) -> None:
        self.kvm_device(self.existing_file())
        self.assertEqual(parse("-accel", "kvm", "-accel", "tcg").warnings, ())


class QmpOptionTests(_CommandLineTestCase):
    """-qmp: unix sockets, QEMU listening, not waiting."""

    def test_unixServerWithoutWaitIsAccepted(self) -> None:
        config = parse("-qmp", "unix:/tmp/vm.qmp,server=on,wait=off")
        self.assertEqual(config.qmp_sockets, ("/tmp/vm.qmp",))

    def test_qmpIsRepeatable(self) -> None:
        config = parse(
            "-qmp", "unix:/tmp/a,server=on,wait=off", "-qmp", "unix:/tmp/b,server=on,wait=off"
        )
        self.assertEqual(config.qmp_sockets, ("/tmp/a", "/tmp/b"))

    def test_qmpWithoutServerIsRefused(self) -> None:
        # QEMU would dial out and fail to connect; fakeqemu only listens.
        self.assertEqual(
            self.refusal("-qmp", "unix:/tmp/q"),
            "-qmp unix:/tmp/q: Failed to connect to '/tmp/q': fakeqemu only listens (server=on)",
        )

    def test_qmpThatWaitsForAClientIsRefused(self) -> None:
        self.assertEqual(
            self.refusal("-qmp", "unix:/tmp/q,server=on"),
            "-qmp unix:/tmp/q,server=on: fakeqemu does not wait for a QMP client: add wait=off",
        )

    def test_qmpOnTcpIsRefused(self) -> None:
        self.assertEqual(
            self.refusal("-qmp", "tcp:localhost:4444,server=on,wait=off"),
            "-qmp tcp:localhost:4444,server=on,wait=off: "
            "fakeqemu serves QMP only on unix: sockets",
        )

    def test_qmpUnknownParameterIsRefused(self) -> None:
        self.assertEqual(
            self.refusal("-qmp", "unix:/tmp/q,server=on,wait=off,foo=bar"),
            "-qmp unix:/tmp/q,server=on,wait=off,foo=bar: Invalid parameter 'foo'\n"
            f"{program_name()}: -qmp unix:/tmp/q,server=on,wait=off,foo=bar: "
            "parse error: unix:/tmp/q,server=on,wait=off,foo=bar",
        )

    def test_overlongSocketPathIsRefused(self) -> None:
        path = "/tmp/" + "x" * 120
        self.assertEqual(
            self.refusal("-qmp", f"unix:{path},server=on,wait=off"),
            f"-qmp unix:{path},server=on,wait=off: UNIX socket path '{path}' is too long\n"
            "Path must be less than 108 bytes",
        )


class RingbufOptionTests(_CommandLineTestCase):
    """-chardev ringbuf."""

    def test_ringbufHasIdAndSize(self) -> None:
        config = parse("-chardev", "ringbuf,id=r0,size=4096")
        self.assertEqual(config.ringbufs, (RingbufSpec("r0", 4096),))

    def test_ringbufSizeDefaultsTo64KiB(self) -> None:
        self.assertEqual(parse("-chardev", "ringbuf,id=r0").ringbufs, (RingbufSpec("r0", 65536),))

    def test_ringbufSizeTakesSuffixes(self) -> None:
        self.assertEqual(parse("-chardev", "ringbuf,id=r0,size=4K").ringbufs[0].size, 4096)

    def test_ringbufsKeepCommandLineOrder(self) -> None:
        config = parse("-chardev", "ringbuf,id=b,size=16", "-chardev", "ringbuf,id=a,size=32")
        self.assertEqual([r.id for r in config.ringbufs], ["b", "a"])


class SerialDeviceTests(_CommandLineTestCase):
    """-device virtio-serial-pci and virtserialport: buses, ports, numbers, addresses."""

    def test_portWiredToChardevOnTheOnlyBus(self) -> None:
        config = parse(
            *BASE,
            "-chardev",
            "ringbuf,id=r0,size=16",
            "-device",
            "virtio-serial-pci,id=vs0",
            "-device",
            "virtserialport,chardev=r0,name=com.canonical.lxd,bus=vs0.0,id=p0",
        )
        self.assertEqual(
            (config.serial_buses, config.serial_ports),
            (
                (SerialBusSpec("vs0", "vs0.0", 31, "0000:00:01.0"),),
                (SerialPortSpec("vs0.0", 1, "com.canonical.lxd", "r0", "p0"),),
            ),
        )

    def test_virtioSerialIsAnAliasOfVirtioSerialPci(self) -> None:
        config = parse(*BASE, "-device", "virtio-serial")
        self.assertEqual([b.bus_name for b in config.serial_buses], ["virtio-serial-bus.0"])

    def test_portWithoutChardevOrName(self) -> None:
        config = parse(*SERIAL, "-device", "virtserialport")
        self.assertEqual(
            config.serial_ports, (SerialPortSpec("virtio-serial-bus.0", 1, None, None, None),)
        )

    def test_portNumbersAreAssignedFromOne(self) -> None:
        config = parse(
            *SERIAL, "-device", "virtserialport,name=a", "-device", "virtserialport,name=b"
        )
        self.assertEqual([p.nr for p in config.serial_ports], [1, 2])

    def test_assignedNumberSkipsExplicitOnes(self) -> None:
        config = parse(
            *SERIAL, "-device", "virtserialport,nr=1,name=a", "-device", "virtserialport,name=b"
        )
        self.assertEqual([p.nr for p in config.serial_ports], [1, 2])

    def test_explicitPortNumberMayBeHex(self) -> None:
        config = parse(*SERIAL, "-device", "virtserialport,nr=0x3,name=a")
        self.assertEqual(config.serial_ports[0].nr, 3)

    def test_maxPortsIsRecorded(self) -> None:
        config = parse(*BASE, "-device", "virtio-serial-pci,max_ports=4")
        self.assertEqual(config.serial_buses[0].max_ports, 4)

    def test_busOfADeviceWithIdIsIdDotZero(self) -> None:
        config = parse(*BASE, "-device", "virtio-serial-pci,id=vs")
        self.assertEqual(config.serial_buses[0].bus_name, "vs.0")

    def test_unnamedBusesAreNumberedAmongThemselves(self) -> None:
        # Measured with `info qtree`: ids do not use up the automatic numbers.
        config = parse(
            *BASE,
            "-device",
            "virtio-serial-pci,id=a",
            "-device",
            "virtio-serial-pci",
            "-device",
            "virtio-serial-pci",
        )
        self.assertEqual(
            [b.bus_name for b in config.serial_buses],
            ["a.0", "virtio-serial-bus.0", "virtio-serial-bus.1"],
        )

    def test_portWithoutBusGoesToTheNewestBus(self) -> None:
        # Measured with `info qtree`: p1 lands on b.0, p2 on c.0.
        config = parse(
            *BASE,
            "-device",
            "virtio-serial-pci,id=a",
            "-device",
            "virtio-serial-pci,id=b",
            "-device",
            "virtserialport,name=p1",
            "-device",
            "virtio-serial-pci,id=c",
            "-device",
            "virtserialport,name=p2",
        )
        self.assertEqual(
            [(p.name, p.bus_name) for p in config.serial_ports],
            [
                ("p1", "b.0"),
                ("p2", "c.0"),
            ],
        )

    def test_portNumbersArePerBus(self) -> None:
        config = parse(
            *BASE,
            "-device",
            "virtio-serial-pci,id=a",
            "-device",
            "virtio-serial-pci,id=b",
            "-device",
            "virtserialport,bus=a.0,name=x",
            "-device",
            "virtserialport,bus=b.0,name=y",
        )
        self.assertEqual(
            [(p.bus_name, p.nr) for p in config.serial_ports],
            [
                ("a.0", 1),
                ("b.0", 1),
            ],
        )


class PciAddressTests(_CommandLineTestCase):
    """Serial buses sit in the PCI slots QEMU 7.2 gives them (measured with `info qtree`)."""

    def addresses(self, *argv: str) -> list[str]:
        """PCI addresses of two virtio-serial-pci devices on the given machine."""
        config = parse(*argv, "-device", "virtio-serial-pci", "-device", "virtio-serial-pci")
        return [bus.pci_address for bus in config.serial_buses]

    def test_q35WithoutDefaultsStartsAtSlotOne(self) -> None:
        self.assertEqual(
            self.addresses("-machine", "q35", "-nodefaults"), ["0000:00:01.0", "0000:00:02.0"]
        )

    def test_q35DefaultsTakeSlotsOneAndTwo(self) -> None:
        self.assertEqual(self.addresses("-machine", "q35"), ["0000:00:03.0", "0000:00:04.0"])

    def test_pcWithoutDefaultsStartsAtSlotTwo(self) -> None:
        self.assertEqual(
            self.addresses("-machine", "pc", "-nodefaults"), ["0000:00:02.0", "0000:00:03.0"]
        )

    def test_pcDefaultsTakeSlotsTwoAndThree(self) -> None:
        self.assertEqual(self.addresses("-machine", "pc"), ["0000:00:04.0", "0000:00:05.0"])


class IncomingOptionTests(_CommandLineTestCase):
    """-incoming: QEMU 7.2's way to a file is exec:cat."""

    def test_execCatNamesTheStateFile(self) -> None:
        self.assertEqual(parse("-incoming", "exec:cat /tmp/state").incoming_path, "/tmp/state")

    def test_execCatPathMayBeQuoted(self) -> None:
        config = parse("-incoming", "exec:cat '/tmp/my state'")
        self.assertEqual(config.incoming_path, "/tmp/my state")

    def test_fileUriIsUnknownToQemu72(self) -> None:
        self.assertEqual(
            self.refusal("-incoming", "file:/tmp/x"),
            "-incoming file:/tmp/x: unknown migration protocol: file:/tmp/x",
        )

    def test_otherExecCommandsAreRefused(self) -> None:
        # fakeqemu's own refusal: QEMU would run the command.
        self.assertEqual(
            self.refusal("-incoming", "exec:gunzip -c /tmp/x.gz"),
            "-incoming exec:gunzip -c /tmp/x.gz: "
            "fakeqemu accepts only 'exec:cat PATH' as an exec: migration",
        )

    def test_networkAndDeferredIncomingAreRefused(self) -> None:
        self.assertEqual(
            [self.refusal("-incoming", uri) for uri in ("tcp:0:4444", "defer")],
            [
                "-incoming tcp:0:4444: fakeqemu restores only from 'exec:cat PATH'",
                "-incoming defer: fakeqemu restores only from 'exec:cat PATH'",
            ],
        )


class GeneralRefusalTests(_CommandLineTestCase):
    """Options and values QEMU refuses, refused with QEMU's text."""

    def test_unknownOptionIsInvalid(self) -> None:
        self.assertEqual(self.refusal(*BASE, "-foo"), "-foo: invalid option")

    def test_optionWithoutItsArgument(self) -> None:
        self.assertEqual(self.refusal(*BASE, "-m"), "-m: requires an argument")

    def test_diskImageIsNotEmulated(self) -> None:
        # fakeqemu's own refusal: QEMU would boot the image.
        self.assertEqual(
            self.refusal("disk.img"), "disk.img: fakeqemu does not emulate disk images"
        )

    def test_unknownMachineType(self) -> None:
        self.assertEqual(
            self.refusal("-machine", "foo"),
            "unsupported machine type\nUse -machine help to list supported machines",
        )

    def test_unknownMachineProperty(self) -> None:
        self.assertEqual(
            self.refusal("-machine", "q35,foo=on"), "Property 'pc-q35-7.2-machine.foo' not found"
        )

    def test_memoryThatIsNotASize(self) -> None:
        self.assertEqual(self.refusal(*BASE, "-m", "abc"), f"-m abc: {SIZE_ERROR}")

    def test_memoryUnknownParameter(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-m", "size=1G,foo=1"), "-m size=1G,foo=1: Invalid parameter 'foo'"
        )

    def test_smpThatIsNotANumber(self) -> None:
        self.assertEqual(self.refusal(*BASE, "-smp", "x"), "Parameter 'smp.cpus' expects integer")

    def test_smpUnknownParameter(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-smp", "2,foo=1"), "Parameter 'smp.foo' is unexpected"
        )

    def test_unavailableDisplay(self) -> None:
        self.assertEqual(self.refusal(*BASE, "-display", "gtk"), "Display 'gtk' is not available.")

    def test_displayNoneWithUnknownParameter(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-display", "none,foo=bar"),
            "-display none,foo=bar: Parameter 'foo' is unexpected",
        )

    def test_nameUnknownParameter(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-name", "foo,bar=1"), "-name foo,bar=1: Invalid parameter 'bar'"
        )

    def test_unknownAccelerator(self) -> None:
        self.assertEqual(self.refusal("-accel", "foo"), "-accel foo: invalid accelerator foo")

    def test_unknownDisplayType(self) -> None:
        # Not a display QEMU has at all: refused while parsing, unlike gtk.
        self.assertEqual(
            self.refusal(*BASE, "-display", "bogus"),
            "-display bogus: Parameter 'type' does not accept value 'bogus'",
        )

    def test_unknownAcceleratorProperty(self) -> None:
        self.assertEqual(
            [self.refusal("-accel", f"{a},foo=1") for a in ("kvm", "tcg")],
            [
                "-accel kvm,foo=1: Property 'kvm-accel.foo' not found",
                "-accel tcg,foo=1: Property 'tcg-accel.foo' not found",
            ],
        )


class ChardevRefusalTests(_CommandLineTestCase):
    """-chardev refusals."""

    def test_ringbufSizeMustBeAPowerOfTwo(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-chardev", "ringbuf,id=r0,size=1000"),
            "-chardev ringbuf,id=r0,size=1000: size of ringbuf chardev must be power of two",
        )

    def test_ringbufSizeThatIsNotASize(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-chardev", "ringbuf,id=a,size=abc"),
            f"-chardev ringbuf,id=a,size=abc: {SIZE_ERROR}",
        )

    def test_duplicateChardevId(self) -> None:
        self.assertEqual(
            self.refusal(
                *BASE, "-chardev", "ringbuf,id=r0,size=1024", "-chardev", "ringbuf,id=r0,size=1024"
            ),
            "-chardev ringbuf,id=r0,size=1024: Duplicate ID 'r0' for chardev",
        )

    def test_chardevWithoutId(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-chardev", "ringbuf,size=1024"),
            "-chardev ringbuf,size=1024: chardev: no id specified",
        )

    def test_chardevIdMustBeAnIdentifier(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-chardev", "ringbuf,id=1a"),
            f"-chardev ringbuf,id=1a: {IDENTIFIER_ERROR}",
        )

    def test_escapedCommaInChardevIdIsNotAnIdentifier(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-chardev", "ringbuf,id=a,,b,size=1024"),
            f"-chardev ringbuf,id=a,,b,size=1024: {IDENTIFIER_ERROR}",
        )

    def test_unknownCharDriver(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-chardev", "ringx,id=a"),
            "-chardev ringx,id=a: 'ringx' is not a valid char driver name",
        )

    def test_otherCharDriversAreNotEmulated(self) -> None:
        # fakeqemu's own refusal for a backend QEMU has.
        self.assertEqual(
            self.refusal(*BASE, "-chardev", "pty,id=a"),
            "-chardev pty,id=a: fakeqemu does not emulate the 'pty' char driver",
        )

    def test_socketChardevIsAUnixServerThatDoesNotWait(self) -> None:
        config = parse(*BASE, "-chardev", "socket,id=c,path=/run/c.sock,server=on,wait=off")
        self.assertEqual(config.socket_chardevs, (SocketChardevSpec("c", "/run/c.sock"),))

    def test_otherSocketChardevFormsAreNotEmulated(self) -> None:
        self.assertEqual(
            [
                self.refusal(*BASE, "-chardev", "socket,id=a"),
                self.refusal(*BASE, "-chardev", "socket,id=a,host=h,port=1,server=on,wait=off"),
            ],
            [
                "-chardev socket,id=a: fakeqemu emulates socket chardevs only as unix servers: "
                "socket,id=ID,path=P,server=on,wait=off",
                "-chardev socket,id=a,host=h,port=1,server=on,wait=off: fakeqemu emulates "
                "socket chardevs only as unix servers: socket,id=ID,path=P,server=on,wait=off",
            ],
        )

    def test_socketChardevThatWaitsForItsClientIsNotEmulated(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-chardev", "socket,id=a,path=/p,server=on"),
            "-chardev socket,id=a,path=/p,server=on: fakeqemu emulates socket chardevs only "
            "as unix servers that do not wait for their client: server=on,wait=off",
        )

    def test_ringbufIgnoresOtherBackendsParameters(self) -> None:
        # QEMU parses every chardev key for every backend; ringbuf reads only size.
        self.assertEqual(
            parse(*BASE, "-chardev", "ringbuf,id=a,path=/tmp/x").ringbufs,
            (RingbufSpec("a", 65536),),
        )

    def test_unknownRingbufParameter(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-chardev", "ringbuf,id=a,foo=1"),
            "-chardev ringbuf,id=a,foo=1: Invalid parameter 'foo'",
        )


class DeviceRefusalTests(_CommandLineTestCase):
    """-device refusals."""

    def test_unknownDeviceModel(self) -> None:
        self.assertEqual(
            self.refusal(*BASE, "-device", "nosuchdev"),
            "-device nosuchdev: 'nosuchdev' is not a valid device model name",
        )

    def test_unmodelledDeviceIsNotEmulated(self) -> None:
        # fakeqemu's own refusal for a device QEMU has.
        self.assertEqual(
            self.refusal(*BASE, "-device", "virtio-balloon-pci"),
            "-device virtio-balloon-pci: fakeqemu does not emulate device model "
            "'virtio-balloon-pci'",
        )

    def test_unknownDeviceProperty(self) -> None:
        self.assertEqual(
            [
                self.refusal(*BASE, "-device", "virtio-serial-pci,foo=1"),
                self.refusal(*SERIAL, "-device", "virtserialport,foo=1"),
            ],
            [
                "-device virtio-serial-pci,foo=1: Property 'virtio-serial-pci.foo' not found",
                "-device virtserialport,foo=1: Property 'virtserialport.foo' not found",
            ],
        )

    def test_duplicateDeviceId(self) -> None:
        self.assertEqual(
            self.refusal(
                *BASE, "-device", "virtio-serial-pci,id=a", "-device", "virtio-serial-pci,id=a"
            ),
            "-device virtio-serial-pci,id=a: Duplicate ID 'a' for device",
        )

    def test_deviceIdMustBeAnIdentifier(self) -> None:
        self.assertEqual(
            [
                self.refusal(*BASE, "-device", "virtio-serial-pci,id=1a"),
                self.refusal(*BASE, "-device", "virtio-serial-pci,id=a,,b"),
            ],
            [
                f"-device virtio-serial-pci,id=1a: {IDENTIFIER_ERROR}",
                f"-device virtio-serial-pci,id=a,,b: {IDENTIFIER_ERROR}",
            ],
        )

    def test_serialBusNeedsAPciMachine(self) -> None:
        self.assertEqual(
            self.refusal("-machine", "none", "-device", "virtio-serial-pci"),
            "-device virtio-serial-pci: No 'PCI' bus found for device 'virtio-serial-pci'",
        )

    def test_portNeedsASerialBus(self) -> None:
        self.assertEqual(
            self.refusal(
                *BASE, "-chardev", "ringbuf,id=r0", "-device", "virtserialport,chardev=r0,name=x"
            ),
            "-device virtserialport,chardev=r0,name=x: "
            "No 'virtio-serial-bus' bus found for device 'virtserialport'",
        )

    def test_portOnAnUnknownBus(self) -> None:
        self.assertEqual(
            self.refusal(*SERIAL, "-device", "virtserialport,bus=nope.0,name=x"),
            "-device virtserialport,bus=nope.0,name=x: Bus 'nope.0' not found",
        )

    def test_portWithAnUnknownChardev(self) -> None:
        self.assertEqual(
            self.refusal(*SERIAL, "-device", "virtserialport,chardev=nope"),
            "-device virtserialport,chardev=nope: "
            "Property 'virtserialport.chardev' can't find value 'nope'",
        )

    def test_chardevAlreadyInUse(self) -> None:
        self.assertEqual(
            self.refusal(
                *SERIAL,
                "-chardev",
                "ringbuf,id=r0",
                "-device",
                "virtserialport,chardev=r0,name=x",
                "-device",
                "virtserialport,chardev=r0,name=y",
            ),
            "-device virtserialport,chardev=r0,name=y: "
            "Property 'virtserialport.chardev' can't take value 'r0': Device 'r0' is in use",
        )

    def test_duplicatePortName(self) -> None:
        self.assertEqual(
            self.refusal(
                *SERIAL, "-device", "virtserialport,name=x", "-device", "virtserialport,name=x"
            ),
            "-device virtserialport,name=x: virtio-serial-bus: A port already exists by name x",
        )

    def test_duplicatePortNumber(self) -> None:
        self.assertEqual(
            self.refusal(
                *SERIAL,
                "-device",
                "virtserialport,nr=3,name=x",
                "-device",
                "virtserialport,nr=3,name=y",
            ),
            "-device virtserialport,nr=3,name=y: virtio-serial-bus: A port already exists at id 3",
        )

    def test_portNumberZeroIsReserved(self) -> None:
        self.assertEqual(
            self.refusal(*SERIAL, "-device", "virtserialport,nr=0,name=x"),
            "-device virtserialport,nr=0,name=x: Port number 0 on virtio-serial devices "
            "reserved for virtconsole devices for backward compatibility.",
        )

    def test_portNumberOutOfRange(self) -> None:
        self.assertEqual(
            [
                self.refusal(
                    *BASE,
                    "-device",
                    "virtio-serial-pci,max_ports=4",
                    "-device",
                    "virtserialport,nr=4,name=x",
                ),
                self.refusal(*SERIAL, "-device", "virtserialport,nr=31,name=x"),
            ],
            [
                "-device virtserialport,nr=4,name=x: "
                "virtio-serial-bus: Out-of-range port id specified, max. allowed: 3",
                "-device virtserialport,nr=31,name=x: "
                "virtio-serial-bus: Out-of-range port id specified, max. allowed: 30",
            ],
        )

    def test_busOutOfPortNumbers(self) -> None:
        self.assertEqual(
            self.refusal(
                *BASE,
                "-device",
                "virtio-serial-pci,max_ports=2",
                "-device",
                "virtserialport,name=a",
                "-device",
                "virtserialport,name=b",
            ),
            "-device virtserialport,name=b: "
            "virtio-serial-bus: Out-of-range port id specified, max. allowed: 1",
        )

    def test_maxPortsLimits(self) -> None:
        self.assertEqual(
            [
                self.refusal(*BASE, "-device", "virtio-serial-pci,max_ports=0"),
                self.refusal(*BASE, "-device", "virtio-serial-pci,max_ports=5000"),
            ],
            [
                "-device virtio-serial-pci,max_ports=0: "
                "Maximum number of serial ports not specified",
                "-device virtio-serial-pci,max_ports=5000: maximum ports supported: 511",
            ],
        )

    def test_integerPropertiesMustBeUnsignedIntegers(self) -> None:
        self.assertEqual(
            [
                self.refusal(*BASE, "-device", "virtio-serial-pci,max_ports=x"),
                self.refusal(*SERIAL, "-device", "virtserialport,nr=x"),
                self.refusal(*SERIAL, "-device", "virtserialport,nr=-1"),
            ],
            [
                "-device virtio-serial-pci,max_ports=x: Parameter 'max_ports' expects integer",
                "-device virtserialport,nr=x: Parameter 'nr' expects integer",
                "-device virtserialport,nr=-1: Parameter 'nr' expects uint32_t",
            ],
        )
