"""Conformance checks for the devices of vmready's real-guest command line (issue 11).

Each check runs unchanged against fakeqemu and real QEMU: the console file,
pvpanic, the 9p config drive, the restricted user network with its guestfwd
rule, vhost-vsock, the qcow2 root disk, direct kernel boot, ``-cpu host``, ids
on serial ports and the whole contract line at once.  Checks that need a
guest to act (open a port, write the console, connect through a forward,
panic) cannot run on real QEMU without booting one; they are in
``DeviceGuestChecks`` and run on fakeqemu only, saying so.
"""

from __future__ import annotations

import os
import subprocess

from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol

from fakeqemu.testing import write_kernel
from tests.conformance.checks import (
    BackendTestCase,
    GuestEnd,
    _async,
    _poll_status,
    _poll_until,
)
from tests.conformance.support import (
    AGENT_PORT,
    AGENT_RING,
    LEGACY_PORT,
    EventLog,
    ProcessResult,
    base_arguments,
    launch_daemonized,
    monitor,
    qemu_text,
    require_program,
    run_foreground,
    start_daemonized,
)
from tests.reactor import reactor
from vmready.protocols.qmp import QMPClientProtocol

FORWARD_ADDRESS = "10.0.2.100:8443"
MAC = "52:54:00:76:6d:01"


class DeviceTestCase(BackendTestCase):
    """Helpers: qemu-img fixtures and the contract's device options in a workspace."""

    def qemu_img(self, *args: str) -> None:
        """Run ``qemu-img`` for a fixture; skip (fail under VMREADY_REQUIRE_QEMU=1) without it."""
        program = require_program(self, "qemu-img", "qemu-utils")
        subprocess.run([program, *args], check=True, capture_output=True)

    def image(self, name: str = "disk.qcow2", backing: str | None = None) -> str:
        """A 16 MiB qcow2 made by ``qemu-img create`` (``backing``: unchecked, may be missing)."""
        path = self.workspace.file(name)
        if backing is None:
            self.qemu_img("create", "-f", "qcow2", path, "16M")
        else:
            self.qemu_img("create", "-f", "qcow2", "-b", backing, "-F", "qcow2", "-u", path, "16M")
        return path

    def kernel(self) -> str:
        """A file with a Linux boot header; QEMU loads it (and runs zeros)."""
        path = self.workspace.file("vmlinuz")
        write_kernel(path)
        return path

    def refusal(self, *args: str, accel: str = "tcg") -> ProcessResult:
        """Run the standard machine plus ``args`` in the foreground; it must exit 1."""
        result = run_foreground(self.backend, [*base_arguments(accel=accel), *args])
        self.assertEqual(result.returncode, 1, result.stderr)
        return result

    def console_option(self, append: bool = True) -> list[str]:
        """``-chardev file`` for the console log in the workspace, and ``-serial``."""
        option = f"file,id=console,path={self.workspace.file('console.log')}"
        return [
            "-chardev",
            option + (",append=on" if append else ""),
            "-serial",
            "chardev:console",
        ]

    def config_drive(self) -> list[str]:
        """The read-only 9p config drive."""
        drive = self.workspace.file("config-drive")
        os.makedirs(drive, exist_ok=True)
        return [
            "-fsdev",
            f"local,id=config,path={drive},security_model=none,readonly=on",
            "-device",
            "virtio-9p-pci,fsdev=config,mount_tag=config",
        ]

    def fallback_network(self, command: str) -> list[str]:
        """The restricted user network with one guestfwd rule running ``command``."""
        return [
            "-netdev",
            "user,id=vmready-net,restrict=on,net=10.0.2.0/24,ipv6=off,"
            f"guestfwd=tcp:{FORWARD_ADDRESS}-cmd:{command}",
            "-device",
            f"virtio-net-pci,netdev=vmready-net,mac={MAC}",
        ]

    def serial_ports_with_ids(self) -> list[str]:
        """The contract's virtio-serial layout: both ports, each with id=<its name>."""
        return [
            "-device",
            "virtio-serial-pci,id=vs0",
            "-chardev",
            f"ringbuf,id={AGENT_RING},size=65536",
            "-device",
            f"virtserialport,chardev={AGENT_RING},name={AGENT_PORT},bus=vs0.0,id={AGENT_PORT}",
            "-device",
            f"virtserialport,name={LEGACY_PORT},bus=vs0.0,id={LEGACY_PORT}",
        ]

    async def start_devices(self, *args: str, accel: str = "tcg") -> QMPClientProtocol:
        """Start the standard machine plus ``args``, daemonized; a negotiated monitor."""
        socket_path = start_daemonized(
            self.backend, self.workspace, [*base_arguments(accel=accel), *args]
        )
        client = await monitor(socket_path)
        self.addCleanup(client.close)
        return client


class ContractLineChecks(DeviceTestCase):
    """The whole command line vmready passes, and each device's accepted form."""

    @_async
    async def test_wholeContractLineStartsAndAnswers(self) -> None:
        image = self.image()
        client = await self.start_devices(
            "-smp",
            "2",
            *self.serial_ports_with_ids(),
            *self.console_option(),
            "-device",
            "pvpanic",
            *self.config_drive(),
            *self.fallback_network(
                f"socat - UNIX-CONNECT:{self.workspace.file('guest-fwd.sock')}"
            ),
            "-blockdev",
            f"driver=qcow2,node-name=root,file.driver=file,file.filename={image}",
            "-device",
            "virtio-blk-pci,drive=root",
            "-kernel",
            self.kernel(),
            "-append",
            "root=/dev/vda rw console=ttyS0",
            "-S",
        )
        chardevs = {c["label"]: c for c in await client.execute("query-chardev")}
        self.assertEqual(
            (
                await client.execute("query-status"),
                chardevs["console"],
                chardevs[AGENT_RING]["frontend-open"],
            ),
            (
                {"status": "prelaunch", "singlestep": False, "running": False},
                {"frontend-open": True, "filename": "file", "label": "console"},
                False,
            ),
        )

    @_async
    async def test_consoleFileIsCreatedAtStart(self) -> None:
        client = await self.start_devices(*self.console_option())
        await client.execute("query-status")
        self.assertEqual(self.workspace.read("console.log"), "")

    @_async
    async def test_appendOnKeepsTheFilesContents(self) -> None:
        self.workspace.write("console.log", "an earlier boot\n")
        client = await self.start_devices(*self.console_option(append=True))
        await client.execute("query-status")
        self.assertEqual(self.workspace.read("console.log"), "an earlier boot\n")

    @_async
    async def test_withoutAppendTheConsoleFileIsTruncated(self) -> None:
        self.workspace.write("console.log", "an earlier boot\n")
        client = await self.start_devices(*self.console_option(append=False))
        await client.execute("query-status")
        self.assertEqual(self.workspace.read("console.log"), "")

    @_async
    async def test_fallbackNetworkSpawnsNothingUntilAGuestConnects(self) -> None:
        """The guestfwd command runs per guest connection, never at start.

        Real QEMU cannot be connected to from the host side of this rule: only a
        booted guest's TCP connection to 10.0.2.100:8443 runs the command, so
        here both backends must start with the rule and run nothing.
        """
        marker = self.workspace.file("spawned")
        client = await self.start_devices(*self.fallback_network(f"touch {marker}"))
        self.assertEqual(
            ((await client.execute("query-status"))["status"], os.path.exists(marker)),
            ("running", False),
        )

    @_async
    async def test_largestGuestCidPassesTheCidChecks(self) -> None:
        """guest-cid 4294967295 is valid; the device then needs /dev/vhost-vsock."""
        if os.path.exists("/dev/vhost-vsock"):
            client = await self.start_devices("-device", "vhost-vsock-pci,guest-cid=4294967295")
            self.assertEqual((await client.execute("query-status"))["status"], "running")
            return
        self.assertEqual(
            self.refusal("-device", "vhost-vsock-pci,guest-cid=4294967295").messages,
            [
                "-device vhost-vsock-pci,guest-cid=4294967295: "
                "vhost-vsock: failed to open vhost device: No such file or directory"
            ],
        )

    @_async
    async def test_overlayOnARelativeBackingFileStarts(self) -> None:
        self.image("base.qcow2")
        overlay = self.image("overlay.qcow2", backing="base.qcow2")
        client = await self.start_devices(
            "-blockdev",
            f"driver=qcow2,node-name=root,file.driver=file,file.filename={overlay}",
            "-device",
            "virtio-blk-pci,drive=root",
        )
        self.assertEqual((await client.execute("query-status"))["status"], "running")


class DeviceRefusalChecks(DeviceTestCase):
    """Each new option's refusals: same text, exit status 1."""

    def test_duplicatePortIdRefused(self) -> None:
        self.assertEqual(
            self.refusal(
                "-device",
                "virtio-serial-pci,id=vs0",
                "-device",
                "virtserialport,name=a,bus=vs0.0,id=a",
                "-device",
                "virtserialport,name=b,bus=vs0.0,id=a",
            ).messages,
            ["-device virtserialport,name=b,bus=vs0.0,id=a: Duplicate ID 'a' for device"],
        )

    def test_consoleFileInAMissingDirectoryRefused(self) -> None:
        path = self.workspace.file("nodir/console.log")
        self.assertEqual(
            self.refusal("-chardev", f"file,id=console,path={path},append=on").messages,
            [
                f"-chardev file,id=console,path={path},append=on: "
                f"Could not open '{path}': No such file or directory"
            ],
        )

    def test_serialRefusals(self) -> None:
        self.assertEqual(
            [
                self.refusal("-serial", "chardev:nope").messages,
                self.refusal("-serial", "bogus:x").messages,
            ],
            [
                [
                    "-serial chardev:nope: could not connect serial device to character "
                    "backend 'chardev:nope'"
                ],
                [
                    "-serial bogus:x: 'bogus:x' is not a valid char driver",
                    "-serial bogus:x: could not connect serial device to character backend "
                    "'bogus:x'",
                ],
            ],
        )

    def test_pvpanicTwiceRefused(self) -> None:
        self.assertEqual(
            self.refusal("-device", "pvpanic", "-device", "pvpanic").messages,
            ["-device pvpanic: duplicate fw_cfg file name: etc/pvpanic-port"],
        )

    def test_configDriveRefusals(self) -> None:
        drive = self.workspace.file("config-drive")
        os.makedirs(drive)
        missing = self.workspace.file("missing")
        fsdev = f"local,id=config,path={drive},security_model=none,readonly=on"
        self.assertEqual(
            [
                self.refusal(
                    "-fsdev",
                    f"local,id=config,path={missing},security_model=none,readonly=on",
                    "-device",
                    "virtio-9p-pci,fsdev=config,mount_tag=config",
                ).messages,
                self.refusal("-fsdev", f"local,id=config,path={drive},readonly=on").messages,
                self.refusal(
                    "-fsdev", fsdev, "-device", "virtio-9p-pci,fsdev=other,mount_tag=config"
                ).messages,
                self.refusal("-fsdev", fsdev, "-device", "virtio-9p-pci,fsdev=config").messages,
            ],
            [
                [
                    "-device virtio-9p-pci,fsdev=config,mount_tag=config: cannot initialize "
                    f"fsdev 'config': failed to open '{missing}': No such file or directory"
                ],
                [
                    f"-fsdev local,id=config,path={drive},readonly=on: "
                    "security_model property not set",
                    "Valid options are: "
                    "security_model=[passthrough|mapped-xattr|mapped-file|none]",
                ],
                [
                    "-device virtio-9p-pci,fsdev=other,mount_tag=config: "
                    "9pfs device couldn't find fsdev with the id = other"
                ],
                [
                    "-device virtio-9p-pci,fsdev=config: "
                    "fsdev with id config needs mount_tag arguments"
                ],
            ],
        )

    def test_fallbackNetworkRefusals(self) -> None:
        rule = "tcp:10.0.2.100-cmd:true"
        self.assertEqual(
            [
                self.refusal(
                    "-netdev", "user,id=n,restrict=on", "-device", "virtio-net-pci,netdev=other"
                ).messages,
                self.refusal("-netdev", f"user,id=n,restrict=on,guestfwd={rule}").messages,
                self.refusal(
                    "-netdev", "user,id=n", "-device", "virtio-net-pci,netdev=n,mac=52:54:00:76:6d"
                ).messages,
                self.refusal(
                    "-netdev", "user,id=n,restrict=on,guestfwd=tcp:10.0.2.2:80-cmd:true"
                ).messages,
            ],
            [
                [
                    "-device virtio-net-pci,netdev=other: "
                    "Property 'virtio-net-device.netdev' can't find value 'other'"
                ],
                [
                    f"-netdev user,id=n,restrict=on,guestfwd={rule}: "
                    f"Invalid guest forwarding rule '{rule}'"
                ],
                [
                    "-device virtio-net-pci,netdev=n,mac=52:54:00:76:6d: "
                    "Property 'virtio-net-device.mac' doesn't take value '52:54:00:76:6d'"
                ],
                [
                    "-netdev user,id=n,restrict=on,guestfwd=tcp:10.0.2.2:80-cmd:true: "
                    "Conflicting/invalid host:port in guest forwarding rule "
                    "'tcp:10.0.2.2:80-cmd:true'"
                ],
            ],
        )

    def test_vhostVsockRefusals(self) -> None:
        expected = [
            ["-device vhost-vsock-pci,guest-cid=2: guest-cid property must be greater than 2"],
            [
                "-device vhost-vsock-pci,guest-cid=4294967296: "
                "guest-cid property must be a 32-bit number"
            ],
        ]
        self.assertEqual(
            [
                self.refusal("-device", "vhost-vsock-pci,guest-cid=2").messages,
                self.refusal("-device", "vhost-vsock-pci,guest-cid=4294967296").messages,
            ],
            expected,
        )

    def test_vhostVsockWithoutTheDeviceRefused(self) -> None:
        """On a host without /dev/vhost-vsock (this one), both refuse in QEMU's words."""
        if os.path.exists("/dev/vhost-vsock"):
            self.skipTest("/dev/vhost-vsock exists here: QEMU would use it")
        self.assertEqual(
            self.refusal("-device", "vhost-vsock-pci,guest-cid=5").messages,
            [
                "-device vhost-vsock-pci,guest-cid=5: "
                "vhost-vsock: failed to open vhost device: No such file or directory"
            ],
        )

    def test_rootDiskRefusals(self) -> None:
        text = self.workspace.write("text.txt", "hello\n")
        missing = self.workspace.file("missing.qcow2")
        overlay = self.image("overlay.qcow2", backing=self.workspace.file("gone.qcow2"))
        image = self.image()

        def disk(path: str) -> list[str]:
            return self.refusal(
                "-blockdev",
                f"driver=qcow2,node-name=root,file.driver=file,file.filename={path}",
                "-device",
                "virtio-blk-pci,drive=root",
            ).messages

        prefix = "-blockdev driver=qcow2,node-name=root,file.driver=file,file.filename="
        self.assertEqual(
            [
                disk(missing),
                disk(text),
                disk(overlay),
                self.refusal(
                    "-blockdev",
                    f"driver=qcow2,node-name=root,file.driver=file,file.filename={image}",
                    "-device",
                    "virtio-blk-pci,drive=other",
                ).messages,
            ],
            [
                [f"{prefix}{missing}: Could not open '{missing}': No such file or directory"],
                [f"{prefix}{text}: Image is not in qcow2 format"],
                [
                    f"{prefix}{overlay}: Could not open backing file: Could not open "
                    f"'{self.workspace.file('gone.qcow2')}': No such file or directory"
                ],
                [
                    "-device virtio-blk-pci,drive=other: "
                    "Property 'virtio-blk-device.drive' can't find value 'other'"
                ],
            ],
        )

    def test_kernelRefusals(self) -> None:
        """The loader's own lines start with ``qemu:``, whatever the program is called."""
        missing = self.workspace.file("nokernel")
        text = self.workspace.write("text.txt", "hello\n")
        kernel = self.kernel()
        initrd = self.workspace.file("noinitrd")
        results = [
            self.refusal("-kernel", missing),
            self.refusal("-kernel", text),
            self.refusal("-kernel", kernel, "-initrd", initrd),
        ]
        self.assertEqual(
            [result.stderr for result in results],
            [
                f"qemu: could not open kernel file '{missing}': No such file or directory\n",
                "qemu: invalid kernel header\n",
                f"qemu: error reading initrd {initrd}: Failed to open file \u201c{initrd}\u201d: "
                "open() failed: No such file or directory\n",
            ],
        )

    def test_appendAndInitrdNeedAKernel(self) -> None:
        self.assertEqual(
            [
                self.refusal("-append", "console=ttyS0").messages,
                self.refusal("-initrd", self.workspace.file("initrd")).messages,
            ],
            [
                ["-append only allowed with -kernel option"],
                ["-initrd only allowed with -kernel option"],
            ],
        )

    def test_cpuHostNeedsKvm(self) -> None:
        self.assertEqual(
            self.refusal("-cpu", "host", accel="tcg").messages,
            ["CPU model 'host' requires KVM or HVF"],
        )


class DeviceLogfileChecks(DeviceTestCase):
    """With ``-daemonize -D FILE``, where the new options' refusals go."""

    def daemonized(self, *args: str) -> tuple[int, str, str | None]:
        """A daemonizing launch logging to ``vm.log``: status, stderr, the log's text."""
        self.workspace.write("vm.log", "an earlier run\n")
        result = launch_daemonized(
            self.backend,
            self.workspace,
            [*base_arguments(accel="tcg"), *args, "-D", self.workspace.file("vm.log")],
        )
        return result.returncode, result.stderr, self.workspace.read("vm.log")

    def test_kernelLoaderLinesGoToTheLogUnprefixed(self) -> None:
        missing = self.workspace.file("nokernel")
        self.assertEqual(
            self.daemonized("-kernel", missing),
            (1, "", f"qemu: could not open kernel file '{missing}': No such file or directory\n"),
        )

    def test_appendWithoutKernelStaysOnStderr(self) -> None:
        status, stderr, logged = self.daemonized("-append", "console=ttyS0")
        self.assertEqual(
            (status, stderr, logged),
            (
                1,
                qemu_text(self.backend, "-append only allowed with -kernel option"),
                "an earlier run\n",
            ),
        )

    def test_diskAndNetworkErrorsGoToTheLog(self) -> None:
        missing = self.workspace.file("missing.qcow2")
        blockdev = f"driver=qcow2,node-name=root,file.driver=file,file.filename={missing}"
        self.assertEqual(
            [
                self.daemonized("-blockdev", blockdev),
                self.daemonized("-netdev", "user,id=n,restrict=bogus"),
            ],
            [
                (
                    1,
                    "",
                    qemu_text(
                        self.backend,
                        f"-blockdev {blockdev}: Could not open '{missing}': "
                        "No such file or directory",
                    ),
                ),
                (
                    1,
                    "",
                    qemu_text(
                        self.backend,
                        "-netdev user,id=n,restrict=bogus: "
                        "Parameter 'restrict' expects 'on' or 'off'",
                    ),
                ),
            ],
        )

    def test_blockdevSchemaErrorStaysOnStderr(self) -> None:
        status, stderr, logged = self.daemonized("-blockdev", "node-name=root")
        self.assertEqual(
            (status, stderr, logged),
            (
                1,
                qemu_text(self.backend, "-blockdev node-name=root: Parameter 'driver' is missing"),
                "an earlier run\n",
            ),
        )


class DeviceMigrationChecks(DeviceTestCase):
    """A saved VM with the contract's devices restores only into the same device set."""

    async def saved(self, *devices: str) -> str:
        """Start a VM with ``devices``, migrate it to a file; the file."""
        client = await self.start_devices(*devices)
        events = EventLog(client)
        state = self.workspace.file("vm.state")
        await client.execute(
            "migrate-set-capabilities", {"capabilities": [{"capability": "events", "state": True}]}
        )
        await client.execute("migrate", {"uri": f"exec:cat > {state}"})
        await events.wait_for("MIGRATION", status="completed")
        await _poll_status(client, until="postmigrate")
        await client.execute("quit")
        await client.when_closed()
        return state

    def restore_refusal(self, state: str, *devices: str) -> list[str]:
        """What a restore of ``state`` into ``devices`` prints as it fails."""
        result = run_foreground(
            self.backend,
            [*base_arguments(accel="tcg"), *devices, "-incoming", f"exec:cat {state}"],
        )
        self.assertEqual(result.returncode, 1, result.stderr)
        return result.messages

    def devices(self, nic: bool = True, disk: bool = True, rng: bool = False) -> list[str]:
        """Serial ports, console, pvpanic, config drive, optionally NIC, disk and rng."""
        args = [*self.serial_ports_with_ids(), *self.console_option(), "-device", "pvpanic"]
        args += self.config_drive()
        if nic:
            args += self.fallback_network("true")
        if disk:
            image = self.workspace.file("disk.qcow2")
            if not os.path.exists(image):
                self.image()
            args += [
                "-blockdev",
                f"driver=qcow2,node-name=root,file.driver=file,file.filename={image}",
                "-device",
                "virtio-blk-pci,drive=root",
            ]
        if rng:
            args += ["-device", "virtio-rng-pci"]
        return args

    @_async
    async def test_withoutTheNicTheStreamHasAnUnknownRamBlock(self) -> None:
        state = await self.saved(*self.devices())
        self.assertEqual(
            self.restore_refusal(state, *self.devices(nic=False)),
            [
                'Unknown ramblock "0000:00:03.0/virtio-net-pci.rom", cannot accept migration',
                "error while loading state for instance 0x0 of device 'ram'",
                "load of migration failed: Invalid argument",
            ],
        )

    @_async
    async def test_withoutTheDiskTheStreamHasAnUnknownSection(self) -> None:
        state = await self.saved(*self.devices())
        self.assertEqual(
            self.restore_refusal(state, *self.devices(disk=False)),
            [
                "Unknown savevm section or instance '0000:00:04.0/virtio-blk' 0. Make sure that "
                "your current VM setup matches your saved VM setup, including any hotplugged "
                "devices",
                "load of migration failed: Invalid argument",
            ],
        )

    @_async
    async def test_withoutTheRngTheStreamHasAnUnknownSection(self) -> None:
        state = await self.saved(*self.devices(rng=True))
        self.assertEqual(
            self.restore_refusal(state, *self.devices()),
            [
                "Unknown savevm section or instance '0000:00:05.0/virtio-rng' 0. Make sure that "
                "your current VM setup matches your saved VM setup, including any hotplugged "
                "devices",
                "load of migration failed: Invalid argument",
            ],
        )

    @_async
    async def test_sameDevicesRestore(self) -> None:
        await self.restores(await self.saved(*self.devices()), self.devices())

    @_async
    async def test_sameDevicesWithTheRngRestore(self) -> None:
        await self.restores(await self.saved(*self.devices(rng=True)), self.devices(rng=True))

    async def restores(self, state: str, devices: list[str]) -> None:
        """``state`` loads into a VM with ``devices``, which then runs."""
        socket_path = start_daemonized(
            self.backend,
            self.workspace,
            [*base_arguments(accel="tcg"), *devices, "-incoming", f"exec:cat {state}"],
            socket_name="restored.sock",
        )
        client = await monitor(socket_path)
        self.addCleanup(client.close)
        self.assertEqual(await _poll_status(client, until="running"), "running")


class DeviceGuestChecks(DeviceTestCase):
    """Checks that need a guest to act: fakeqemu only.

    On real QEMU a guest OS must open the port, write to ttyS0, connect through
    the forward or panic; these measurements were made once with a Debian 6.1
    kernel and busybox (see fakeqemu's docstrings), and fakeqemu's guest
    sockets stand in for that guest here.
    """

    def guest_path(self, name: str) -> str:
        """A path in the guest directory of the VM at ``qmp.sock``."""
        return self.workspace.file(f"qmp.sock.guest/{name}")

    async def connect(self, name: str) -> GuestEnd:
        """Connect as the guest to ``<guest dir>/<name>``."""
        guest = GuestEnd()
        await connectProtocol(UNIXClientEndpoint(reactor, self.guest_path(name)), guest)
        self.addCleanup(guest.hang_up)
        return guest

    async def panic(self) -> None:
        """The guest kernel panics (fakeqemu's control channel)."""
        control = await self.connect("control")
        control.send(b"panic\n")
        await control.wait_for(b"\n")

    @_async
    async def test_portWithAnIdReportsOpenAndClose(self) -> None:
        """VSERPORT_CHANGE: measured with a real guest opening and closing /dev/vport0p1."""
        client = await self.start_devices(*self.serial_ports_with_ids())
        events = EventLog(client)
        guest = await self.connect(f"virtio-ports/{AGENT_PORT}")
        await events.wait_for("VSERPORT_CHANGE", open=True)
        guest.hang_up()
        closed = await events.wait_for("VSERPORT_CHANGE", open=False)
        self.assertEqual(closed.data, {"open": False, "id": AGENT_PORT})

    @_async
    async def test_consoleWritesLandInTheFile(self) -> None:
        await self.start_devices(*self.console_option())
        console = await self.connect("console")
        console.send(b"GUEST: up\n")
        await _poll_until(
            lambda: self.workspace.read("console.log") == "GUEST: up\n", "the console line"
        )

    @_async
    async def test_forwardRunsTheCommandPerConnection(self) -> None:
        """Measured with a real guest: stdout and stderr both reach the connection."""
        await self.start_devices(
            *self.fallback_network("sh -c 'echo out; echo err >&2; exec cat'")
        )
        guest = await self.connect(f"tcp/{FORWARD_ADDRESS}")
        await guest.wait_for(b"err\n")
        guest.send(b"ping\n")
        self.assertEqual(await guest.wait_for(b"ping\n"), b"out\nerr\nping\n")

    @_async
    async def test_configDriveIsLinkedForTheGuest(self) -> None:
        client = await self.start_devices(*self.config_drive())
        await client.execute("query-status")
        self.assertEqual(
            os.readlink(self.guest_path("9p/config")), self.workspace.file("config-drive")
        )

    @_async
    async def test_panicWithPvpanicPowersOff(self) -> None:
        """Measured with a real guest: GUEST_PANICKED, SHUTDOWN guest-panic, no STOP."""
        client = await self.start_devices("-device", "pvpanic")
        events = EventLog(client)
        await self.panic()
        await client.when_closed()
        self.assertEqual(
            [(e.name, e.data) for e in events.events],
            [
                ("GUEST_PANICKED", {"action": "poweroff"}),
                ("SHUTDOWN", {"guest": True, "reason": "guest-panic"}),
            ],
        )

    @_async
    async def test_panicWithoutPvpanicIsInvisible(self) -> None:
        client = await self.start_devices()
        events = EventLog(client)
        await self.panic()
        # Events precede the replies to later commands: none came.
        self.assertEqual(
            ((await client.execute("query-status"))["status"], events.names()), ("running", [])
        )
