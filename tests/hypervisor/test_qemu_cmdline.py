"""Tests for vmready.hypervisor.cmdline, the QEMU command line built from a VMSpec."""

from __future__ import annotations

import os
import shutil
import tempfile

import attrs
from twisted.trial.unittest import SynchronousTestCase

from fakeqemu import CommandLineError, parse_command_line
from vmready.hypervisor.cmdline import (
    AGENT_PORT,
    AGENT_RING,
    CONNECT_PORT,
    LEGACY_LAYOUT,
    LEGACY_PORT,
    GuestForward,
    SerialPort,
    VMSpec,
    build_command_line,
    serial_arguments,
)

PROGRAM = ["qemu-system-x86_64"]


def make_spec(**overrides: object) -> VMSpec:
    """The spec the tests start from, with ``overrides``."""
    fields: dict[str, object] = {
        "name": "web1",
        "uuid": "4f3c2d1e-0000-4000-8000-000000000001",
        "memory_mib": 256,
        "cpus": 2,
        "run_dir": "/run/vmready/4f3c2d1e",
    }
    fields.update(overrides)
    return VMSpec(**fields)  # type: ignore[arg-type]


class VMSpecTests(SynchronousTestCase):
    """A spec names the files of its run directory."""

    def test_filesLiveInTheRunDirectory(self) -> None:
        spec = make_spec()
        self.assertEqual(spec.qmp_socket, "/run/vmready/4f3c2d1e/qmp.sock")
        self.assertEqual(spec.pidfile, "/run/vmready/4f3c2d1e/vm.pid")
        self.assertEqual(spec.guest_dir, "/run/vmready/4f3c2d1e/qmp.sock.guest")

    def test_relativeRunDirectoryIsMadeAbsolute(self) -> None:
        # QEMU changes to / when it daemonizes; a relative path would point there.
        spec = make_spec(run_dir="vms/web1")
        self.assertEqual(spec.run_dir, os.path.join(os.getcwd(), "vms", "web1"))

    def test_defaultRingAndLayout(self) -> None:
        spec = make_spec()
        self.assertEqual(spec.ring_size, 65536)
        self.assertEqual(
            spec.serial_ports, (SerialPort(AGENT_PORT, AGENT_RING), SerialPort(LEGACY_PORT))
        )

    def test_memoryAndCpusMustBePositive(self) -> None:
        self.assertRaises(ValueError, make_spec, memory_mib=0)
        self.assertRaises(ValueError, make_spec, cpus=0)


class CommandLineTests(SynchronousTestCase):
    """build_command_line gives the argv the docs describe, option for option."""

    def test_fullCommandLine(self) -> None:
        self.assertEqual(
            build_command_line(make_spec(), PROGRAM),
            [
                "qemu-system-x86_64",
                "-name",
                "guest=web1",
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
                "unix:/run/vmready/4f3c2d1e/qmp.sock,server=on,wait=off",
                "-device",
                "virtio-serial-pci,id=vs0",
                "-chardev",
                "ringbuf,id=vmready,size=65536",
                "-device",
                "virtserialport,chardev=vmready,name=com.canonical.lxd,bus=vs0.0,"
                "id=com.canonical.lxd",
                "-device",
                "virtserialport,name=org.linuxcontainers.lxd,bus=vs0.0,id=org.linuxcontainers.lxd",
                "-chardev",
                "socket,id=vmready-connect,path=/run/vmready/4f3c2d1e/connect.sock,"
                "server=on,wait=off",
                "-device",
                "virtserialport,chardev=vmready-connect,name=vmready.connect,bus=vs0.0,"
                "id=vmready.connect",
                "-chardev",
                "file,id=console,path=/run/vmready/4f3c2d1e/console.log,append=on",
                "-serial",
                "chardev:console",
                "-device",
                "pvpanic",
                "-device",
                "virtio-rng-pci",
                "-daemonize",
                "-pidfile",
                "/run/vmready/4f3c2d1e/vm.pid",
                "-D",
                "/run/vmready/4f3c2d1e/qemu.log",
            ],
        )

    def test_everyDeviceOfARealGuest(self) -> None:
        spec = make_spec(
            config_drive="/run/vmready/4f3c2d1e/config-drive",
            disk="/data/disks/4f3c2d1e.qcow2",
            kernel="/boot/vmlinuz",
            initrd="/boot/initrd.img",
            append="root=/dev/vda rw console=ttyS0",
            forward=GuestForward("/data/guest-fwd.sock", "52:54:00:00:00:01"),
        )
        argv = build_command_line(spec, PROGRAM)
        self.assertEqual(
            _values(argv, "-fsdev"),
            [
                "local,id=config,path=/run/vmready/4f3c2d1e/config-drive,"
                "security_model=none,readonly=on"
            ],
        )
        self.assertIn("virtio-9p-pci,fsdev=config,mount_tag=config", _values(argv, "-device"))
        self.assertEqual(
            _values(argv, "-netdev"),
            [
                "user,id=vmready-net,restrict=on,net=10.0.2.0/24,ipv6=off,"
                "guestfwd=tcp:10.0.2.100:8443-cmd:socat - UNIX-CONNECT:/data/guest-fwd.sock"
            ],
        )
        self.assertIn(
            "virtio-net-pci,netdev=vmready-net,mac=52:54:00:00:00:01", _values(argv, "-device")
        )
        self.assertEqual(
            _values(argv, "-blockdev"),
            [
                "driver=qcow2,node-name=root,file.driver=file,"
                "file.filename=/data/disks/4f3c2d1e.qcow2",
                "driver=raw,node-name=nocloud-seed,read-only=on,file.driver=file,"
                "file.filename=/run/vmready/4f3c2d1e/nocloud-seed.iso",
            ],
        )
        self.assertIn("virtio-blk-pci,drive=root", _values(argv, "-device"))
        self.assertEqual(_values(argv, "-kernel"), ["/boot/vmlinuz"])
        self.assertEqual(_values(argv, "-initrd"), ["/boot/initrd.img"])
        self.assertEqual(_values(argv, "-append"), ["root=/dev/vda rw console=ttyS0"])
        self.assertEqual(_values(argv, "-device").count("pvpanic"), 1)

    def test_vsockTransportGivesTheInstanceCid(self) -> None:
        argv = build_command_line(make_spec(vsock_cid=1234567), PROGRAM)
        self.assertIn("vhost-vsock-pci,guest-cid=1234567", _values(argv, "-device"))
        self.assertEqual(_values(argv, "-netdev"), [])

    def test_forwardCommandIsQuotedAndItsCommasDoubled(self) -> None:
        forward = GuestForward("/data dir/a,b/guest-fwd.sock", "52:54:00:00:00:01")
        argv = build_command_line(make_spec(forward=forward), PROGRAM)
        # QEMU splits the command shell-style (no shell runs it); QemuOpts wants ,, for a comma.
        self.assertEqual(
            _values(argv, "-netdev")[0].split("guestfwd=", 1)[1],
            "tcp:10.0.2.100:8443-cmd:socat - 'UNIX-CONNECT:/data dir/a,,b/guest-fwd.sock'",
        )

    def test_initrdAndAppendOnlyWithAKernel(self) -> None:
        argv = build_command_line(make_spec(initrd="/i", append="quiet"), PROGRAM)
        self.assertEqual(_values(argv, "-initrd") + _values(argv, "-append"), [])

    def test_programPrefixIsKeptWhole(self) -> None:
        argv = build_command_line(make_spec(), ["/usr/bin/python3", "-m", "fakeqemu"])
        self.assertEqual(argv[:5], ["/usr/bin/python3", "-m", "fakeqemu", "-name", "guest=web1"])

    def test_exactlyOneAcceleratorKvmWithTheHostCpu(self) -> None:
        argv = build_command_line(make_spec(), PROGRAM)
        self.assertEqual((_values(argv, "-accel"), _values(argv, "-cpu")), (["tcg"], []))
        argv = build_command_line(make_spec(accel="kvm"), PROGRAM)
        self.assertEqual((_values(argv, "-accel"), _values(argv, "-cpu")), (["kvm"], ["host"]))

    def test_unknownAcceleratorIsRefused(self) -> None:
        self.assertRaises(ValueError, make_spec, accel="hvf")

    def test_ringSizeComesFromTheSpec(self) -> None:
        argv = build_command_line(make_spec(ring_size=4096), PROGRAM)
        self.assertEqual(_values(argv, "-chardev")[0], "ringbuf,id=vmready,size=4096")

    def test_pausedStartsWithS(self) -> None:
        argv = build_command_line(make_spec(), PROGRAM, paused=True)
        self.assertEqual(argv[-1], "-S")
        self.assertNotIn("-S", build_command_line(make_spec(), PROGRAM))

    def test_incomingRestoresWithExecCat(self) -> None:
        argv = build_command_line(make_spec(), PROGRAM, incoming="/data/snap 1.state")
        self.assertEqual(argv[-2:], ["-incoming", "exec:cat '/data/snap 1.state'"])

    def test_pausedIncoming(self) -> None:
        argv = build_command_line(make_spec(), PROGRAM, paused=True, incoming="/s")
        self.assertEqual(argv[-3:], ["-S", "-incoming", "exec:cat /s"])

    def test_noUuidOption(self) -> None:
        # fakeqemu refuses -uuid; the uuid is vmready's, not the guest's.
        self.assertNotIn("-uuid", build_command_line(make_spec(), PROGRAM))

    def test_commasAreDoubledInOptionStrings(self) -> None:
        argv = build_command_line(make_spec(name="a,b", run_dir="/run/x,y"), PROGRAM)
        self.assertEqual(_values(argv, "-name"), ["guest=a,,b"])
        self.assertEqual(_values(argv, "-qmp"), ["unix:/run/x,,y/qmp.sock,server=on,wait=off"])
        self.assertEqual(
            _values(argv, "-chardev")[2], "file,id=console,path=/run/x,,y/console.log,append=on"
        )
        # -pidfile is a plain path, not an option string.
        self.assertEqual(_values(argv, "-pidfile"), ["/run/x,y/vm.pid"])

    def test_emptyProgramIsRefused(self) -> None:
        self.assertRaises(ValueError, build_command_line, make_spec(), [])


class SerialLayoutTests(SynchronousTestCase):
    """The serial wiring is data: other layouts are other tuples of SerialPort."""

    def test_legacyWiring(self) -> None:
        self.assertEqual(
            serial_arguments([SerialPort(LEGACY_PORT, AGENT_RING)], 16),
            [
                "-device",
                "virtio-serial-pci,id=vs0",
                "-chardev",
                "ringbuf,id=vmready,size=16",
                "-device",
                "virtserialport,chardev=vmready,name=org.linuxcontainers.lxd,bus=vs0.0,"
                "id=org.linuxcontainers.lxd",
            ],
        )

    def test_unwiredPortAfterWiredOne(self) -> None:
        self.assertEqual(
            serial_arguments([SerialPort(AGENT_PORT, AGENT_RING), SerialPort(LEGACY_PORT)], 16),
            [
                "-device",
                "virtio-serial-pci,id=vs0",
                "-chardev",
                "ringbuf,id=vmready,size=16",
                "-device",
                "virtserialport,chardev=vmready,name=com.canonical.lxd,bus=vs0.0,"
                "id=com.canonical.lxd",
                "-device",
                "virtserialport,name=org.linuxcontainers.lxd,bus=vs0.0,id=org.linuxcontainers.lxd",
            ],
        )

    def test_noPortsNoBus(self) -> None:
        self.assertEqual(serial_arguments([], 16), [])


class FakeQemuAcceptsTests(SynchronousTestCase):
    """fakeqemu's own parser takes the command line as built (no process needed).

    The parser opens the console file as QEMU does, so the run directory exists.
    """

    def setUp(self) -> None:
        # Short: the sockets in it must fit in 107 bytes.
        self.run_dir = tempfile.mkdtemp(prefix="vmr-qc-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.run_dir, True)

    def spec(self, **overrides: object) -> VMSpec:
        return make_spec(run_dir=self.run_dir, **overrides)

    def test_defaultLayoutIsWiredAsDesigned(self) -> None:
        argv = build_command_line(self.spec(), PROGRAM, paused=True, incoming="/s")
        config = parse_command_line(argv[1:])
        self.assertEqual(config.name, "web1")
        self.assertEqual(config.machine_type, "pc-q35-7.2")
        self.assertEqual(config.memory_bytes, 256 << 20)
        self.assertEqual(config.cpus, 2)
        self.assertTrue(config.daemonize)
        self.assertTrue(config.start_paused)
        self.assertEqual(config.incoming_path, "/s")
        self.assertEqual(config.qmp_sockets, (os.path.join(self.run_dir, "qmp.sock"),))
        self.assertEqual(
            [(port.bus_name, port.name, port.chardev) for port in config.serial_ports],
            [
                ("vs0.0", AGENT_PORT, AGENT_RING),
                ("vs0.0", LEGACY_PORT, None),
                ("vs0.0", CONNECT_PORT, "vmready-connect"),
            ],
        )
        self.assertEqual(config.logfile, os.path.join(self.run_dir, "qemu.log"))

    def test_legacyLayoutWiresTheOldNameOnly(self) -> None:
        argv = build_command_line(self.spec(serial_ports=LEGACY_LAYOUT.ports), PROGRAM)
        config = parse_command_line(argv[1:])
        self.assertEqual(
            [(port.name, port.chardev) for port in config.serial_ports],
            [(LEGACY_PORT, AGENT_RING), (CONNECT_PORT, "vmready-connect")],
        )

    def test_deviceSetNamesEverythingAStateDependsOn(self) -> None:
        self.assertEqual(
            self.spec(serial_ports=LEGACY_LAYOUT.ports, disk="/d.qcow2").device_set(),
            {
                "machine": "q35",
                "accel": "tcg",
                "connect_port": True,
                "memory_mib": 256,
                "cpus": 2,
                "serial_ports": [{"name": LEGACY_PORT, "chardev": AGENT_RING}],
                "console": True,
                "pvpanic": True,
                "config_drive": False,
                "disk": True,
                "transport": "none",
                "rng": True,
            },
        )

    def test_rngDeviceComesLastOfThePciDevicesAndOnlyWhenAsked(self) -> None:
        spec = self.spec(disk="/d.qcow2", kernel="/boot/vmlinuz")
        devices = _values(build_command_line(spec, PROGRAM), "-device")
        self.assertEqual(devices[-1], "virtio-rng-pci")
        without = attrs.evolve(spec, rng=False)
        devices_without = _values(build_command_line(without, PROGRAM), "-device")
        self.assertNotIn("virtio-rng-pci", devices_without)
        self.assertEqual(devices[:-1], devices_without)
        self.assertFalse(without.device_set()["rng"])

    def test_fakeqemuGivesTheRngDeviceItsOwnSlotAfterTheOthers(self) -> None:
        config = parse_command_line(build_command_line(self.spec(), PROGRAM)[1:])
        self.assertEqual(
            [(device.address, device.section) for device in config.pci_devices],
            [("0000:00:01.0", "virtio-console"), ("0000:00:02.0", "virtio-rng")],
        )

    def test_legacyPortBesideTheAgentPortIsAccepted(self) -> None:
        spec = self.spec(
            serial_ports=(SerialPort(AGENT_PORT, AGENT_RING), SerialPort(LEGACY_PORT))
        )
        config = parse_command_line(build_command_line(spec, PROGRAM)[1:])
        self.assertEqual(
            [(port.name, port.chardev) for port in config.serial_ports],
            [(AGENT_PORT, AGENT_RING), (LEGACY_PORT, None), (CONNECT_PORT, "vmready-connect")],
        )

    def test_nonPowerOfTwoRingIsLeftForTheHypervisorToRefuse(self) -> None:
        argv = build_command_line(self.spec(ring_size=1000), PROGRAM)
        with self.assertRaises(CommandLineError) as caught:
            parse_command_line(argv[1:])
        self.assertIn("size of ringbuf chardev must be power of two", str(caught.exception))


def _values(argv: list[str], option: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv) if word == option]
