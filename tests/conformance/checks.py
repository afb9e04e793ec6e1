"""The conformance checks: each runs unchanged against fakeqemu and real QEMU.

A check that needs a guest to open a virtio port cannot run on real QEMU
without booting a guest OS; those live in ``GuestChecks`` and run on fakeqemu
only, saying so.
"""

from __future__ import annotations

import base64
import os
import re
import signal
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.endpoints import UNIXClientEndpoint, connectProtocol
from twisted.internet.error import ConnectError
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from tests.conformance.support import (
    AGENT_PORT,
    AGENT_RING,
    LEGACY_PORT,
    START_TIMEOUT,
    Backend,
    EventLog,
    VMWorkspace,
    base_arguments,
    cannot_run,
    launch_daemonized,
    monitor,
    qemu_text,
    raw_monitor,
    run_foreground,
    serial_devices,
    start_daemonized,
    strip_program,
)
from tests.reactor import reactor
from vmready.protocols.qmp import QMPClientProtocol, QMPDisconnected, QMPError
from vmready.protocols.ringbuffer import DiscardedFragment, HostEcho, RingBufferReader, StatusLine


class BackendTestCase(TestCase):
    """Skips (or, under CI's VMREADY_REQUIRE_QEMU=1, fails) when the backend is missing."""

    backend: Backend

    def setUp(self) -> None:
        reason = self.backend.unavailable_reason()
        if reason is not None:
            cannot_run(self, f"{self.backend.name} cannot run: {reason}")
        self.workspace = VMWorkspace()
        self.addCleanup(self.workspace.cleanup)

    async def start(self, *extra: str, ring_size: int = 16) -> QMPClientProtocol:
        """Start the standard VM (plus ``extra`` arguments) and return a negotiated monitor."""
        socket_path = start_daemonized(
            self.backend,
            self.workspace,
            [*base_arguments(), *serial_devices(ring_size), *extra],
        )
        client = await monitor(socket_path)
        self.addCleanup(client.close)
        return client


def _async(test: Any) -> Any:
    """Let an ``async def`` check run under trial's TestCase and keep its name."""

    def run(self: Any) -> Deferred[None]:
        return ensureDeferred(test(self))

    run.__name__ = test.__name__
    run.__doc__ = test.__doc__
    return run


class MonitorChecks(BackendTestCase):
    """QMP as QEMU speaks it: greeting, negotiation, errors, run state and events."""

    @_async
    async def test_greetingNamesVersionAndOOBCapability(self) -> None:
        client = await self.start()
        assert client.greeting is not None
        self.assertEqual(client.greeting["capabilities"], ["oob"])
        self.assertEqual(
            (
                client.greeting["version"]["qemu"]["major"],
                client.greeting["version"]["qemu"]["minor"],
            ),
            (7, 2),
        )
        version = await client.execute("query-version")
        self.assertEqual(version["qemu"], client.greeting["version"]["qemu"])

    @_async
    async def test_commandsBeforeNegotiationAreRefused(self) -> None:
        socket_path = start_daemonized(
            self.backend, self.workspace, [*base_arguments(), *serial_devices()]
        )
        raw = await raw_monitor(socket_path)
        self.addCleanup(lambda: raw.transport.loseConnection() if raw.transport else None)
        await raw.wait_for_count(1)
        raw.send(b'{"execute": "query-status", "id": 1}')
        raw.send(b'{"execute": "qmp_capabilities", "id": 2}')
        raw.send(b'{"execute": "qmp_capabilities", "id": 3}')
        messages = await raw.wait_for_count(4)
        self.assertIn("QMP", messages[0])
        self.assertEqual(
            messages[1:],
            [
                {
                    "id": 1,
                    "error": {
                        "class": "CommandNotFound",
                        "desc": "Expecting capabilities negotiation with 'qmp_capabilities'",
                    },
                },
                {"return": {}, "id": 2},
                {
                    "id": 3,
                    "error": {
                        "class": "CommandNotFound",
                        "desc": "Capabilities negotiation is already complete, command ignored",
                    },
                },
            ],
        )

    @_async
    async def test_unknownCommandIsCommandNotFound(self) -> None:
        client = await self.start()
        with self.assertRaises(QMPError) as caught:
            await client.execute("no-such-command")
        self.assertEqual(
            (caught.exception.error_class, caught.exception.desc),
            ("CommandNotFound", "The command no-such-command has not been found"),
        )

    @_async
    async def test_jsonParseErrorIsAnsweredAndSessionKept(self) -> None:
        socket_path = start_daemonized(
            self.backend, self.workspace, [*base_arguments(), *serial_devices()]
        )
        raw = await raw_monitor(socket_path)
        self.addCleanup(lambda: raw.transport.loseConnection() if raw.transport else None)
        await raw.wait_for_count(1)
        raw.send(b'{"execute":"qmp_capabilities"}')
        raw.send(b'{"execute": bad}\n')
        raw.send(b"[1, 2]\n")
        raw.send(b'{"execute":"query-status","id":"after"}')
        messages = await raw.wait_for_count(5)
        self.assertEqual(
            messages[2],
            {
                "error": {
                    "class": "GenericError",
                    "desc": "JSON parse error, invalid keyword 'bad'",
                }
            },
        )
        self.assertEqual(
            messages[3],
            {"error": {"class": "GenericError", "desc": "QMP input must be a JSON object"}},
        )
        self.assertEqual(messages[4]["id"], "after")
        self.assertEqual(messages[4]["return"]["status"], "running")

    @_async
    async def test_argumentErrorsUseQEMUWording(self) -> None:
        client = await self.start()
        cases: list[tuple[dict[str, Any], str]] = [
            ({"device": AGENT_RING}, "Parameter 'size' is missing"),
            (
                {"device": AGENT_RING, "size": "x"},
                "Invalid parameter type for 'size', expected: integer",
            ),
            ({"device": AGENT_RING, "size": 4, "extra": 1}, "Parameter 'extra' is unexpected"),
            (
                {"device": AGENT_RING, "size": 4, "format": "hex"},
                "Parameter 'format' does not accept value 'hex'",
            ),
        ]
        for arguments, desc in cases:
            with self.assertRaises(QMPError) as caught:
                await client.execute("ringbuf-read", arguments)
            self.assertEqual(
                (caught.exception.error_class, caught.exception.desc), ("GenericError", desc)
            )

    @_async
    async def test_pausedStartThenContAndStopWithEvents(self) -> None:
        client = await self.start("-S")
        events = EventLog(client)
        self.assertEqual((await client.execute("query-status"))["status"], "prelaunch")
        await client.execute("cont")
        await events.wait_for("RESUME")
        self.assertEqual(
            await client.execute("query-status"),
            {"status": "running", "singlestep": False, "running": True},
        )
        await client.execute("stop")
        stop = await events.wait_for("STOP")
        self.assertGreater(stop.timestamp, 1_000_000_000)
        await client.execute("stop")
        self.assertEqual((await client.execute("query-status"))["status"], "paused")
        self.assertEqual(events.names(), ["RESUME", "STOP"])

    @_async
    async def test_quitAnnouncesShutdownThenDisconnects(self) -> None:
        client = await self.start()
        events = EventLog(client)
        await client.execute("quit")
        await client.when_closed()
        self.assertEqual(events.names(), ["SHUTDOWN"])
        self.assertEqual(events.events[0].data, {"guest": False, "reason": "host-qmp-quit"})
        with self.assertRaises(QMPDisconnected):
            await client.execute("query-status")

    @_async
    async def test_resetAndPowerdownEvents(self) -> None:
        client = await self.start()
        events = EventLog(client)
        await client.execute("system_reset")
        reset = await events.wait_for("RESET")
        self.assertEqual(reset.data, {"guest": False, "reason": "host-qmp-system-reset"})
        await client.execute("system_powerdown")
        await events.wait_for("POWERDOWN")

    @_async
    async def test_queryChardevListsRingAndMonitor(self) -> None:
        client = await self.start()
        chardevs = {c["label"]: c for c in await client.execute("query-chardev")}
        self.assertEqual(
            chardevs[AGENT_RING],
            {"frontend-open": False, "filename": "ringbuf", "label": AGENT_RING},
        )
        monitor_entry = chardevs["compat_monitor0"]
        self.assertTrue(monitor_entry["frontend-open"])
        self.assertEqual(
            monitor_entry["filename"], f"unix:{self.workspace.file('qmp.sock')},server=on"
        )


class RingBufferChecks(BackendTestCase):
    """ringbuf-read and ringbuf-write, byte for byte."""

    @_async
    async def test_writeThenReadRoundTrip(self) -> None:
        client = await self.start(ring_size=64)
        await client.execute("ringbuf-write", {"device": AGENT_RING, "data": "STARTED\n"})
        self.assertEqual(
            await client.execute("ringbuf-read", {"device": AGENT_RING, "size": 64}), "STARTED\n"
        )

    @_async
    async def test_readDrains(self) -> None:
        client = await self.start(ring_size=64)
        await client.execute("ringbuf-write", {"device": AGENT_RING, "data": "abcdef"})
        first = await client.execute("ringbuf-read", {"device": AGENT_RING, "size": 2})
        rest = await client.execute("ringbuf-read", {"device": AGENT_RING, "size": 64})
        empty = await client.execute("ringbuf-read", {"device": AGENT_RING, "size": 64})
        self.assertEqual((first, rest, empty), ("ab", "cdef", ""))

    @_async
    async def test_overflowKeepsNewestBytesAndLeavesAFragment(self) -> None:
        client = await self.start(ring_size=16)
        await client.execute(
            "ringbuf-write", {"device": AGENT_RING, "data": "CONNECT 2:1234567\n"}
        )
        chunk = await client.execute(
            "ringbuf-read", {"device": AGENT_RING, "size": 16, "format": "base64"}
        )
        data = base64.b64decode(chunk)
        self.assertEqual(data, b"NNECT 2:1234567\n")
        self.assertEqual(
            RingBufferReader().feed(data, buffer_size=16),
            [DiscardedFragment(b"NNECT 2:1234567\n")],
        )

    @_async
    async def test_base64RoundTripKeepsEveryByte(self) -> None:
        client = await self.start(ring_size=64)
        payload = bytes([0, 1, 0xFF, 0xFE]) + b"STARTED\n"
        await client.execute(
            "ringbuf-write",
            {"device": AGENT_RING, "data": base64.b64encode(payload).decode(), "format": "base64"},
        )
        chunk = await client.execute(
            "ringbuf-read", {"device": AGENT_RING, "size": 64, "format": "base64"}
        )
        self.assertEqual(base64.b64decode(chunk), payload)

    @_async
    async def test_invalidBase64IsRefused(self) -> None:
        client = await self.start()
        with self.assertRaises(QMPError) as caught:
            await client.execute(
                "ringbuf-write", {"device": AGENT_RING, "data": "!!!", "format": "base64"}
            )
        self.assertEqual(caught.exception.desc, "Base64 data contains invalid characters")

    @_async
    async def test_utf8ReadReplacesInvalidBytesAndStopsAtNul(self) -> None:
        client = await self.start(ring_size=64)
        await client.execute(
            "ringbuf-write",
            {
                "device": AGENT_RING,
                "data": base64.b64encode(b"\xffa\x00b").decode(),
                "format": "base64",
            },
        )
        self.assertEqual(
            await client.execute("ringbuf-read", {"device": AGENT_RING, "size": 64}), "\ufffda"
        )
        self.assertEqual(
            await client.execute("ringbuf-read", {"device": AGENT_RING, "size": 64}), ""
        )

    @_async
    async def test_sizeMustBePositive(self) -> None:
        client = await self.start()
        for size in (0, -5):
            with self.assertRaises(QMPError) as caught:
                await client.execute("ringbuf-read", {"device": AGENT_RING, "size": size})
            self.assertEqual(caught.exception.desc, "size must be greater than zero")

    @_async
    async def test_unknownDeviceIsNamed(self) -> None:
        client = await self.start()
        for command, arguments in (
            ("ringbuf-read", {"device": "nope", "size": 4}),
            ("ringbuf-write", {"device": "nope", "data": "x"}),
        ):
            with self.assertRaises(QMPError) as caught:
                await client.execute(command, arguments)
            self.assertEqual(
                (caught.exception.error_class, caught.exception.desc),
                ("GenericError", "Device 'nope' not found"),
            )
        with self.assertRaises(QMPError) as caught:
            await client.execute("ringbuf-read", {"device": "compat_monitor0", "size": 4})
        self.assertEqual(caught.exception.desc, "compat_monitor0 is not a ringbuf device")

    @_async
    async def test_hostWritesAreReadBackAsEchoes(self) -> None:
        client = await self.start(ring_size=64)
        await client.execute("ringbuf-write", {"device": AGENT_RING, "data": "STARTED\n"})
        await client.execute("ringbuf-write", {"device": AGENT_RING, "data": "CONNECT 2:49152\n"})
        chunk = await client.execute(
            "ringbuf-read", {"device": AGENT_RING, "size": 64, "format": "base64"}
        )
        reader = RingBufferReader()
        records = reader.feed(base64.b64decode(chunk), buffer_size=64)
        self.assertEqual(records[-1], HostEcho(2, 49152))
        self.assertIsInstance(records[0], StatusLine)


class SocketChardevChecks(BackendTestCase):
    """A ``socket`` chardev wired to a port: how the host writes to a guest (CONNECT)."""

    async def start_with_socket(self) -> tuple[QMPClientProtocol, str]:
        connect = self.workspace.file("connect.sock")
        client = await self.start(
            "-chardev",
            f"socket,id=vmready-connect,path={connect},server=on,wait=off",
            "-device",
            "virtserialport,chardev=vmready-connect,name=vmready.connect,bus=vs0.0,"
            "id=vmready.connect",
        )
        return client, connect

    async def socket_chardev(self, client: QMPClientProtocol) -> dict[str, Any]:
        chardevs = await client.execute("query-chardev")
        found: dict[str, Any] = next(c for c in chardevs if c["label"] == "vmready-connect")
        return found

    @_async
    async def test_queryChardevShowsTheClient(self) -> None:
        client, connect = await self.start_with_socket()
        alone = await self.socket_chardev(client)
        host = GuestEnd()
        await connectProtocol(UNIXClientEndpoint(reactor, connect), host)
        self.addCleanup(host.hang_up)
        served = alone
        for _ in range(600):  # QEMU accepts in its main loop: poll, bounded
            served = await self.socket_chardev(client)
            if not served["filename"].startswith("disconnected:"):
                break
            await deferLater(reactor, 0.05, lambda: None)
        self.assertEqual(
            (alone, served["filename"]),
            (
                {
                    "frontend-open": False,
                    "filename": f"disconnected:unix:{connect},server=on",
                    "label": "vmready-connect",
                },
                f"unix:{connect},server=on",
            ),
        )

    @_async
    async def test_ringbufCommandsRefuseIt(self) -> None:
        client, _ = await self.start_with_socket()
        descriptions = []
        for command, arguments in (
            ("ringbuf-read", {"size": 8}),
            ("ringbuf-write", {"data": "x"}),
        ):
            with self.assertRaises(QMPError) as caught:
                await client.execute(command, {"device": "vmready-connect", **arguments})
            descriptions.append(caught.exception.desc)
        self.assertEqual(descriptions, ["vmready-connect is not a ringbuf device"] * 2)


class CommandLineChecks(BackendTestCase):
    """Refusals of the command line: same text, exit status 1."""

    def _refusal(self, *args: str, accel: str | None = None) -> list[str]:
        result = run_foreground(self.backend, [*base_arguments(accel=accel), *args])
        self.assertEqual(result.returncode, 1, result.stderr)
        return result.messages

    def test_ringOfNonPowerOfTwoSizeRefusesToStart(self) -> None:
        self.assertEqual(
            self._refusal("-chardev", "ringbuf,id=r0,size=1000"),
            ["-chardev ringbuf,id=r0,size=1000: size of ringbuf chardev must be power of two"],
        )

    def test_unknownOptionRefused(self) -> None:
        self.assertEqual(self._refusal("-frobnicate"), ["-frobnicate: invalid option"])

    def test_unknownAcceleratorRefused(self) -> None:
        self.assertEqual(self._refusal(accel="bogus"), ["-accel bogus: invalid accelerator bogus"])

    def test_portWithoutBusRefused(self) -> None:
        self.assertEqual(
            self._refusal("-device", "virtserialport,name=x"),
            [
                "-device virtserialport,name=x: "
                "No 'virtio-serial-bus' bus found for device 'virtserialport'"
            ],
        )

    def test_chardevUsedTwiceRefused(self) -> None:
        self.assertEqual(
            self._refusal(
                "-device",
                "virtio-serial-pci",
                "-chardev",
                "ringbuf,id=r,size=16",
                "-device",
                "virtserialport,chardev=r,name=a",
                "-device",
                "virtserialport,chardev=r,name=b",
            ),
            [
                "-device virtserialport,chardev=r,name=b: Property 'virtserialport.chardev' "
                "can't take value 'r': Device 'r' is in use"
            ],
        )

    def test_duplicatePortNameRefused(self) -> None:
        self.assertEqual(
            self._refusal(
                "-device",
                "virtio-serial-pci",
                "-device",
                f"virtserialport,name={AGENT_PORT}",
                "-device",
                f"virtserialport,name={AGENT_PORT}",
            ),
            [
                f"-device virtserialport,name={AGENT_PORT}: "
                f"virtio-serial-bus: A port already exists by name {AGENT_PORT}"
            ],
        )

    def test_fileMigrationURIUnknownToQEMU72(self) -> None:
        self.assertEqual(
            self._refusal("-incoming", "file:/tmp/x"),
            ["-incoming file:/tmp/x: unknown migration protocol: file:/tmp/x"],
        )

    def test_garbageStateFileIsNotAMigrationStream(self) -> None:
        garbage = self.workspace.file("garbage.state")
        with open(garbage, "w") as f:
            f.write("hello\n")
        self.assertEqual(
            self._refusal("-incoming", f"exec:cat {garbage}"),
            ["Not a migration stream", "load of migration failed: Invalid argument"],
        )


class LogfileChecks(BackendTestCase):
    """``-D FILE``: where QEMU's messages go, and what the file holds.

    QEMU opens FILE after its option loop, truncating it; with ``-daemonize``
    FILE then takes stderr's place, so whatever QEMU reports from there on --
    before or after the launch returns -- lands in FILE and not on the caller's
    stderr.  Errors of the option loop itself stay on stderr.

    These VMs run on tcg: under kvm, QEMU also logs warnings about CPU features
    the host lacks ("host doesn't support requested feature: ..."), which
    depend on the host and which fakeqemu does not invent.
    """

    LOG = "vm.log"
    EARLIER = "a line from an earlier run\n"

    def setUp(self) -> None:
        super().setUp()
        self.log = self.workspace.write(self.LOG, self.EARLIER)

    def logged(self) -> str | None:
        """What the log file holds now (None: there is none)."""
        return self.workspace.read(self.LOG)

    def machine(self, accel: str = "tcg") -> list[str]:
        """The standard machine, on tcg unless told otherwise."""
        return base_arguments(accel=accel)

    def launch(self, *args: str, accel: str = "tcg") -> tuple[int, str]:
        """A daemonizing launch of the standard machine plus ``args``, logging to the file."""
        result = run_foreground(
            self.backend,
            [
                *self.machine(accel),
                *args,
                "-daemonize",
                "-pidfile",
                self.workspace.file("vm.pid"),
                "-D",
                self.log,
            ],
        )
        pid = self.workspace.read("vm.pid")
        if pid:
            self.workspace.pids.append(int(pid))
        return result.returncode, result.stderr

    def test_daemonizedChardevErrorGoesOnlyToTheLogfile(self) -> None:
        self.assertEqual(
            (self.launch("-chardev", "ringbuf,id=r0,size=1000"), self.logged()),
            (
                (1, ""),
                qemu_text(
                    self.backend,
                    "-chardev ringbuf,id=r0,size=1000: "
                    "size of ringbuf chardev must be power of two",
                ),
            ),
        )

    def test_daemonizedUnsupportedMachineGoesOnlyToTheLogfile(self) -> None:
        self.assertEqual(
            (self.launch("-machine", "pc-q35-2.0"), self.logged()),
            (
                (1, ""),
                qemu_text(
                    self.backend,
                    "unsupported machine type\nUse -machine help to list supported machines",
                ),
            ),
        )

    def test_daemonizedDeviceErrorGoesOnlyToTheLogfile(self) -> None:
        self.assertEqual(
            (self.launch("-device", "virtserialport,name=x"), self.logged()),
            (
                (1, ""),
                qemu_text(
                    self.backend,
                    "-device virtserialport,name=x: "
                    "No 'virtio-serial-bus' bus found for device 'virtserialport'",
                ),
            ),
        )

    def test_daemonizedPidfileErrorGoesOnlyToTheLogfile(self) -> None:
        pidfile = self.workspace.file("no-such-directory/vm.pid")
        result = run_foreground(
            self.backend, [*self.machine(), "-daemonize", "-pidfile", pidfile, "-D", self.log]
        )
        self.assertEqual(
            (result.returncode, result.stderr, self.logged()),
            (
                1,
                "",
                qemu_text(
                    self.backend,
                    f"cannot create PID file: Could not create '{pidfile}': "
                    "No such file or directory",
                ),
            ),
        )

    def test_optionLoopErrorsStayOnStderrAndLeaveTheLogfileAlone(self) -> None:
        refusals = [self.launch("-bogus"), self.launch("-chardev", "ringbuf,id=r0,foo=1")]
        self.assertEqual(
            ([(status, strip_program(stderr)) for status, stderr in refusals], self.logged()),
            (
                [
                    (1, ["-bogus: invalid option"]),
                    (1, ["-chardev ringbuf,id=r0,foo=1: Invalid parameter 'foo'"]),
                ],
                self.EARLIER,
            ),
        )

    def test_unopenableLogfileIsRefusedOnStderr(self) -> None:
        missing = self.workspace.file("no-such-directory/vm.log")
        result = run_foreground(self.backend, [*self.machine(), "-daemonize", "-D", missing])
        self.assertEqual(
            (result.returncode, result.stderr),
            (
                1,
                qemu_text(
                    self.backend, f"Error opening logfile {missing}: No such file or directory"
                ),
            ),
        )

    def test_lastLogfileWins(self) -> None:
        other = self.workspace.write("other.log", self.EARLIER)
        result = run_foreground(
            self.backend,
            [*self.machine(), "-machine", "nope", "-daemonize", "-D", other, "-D", self.log],
        )
        self.assertEqual(
            (result.returncode, result.stderr, self.workspace.read("other.log")),
            (1, "", self.EARLIER),
        )
        self.assertEqual(
            strip_program(self.logged() or ""),
            ["unsupported machine type", "Use -machine help to list supported machines"],
        )

    def test_withoutDaemonizeErrorsGoToStderrAndTheLogfileIsEmptied(self) -> None:
        result = run_foreground(
            self.backend,
            [*self.machine(), "-chardev", "ringbuf,id=r0,size=1000", "-D", self.log],
        )
        self.assertEqual(
            (result.returncode, result.stderr, self.logged()),
            (
                1,
                qemu_text(
                    self.backend,
                    "-chardev ringbuf,id=r0,size=1000: "
                    "size of ringbuf chardev must be power of two",
                ),
                "",
            ),
        )

    def test_daemonizedWarningsAndFallbackGoToTheLogfile(self) -> None:
        status = self.launch("-smp", "0", "-accel", "tcg", accel="bogus")
        self.assertEqual(
            (status, self.logged()),
            (
                (0, ""),
                qemu_text(
                    self.backend,
                    "warning: Deprecated CPU topology (considered invalid): "
                    "CPU topology parameters must be greater than zero",
                    "-accel bogus: invalid accelerator bogus",
                    "falling back to tcg",
                ),
            ),
        )

    @_async
    async def test_successfulStartAndQuitLeaveTheLogfileEmpty(self) -> None:
        socket_path = start_daemonized(
            self.backend, self.workspace, [*self.machine(), *serial_devices(), "-D", self.log]
        )
        after_start = self.logged()
        client = await monitor(socket_path)
        await client.execute("quit")
        await client.when_closed()
        pidfile = socket_path + ".pid"
        await _poll_until(lambda: not os.path.exists(pidfile), "the VM to exit")
        self.assertEqual((after_start, self.logged()), ("", ""))

    @_async
    async def test_sigtermLineOfADaemonLandsInTheLogfile(self) -> None:
        socket_path = start_daemonized(
            self.backend, self.workspace, [*self.machine(), *serial_devices(), "-D", self.log]
        )
        os.kill(self.workspace.pids[-1], signal.SIGTERM)
        pidfile = socket_path + ".pid"
        await _poll_until(lambda: not os.path.exists(pidfile), "the VM to exit")
        # QEMU names the sender ("from pid N (name)") when it knows it; fakeqemu cannot.
        self.assertRegex(
            self.logged() or "",
            rf"\A{re.escape(self.backend.message_prefix)}: terminating on signal 15"
            r"( from pid \d+ \(.*\))?\n\Z",
        )

    @_async
    async def test_missingIncomingStreamComplaintGoesToTheLogfile(self) -> None:
        missing = self.workspace.file("missing.state")
        result = launch_daemonized(
            self.backend,
            self.workspace,
            [
                *self.machine(),
                *serial_devices(),
                "-incoming",
                f"exec:cat {missing}",
                "-D",
                self.log,
            ],
        )
        client = await monitor(self.workspace.file("qmp.sock"))
        self.addCleanup(client.close)
        # cat runs beside QEMU and complains when it gets to it: wait for the line.
        await _poll_until(lambda: bool(self.logged()), "cat's complaint in the log file")
        self.assertEqual(
            (
                result.returncode,
                result.stderr,
                self.logged(),
                (await client.execute("query-status"))["status"],
            ),
            (0, "", f"cat: {missing}: No such file or directory\n", "inmigrate"),
        )


class IncomingWaitChecks(BackendTestCase):
    """An incoming stream that never starts leaves QEMU waiting in inmigrate, not exiting."""

    @_async
    async def test_missingStateFileLeavesVMWaitingInInmigrate(self) -> None:
        missing = self.workspace.file("missing.state")
        client = await self.start("-incoming", f"exec:cat {missing}")
        self.assertEqual((await client.execute("query-status"))["status"], "inmigrate")
        self.assertEqual(await client.execute("query-migrate"), {})
        # cont only arms autostart while the stream is awaited.
        self.assertEqual(await client.execute("cont"), {})
        self.assertEqual((await client.execute("query-status"))["status"], "inmigrate")


class MigrationChecks(BackendTestCase):
    """migrate to a file, then restore: same devices resume, a changed device set fails."""

    async def _save(self, *extra: str) -> str:
        client = await self.start(*extra)
        events = EventLog(client)
        state = self.workspace.file("vm.state")
        await client.execute(
            "migrate-set-capabilities", {"capabilities": [{"capability": "events", "state": True}]}
        )
        await client.execute("ringbuf-write", {"device": AGENT_RING, "data": "STARTED\n"})
        await client.execute("migrate", {"uri": f"exec:cat > {state}"})
        await events.wait_for("MIGRATION", status="completed")
        migration = [e.data["status"] for e in events.events if e.name == "MIGRATION"]
        self.assertEqual(migration, ["setup", "active", "completed"])
        self.assertIn("STOP", events.names())
        # QEMU passes through finish-migrate after the completed event.
        self.assertEqual(await _poll_status(client, until="postmigrate"), "postmigrate")
        self.assertEqual((await client.execute("query-migrate"))["status"], "completed")
        with self.assertRaises(QMPError) as caught:
            await client.execute("migrate", {"uri": f"exec:cat > {state}.again"})
        self.assertEqual(
            caught.exception.desc, "Can't migrate the vm that was paused due to previous migration"
        )
        await client.execute("quit")
        await client.when_closed()
        return state

    @_async
    async def test_restoreWithSameDevicesResumes(self) -> None:
        state = await self._save()
        socket_path = start_daemonized(
            self.backend,
            self.workspace,
            [*base_arguments(), *serial_devices(), "-incoming", f"exec:cat {state}"],
            socket_name="restored.sock",
        )
        client = await monitor(socket_path)
        self.addCleanup(client.close)
        status = await _poll_status(client, until="running")
        self.assertEqual(status, "running")
        self.assertEqual(await client.execute("query-migrate"), {"status": "completed"})
        # Chardev backends are not part of QEMU's migration stream.
        self.assertEqual(
            await client.execute("ringbuf-read", {"device": AGENT_RING, "size": 16}), ""
        )

    @_async
    async def test_restoreWithAnExtraPortFailsWithQEMUsLines(self) -> None:
        state = await self._save()
        result = run_foreground(
            self.backend,
            [
                *base_arguments(),
                *serial_devices(ports=((AGENT_PORT, AGENT_RING), (LEGACY_PORT, None))),
                "-incoming",
                f"exec:cat {state}",
            ],
        )
        self.assertEqual(result.returncode, 1)
        self.assertEqual(
            result.messages,
            [
                "Failed to load virtio-console:virtio",
                "error while loading state for instance 0x0 of device "
                "'0000:00:01.0/virtio-console'",
                "load of migration failed: Invalid argument",
            ],
        )

    @_async
    async def test_restoreWithRenamedPortResumes(self) -> None:
        state = await self._save()
        result_socket = start_daemonized(
            self.backend,
            self.workspace,
            [
                *base_arguments(),
                *serial_devices(ports=((LEGACY_PORT, AGENT_RING),)),
                "-incoming",
                f"exec:cat {state}",
            ],
            socket_name="renamed.sock",
        )
        client = await monitor(result_socket)
        self.addCleanup(client.close)
        self.assertEqual(await _poll_status(client, until="running"), "running")

    @_async
    async def test_daemonizedRestoreWithAnExtraPortLogsQEMUsLinesAndExits(self) -> None:
        state = await self._save()
        log = self.workspace.write("vm.log", "a line from an earlier run\n")
        result = launch_daemonized(
            self.backend,
            self.workspace,
            [
                *base_arguments(),
                *serial_devices(ports=((AGENT_PORT, AGENT_RING), (LEGACY_PORT, None))),
                "-incoming",
                f"exec:cat {state}",
                "-D",
                log,
            ],
            socket_name="restored.sock",
        )
        # The launch returns before the stream is loaded: it succeeded, and said nothing.
        self.assertEqual((result.returncode, result.stderr), (0, ""))
        await _monitor_goes_away(self, self.workspace.file("restored.sock"))
        expected = qemu_text(
            self.backend,
            "Failed to load virtio-console:virtio",
            "error while loading state for instance 0x0 of device '0000:00:01.0/virtio-console'",
            "load of migration failed: Invalid argument",
        )
        # Under kvm QEMU also logs warnings about CPU features the host lacks.
        await _poll_until(
            lambda: _without_warnings(self.workspace.read("vm.log")) == expected,
            "QEMU's lines in the log",
        )
        pidfile = self.workspace.file("restored.sock.pid")
        await _poll_until(lambda: not os.path.exists(pidfile), "the VM to exit")

    @_async
    async def test_foregroundRestoreFailureWithALogfileStaysOnStderr(self) -> None:
        state = await self._save()
        log = self.workspace.write("vm.log", "a line from an earlier run\n")
        result = run_foreground(
            self.backend,
            [
                *base_arguments(),
                *serial_devices(ports=((AGENT_PORT, AGENT_RING), (LEGACY_PORT, None))),
                "-incoming",
                f"exec:cat {state}",
                "-D",
                log,
            ],
        )
        self.assertEqual(
            (result.returncode, result.messages, self.workspace.read("vm.log")),
            (
                1,
                [
                    "Failed to load virtio-console:virtio",
                    "error while loading state for instance 0x0 of device "
                    "'0000:00:01.0/virtio-console'",
                    "load of migration failed: Invalid argument",
                ],
                "",
            ),
        )

    @_async
    async def test_restoreWithDifferentMemoryFails(self) -> None:
        state = await self._save()
        arguments = [*base_arguments(), *serial_devices(), "-incoming", f"exec:cat {state}"]
        arguments[arguments.index("-m") + 1] = "128"
        result = run_foreground(self.backend, arguments)
        self.assertEqual(result.returncode, 1)
        self.assertEqual(
            result.messages,
            [
                "Size mismatch: pc.ram: 0x4000000 != 0x8000000: Invalid argument",
                "error while loading state for instance 0x0 of device 'ram'",
                "load of migration failed: Invalid argument",
            ],
        )


def _without_warnings(text: str | None) -> str | None:
    """QEMU's output without its ``warning:`` lines (as ``strip_program`` drops them)."""
    if text is None:
        return None
    return "".join(line for line in text.splitlines(keepends=True) if strip_program(line))


async def _poll_until(condition: Callable[[], bool], description: str) -> None:
    """Poll ``condition`` (bounded) until it holds; fail saying what never happened."""
    for _ in range(int(START_TIMEOUT / 0.05)):
        if condition():
            return
        await deferLater(reactor, 0.05, lambda: None)
    raise AssertionError(f"gave up waiting for {description}")


async def _monitor_goes_away(test: TestCase, socket_path: str) -> None:
    """A monitor whose VM is about to exit: it may still greet, but it goes away.

    Measured on QEMU 7.2: a client connecting just after a daemonized restore
    was launched sometimes gets the greeting (even a reply to
    ``qmp_capabilities``) before the connection drops, sometimes a reset, and
    once the process is gone, a refusal.  None of those is a VM that runs.
    """
    try:
        raw = await raw_monitor(socket_path)
    except ConnectError:
        return
    raw.send(b'{"execute": "qmp_capabilities"}{"execute": "query-status", "id": "status"}')
    await raw.closed.addTimeout(START_TIMEOUT, reactor)
    statuses = [m["return"]["status"] for m in raw.messages if m.get("id") == "status"]
    test.assertIn(statuses, ([], ["inmigrate"]))


async def _poll_status(client: QMPClientProtocol, until: str) -> str:
    """Restores finish asynchronously in QEMU; poll query-status (bounded) until it settles."""
    status = ""
    for _ in range(600):
        status = str((await client.execute("query-status"))["status"])
        if status == until:
            return status
        await deferLater(reactor, 0.05, lambda: None)
    return status


class GuestChecks(BackendTestCase):
    """Checks that need a guest holding the virtio port open.

    Real QEMU can only provide that by booting a guest OS with a virtio-serial
    driver, so these run on fakeqemu only, through its guest sockets.
    """

    def guest_socket(self, name: str) -> str:
        """The socket standing for the guest's /dev/virtio-ports/<name>."""
        return self.workspace.file(f"qmp.sock.guest/virtio-ports/{name}")

    async def open_port(self, name: str) -> GuestEnd:
        """Connect as the guest to the port called ``name``."""
        guest = GuestEnd()
        await connectProtocol(UNIXClientEndpoint(reactor, self.guest_socket(name)), guest)
        self.addCleanup(guest.hang_up)
        return guest

    @_async
    async def test_guestWritesLandInTheRingBuffer(self) -> None:
        client = await self.start(ring_size=64)
        guest = await self.open_port(AGENT_PORT)
        guest.send(b"STARTED\n")
        chunk = await _poll_read(client, lambda data: data != "")
        self.assertEqual(chunk, "STARTED\n")

    @_async
    async def test_hostWritesStayInTheBufferAndNeverReachTheGuest(self) -> None:
        # QEMU's qmp_ringbuf_write only fills the buffer (char-ringbuf.c); a real
        # Debian guest reading /dev/vport*p1 was measured to receive nothing.
        client = await self.start(ring_size=64)
        guest = await self.open_port(AGENT_PORT)
        await _poll_frontend_open(client, True)
        await client.execute("ringbuf-write", {"device": AGENT_RING, "data": "CONNECT 2:49152\n"})
        # The guest answers after the write: once its answer is in the buffer, anything
        # the write had delivered would have reached the guest before it.
        guest.send(b"STARTED\n")
        read = ""
        for _ in range(16):  # bounded: each read is itself bounded
            read += await _poll_read(client, lambda data: data != "")
            if "STARTED" in read:
                break
        self.assertEqual((read, guest.received), ("CONNECT 2:49152\nSTARTED\n", b""))

    @_async
    async def test_aSocketChardevCarriesHostBytesToTheGuest(self) -> None:
        connect = self.workspace.file("connect.sock")
        await self.start(
            "-chardev",
            f"socket,id=vmready-connect,path={connect},server=on,wait=off",
            "-device",
            "virtserialport,chardev=vmready-connect,name=vmready.connect,bus=vs0.0,"
            "id=vmready.connect",
        )
        guest = await self.open_port("vmready.connect")
        host = GuestEnd()
        await connectProtocol(UNIXClientEndpoint(reactor, connect), host)
        self.addCleanup(host.hang_up)
        host.send(b"CONNECT 2:49152\n")
        guest.send(b"ok\n")
        self.assertEqual(
            (await guest.wait_for(b"\n"), await host.wait_for(b"\n")),
            (b"CONNECT 2:49152\n", b"ok\n"),
        )

    @_async
    async def test_frontendOpenFollowsTheGuest(self) -> None:
        client = await self.start()
        self.assertFalse(await _frontend_open(client))
        guest = await self.open_port(AGENT_PORT)
        self.assertTrue(await _poll_frontend_open(client, True))
        guest.hang_up()
        self.assertFalse(await _poll_frontend_open(client, False))

    @_async
    async def test_portWithoutChardevDiscardsWrites(self) -> None:
        client = await self.start(
            *serial_devices(ports=((LEGACY_PORT, None),))[2:],
            ring_size=64,
        )
        legacy = await self.open_port(LEGACY_PORT)
        legacy.send(b"STARTED\n")
        agent = await self.open_port(AGENT_PORT)
        agent.send(b"CONNECTED\n")
        self.assertEqual(await _poll_read(client, lambda d: d != ""), "CONNECTED\n")


class GuestEnd(Protocol):
    """The guest's side of a port in a conformance check."""

    def __init__(self) -> None:
        self.received = b""
        self._waiting: list[tuple[bytes, Deferred[bytes]]] = []

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        for entry in list(self._waiting):
            marker, waiter = entry
            if marker in self.received:
                self._waiting.remove(entry)
                waiter.callback(self.received)

    def send(self, data: bytes) -> None:
        """Write bytes as the guest."""
        assert self.transport is not None
        self.transport.write(data)

    def hang_up(self) -> None:
        """Close the port."""
        if self.transport is not None:
            self.transport.loseConnection()

    def wait_for(self, marker: bytes) -> Deferred[bytes]:
        """Fires with everything received once ``marker`` has arrived."""
        waiter: Deferred[bytes] = Deferred()
        if marker in self.received:
            waiter.callback(self.received)
            return waiter
        self._waiting.append((marker, waiter))
        waiter.addTimeout(30, reactor)
        return waiter


async def _frontend_open(client: QMPClientProtocol) -> bool:
    chardevs = await client.execute("query-chardev")
    return bool(next(c for c in chardevs if c["label"] == AGENT_RING)["frontend-open"])


async def _poll_frontend_open(client: QMPClientProtocol, wanted: bool) -> bool:
    """The guest's connection is asynchronous; poll (bounded) until frontend-open is ``wanted``."""
    state = not wanted
    for _ in range(600):
        state = await _frontend_open(client)
        if state == wanted:
            break
        await deferLater(reactor, 0.05, lambda: None)
    return state


async def _poll_read(client: QMPClientProtocol, done: Callable[[str], bool]) -> str:
    """Read the agent ring (bounded polling) until ``done`` accepts what was read."""
    data = ""
    for _ in range(600):
        data = str(await client.execute("ringbuf-read", {"device": AGENT_RING, "size": 64}))
        if done(data):
            break
        await deferLater(reactor, 0.05, lambda: None)
    return data
