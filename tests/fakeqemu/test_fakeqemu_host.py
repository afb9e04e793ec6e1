"""The multi-VM fakeqemu host: many VMs in one process, launched by QEMU command lines.

Most tests run a ``VMHost`` inside the test process on the real reactor and
launch VMs over its control socket, either directly or through a real
``FAKEQEMU_HOST=... fakeqemu-system-x86_64`` launcher process; a few run the
host itself as a ``fakeqemu-host serve`` process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.error import ConnectError
from twisted.internet.interfaces import IListeningPort, IReactorUNIX
from twisted.internet.threads import deferToThread

from fakeqemu._host import HostControlFactory, HostControlProtocol, VMHost
from fakeqemu._hostclient import HostClient, HostRequestError, HostUnreachable
from tests.fakeqemu.commandlines import RING as AGENT_RING
from tests.fakeqemu.commandlines import qmp_option
from tests.fakeqemu.test_fakeqemu_process import (
    DEADLINE,
    FAKEQEMU_HOST,
    PROGRAM,
    EventRecorder,
    ProcessTestCase,
    RecordedProcess,
    agent_devices,
    deferred_test,
    monitor_closed,
    pause,
    read_file,
    stderr_lines,
    wait_until,
)
from tests.reactor import reactor
from tests.received import Received
from vmready.protocols.qmp import connect_qmp


class ControlClient(Received):
    """The host's control protocol from the test's side: one JSON request per line."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = b""
        self._next_id = 0
        self._pending: dict[int, Deferred[Any]] = {}

    def call(self, command: str, **arguments: Any) -> Deferred[Any]:
        """Send a request; fires with its ``return`` or fails with HostRequestError."""
        self._next_id += 1
        request = {"execute": command, "arguments": arguments, "id": self._next_id}
        reply: Deferred[Any] = Deferred()
        self._pending[self._next_id] = reply
        assert self.transport is not None
        self.transport.write(json.dumps(request).encode() + b"\n")
        return reply

    def dataReceived(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            reply = self._pending.pop(message["id"])
            if "error" in message:
                error = message["error"]
                reply.errback(HostRequestError(error["class"], error["desc"]))
            else:
                reply.callback(message["return"])


class HostTestCase(ProcessTestCase):
    """A helper base: connects control clients and launches VMs on ``self.control``."""

    control: str

    async def control_client(self) -> ControlClient:
        """A new connection to the host's control socket; closed at cleanup."""
        return await self.open_socket(self.control, ControlClient())

    async def launch(self, args: Sequence[str], cwd: str | None = None) -> dict[str, Any]:
        """Launch a VM over the control socket, as a daemonized launcher would."""
        client = await self.control_client()
        launched: dict[str, Any] = await client.call(
            "launch", argv=list(args), cwd=cwd or self.directory, env={}
        )
        return launched

    def launcher(
        self, args: Sequence[str], cwd: str | None = None, control: str | None = None
    ) -> RecordedProcess:
        """``FAKEQEMU_HOST=<control> fakeqemu-system-x86_64 args`` as a real process."""
        return self.spawn(args, env={"FAKEQEMU_HOST": control or self.control}, cwd=cwd)


class InProcessHostTestCase(HostTestCase):
    """A VMHost serving its control socket from inside the test process."""

    def setUp(self) -> None:
        super().setUp()
        self.host = VMHost(reactor)
        self.control = self.path("control")
        port = IReactorUNIX(reactor).listenUNIX(self.control, self.control_factory())
        self.addCleanup(self._stop_host, port)

    def control_factory(self) -> HostControlFactory:
        """What serves the control socket."""
        return HostControlFactory(self.host)

    async def wait_for_migration(self, monitor: Any) -> None:
        """Poll query-migrate until the migration completed."""
        deadline = reactor.seconds() + DEADLINE
        while (await monitor.execute("query-migrate")).get("status") != "completed":
            if reactor.seconds() > deadline:
                raise AssertionError("migration never completed")
            await pause()

    async def save_state(self, state: str) -> None:
        """A hosted VM with the agent's devices saves its state to the file ``state``."""
        source = self.path("source.qmp")
        await self.launch([*agent_devices(), *qmp_option(source)])
        monitor = await self.monitor(source)
        await monitor.execute("migrate", {"uri": f"exec:cat > {state}"})
        await self.wait_for_migration(monitor)

    def _stop_host(self, port: IListeningPort) -> Deferred[None] | None:
        for hosted in list(self.host.vms.values()):
            hosted.vm.kill()
        return port.stopListening()


class HeldReplyProtocol(HostControlProtocol):
    """A control connection whose replies wait until the test releases them."""

    def __init__(self, host: VMHost, release: Deferred[None]) -> None:
        super().__init__(host)
        self._release = release

    def sendLine(self, line: bytes) -> None:
        if self._release.called:
            super().sendLine(line)
        else:
            self._release.addCallback(lambda _: HostControlProtocol.sendLine(self, line))


class HeldReplyFactory(HostControlFactory):
    """Serves HeldReplyProtocol connections."""

    def __init__(self, host: VMHost, release: Deferred[None]) -> None:
        super().__init__(host)
        self.release = release

    def buildProtocol(self, addr: object) -> HeldReplyProtocol:
        return HeldReplyProtocol(self.host, self.release)


class HostControlTests(InProcessHostTestCase):
    """The control socket's requests: launch, list, wait, kill, crash."""

    @deferred_test
    async def test_launchedVMAnswersOnItsMonitor(self) -> None:
        qmp = self.path("qmp")
        launched = await self.launch([*agent_devices(), *qmp_option(qmp)])
        client = await self.monitor(qmp)
        self.assertEqual(
            (launched, await client.execute("query-status")),
            (
                {"vm": "1", "pid": os.getpid(), "guest_dir": qmp + ".guest", "output": ""},
                {"status": "running", "singlestep": False, "running": True},
            ),
        )

    @deferred_test
    async def test_launchRefusesABadCommandLineWithQEMUsMessage(self) -> None:
        failure = await self.failure_of(
            Deferred.fromCoroutine(self.launch(["-bogus"])), HostRequestError
        )
        self.assertEqual(
            (failure.error_class, failure.desc), ("CommandLineError", "-bogus: invalid option")
        )

    @deferred_test
    async def test_launchReportsASocketThatCannotBeBound(self) -> None:
        missing = self.path("no-such-directory/qmp")
        failure = await self.failure_of(
            Deferred.fromCoroutine(self.launch(["-machine", "none", *qmp_option(missing)])),
            HostRequestError,
        )
        self.assertEqual(
            (failure.error_class, failure.desc),
            (
                "StartError",
                f"-qmp unix:{missing},server=on,wait=off: "
                f"Failed to bind socket to {missing}: No such file or directory",
            ),
        )

    @deferred_test
    async def test_listShowsEveryLiveVM(self) -> None:
        first, second = self.path("first"), self.path("second")
        await self.launch(["-name", "first", *agent_devices(), *qmp_option(first)])
        await self.launch(["-machine", "none", "-S", *qmp_option(second)])
        client = await self.control_client()
        self.assertEqual(
            await client.call("list"),
            [
                {
                    "vm": "1",
                    "name": "first",
                    "qmp": [first],
                    "status": "running",
                    "guest_dir": first + ".guest",
                    "attached": False,
                },
                {
                    "vm": "2",
                    "name": None,
                    "qmp": [second],
                    "status": "prelaunch",
                    "guest_dir": second + ".guest",
                    "attached": False,
                },
            ],
        )

    async def ended_by(self, request: str, **arguments: Any) -> tuple[Any, ...]:
        """A VM ended by the control ``request``, its monitor closed; the request's answer,
        what a waiter was told, the monitor's events and what the host then lists."""
        qmp = self.path("qmp")
        launched = await self.launch([*agent_devices(), *qmp_option(qmp)])
        monitor = await self.monitor(qmp)
        events = EventRecorder(monitor)
        waiter = await self.control_client()
        exited = waiter.call("wait", vm=launched["vm"])
        client = await self.control_client()
        answer = await client.call(request, vm=launched["vm"], **arguments)
        await monitor_closed(monitor)
        return answer, await exited, events.names(), await client.call("list")

    @deferred_test
    async def test_killDisconnectsTheMonitorWithoutAnEvent(self) -> None:
        self.assertEqual(
            await self.ended_by("kill"),
            ({}, {"status": -9, "stderr": []}, [], []),
        )

    @deferred_test
    async def test_crashReportsItsMessageToAWaiter(self) -> None:
        _, exited, events, _ = await self.ended_by("crash", message="virtio: zero sized buffers")
        self.assertEqual(
            (exited, events),
            ({"status": -6, "stderr": ["virtio: zero sized buffers"]}, []),
        )

    @deferred_test
    async def test_requestsForAnUnknownVMFail(self) -> None:
        client = await self.control_client()
        failure = await self.failure_of(client.call("kill", vm="42"), HostRequestError)
        self.assertEqual(
            (failure.error_class, failure.desc), ("VMNotFound", "no VM '42' on this host")
        )

    @deferred_test
    async def test_pidfileIsRemovedWhenAHostedVMQuits(self) -> None:
        qmp, pidfile = self.path("qmp"), self.path("vm.pid")
        await self.launch([*agent_devices(), *qmp_option(qmp), "-pidfile", pidfile])
        with open(pidfile) as f:
            self.assertEqual(int(f.read()), os.getpid())
        monitor = await self.monitor(qmp)
        await monitor.execute("quit")
        await monitor_closed(monitor)
        self.assertFalse(os.path.exists(pidfile))

    @deferred_test
    async def test_killedVMLeavesItsPidfile(self) -> None:
        qmp, pidfile = self.path("qmp"), self.path("vm.pid")
        launched = await self.launch([*agent_devices(), *qmp_option(qmp), "-pidfile", pidfile])
        monitor = await self.monitor(qmp)
        client = await self.control_client()
        await client.call("kill", vm=launched["vm"])
        await monitor_closed(monitor)
        self.assertTrue(os.path.exists(pidfile))

    @deferred_test
    async def test_blockingClientTalksToTheHost(self) -> None:
        qmp = self.path("qmp")
        await self.launch(["-name", "blocking", "-machine", "none", *qmp_option(qmp)])

        def list_names() -> list[str]:
            with HostClient(self.control) as client:
                return [vm["name"] for vm in client.call("list")]

        self.assertEqual(await deferToThread(list_names), ["blocking"])

    @deferred_test
    async def test_blockingClientRaisesTheHostsError(self) -> None:
        def unknown_command() -> None:
            with HostClient(self.control) as client:
                client.call("reboot-everything")

        failure = await self.failure_of(deferToThread(unknown_command), HostRequestError)
        self.assertEqual(
            (failure.error_class, failure.desc),
            ("CommandNotFound", "The command reboot-everything has not been found"),
        )

    def test_blockingClientReportsAMissingHost(self) -> None:
        missing = self.path("no-host")
        with self.assertRaises(HostUnreachable) as caught:
            HostClient(missing)
        self.assertEqual(
            str(caught.exception), f"no fakeqemu host at {missing}: No such file or directory"
        )

    @deferred_test
    async def test_manyVMsEachAnswerOnTheirOwnMonitor(self) -> None:
        count = 200
        sockets = [self.path(f"vm{index}.qmp") for index in range(count)]
        control = await self.control_client()
        for index, qmp in enumerate(sockets):
            await control.call(
                "launch",
                cwd=self.directory,
                env={},
                argv=[
                    "-name",
                    f"vm{index}",
                    "-machine",
                    "none",
                    "-chardev",
                    f"ringbuf,id={AGENT_RING},size=64",
                    *qmp_option(qmp),
                ],
            )
        answers: list[tuple[str, str]] = []
        batch = 50  # keeps the open descriptors well under a default limit of 1024
        for start in range(0, count, batch):
            answers += await gatherResults(
                [
                    Deferred.fromCoroutine(self.status_and_own_ring(qmp, f"vm{index}\n"))
                    for index, qmp in enumerate(sockets[start : start + batch], start)
                ]
            )
        self.assertEqual(answers, [("running", f"vm{index}\n") for index in range(count)])

    async def status_and_own_ring(self, qmp: str, mark: str) -> tuple[str, str]:
        """One VM's run state, and what its ring buffer holds after we wrote ``mark``."""
        client = await connect_qmp(reactor, qmp, timeout=DEADLINE)
        try:
            status = await client.execute("query-status")
            await client.execute("ringbuf-write", {"device": AGENT_RING, "data": mark})
            ring = await client.execute("ringbuf-read", {"device": AGENT_RING, "size": 64})
        finally:
            await self._hang_up(client)
        return status["status"], ring


class LauncherTests(InProcessHostTestCase):
    """``FAKEQEMU_HOST=... fakeqemu-system-x86_64`` behaves like the QEMU process it stands for."""

    @deferred_test
    async def test_daemonizedVMOutlivesItsLauncher(self) -> None:
        qmp, pidfile = self.path("qmp"), self.path("vm.pid")
        launcher = self.launcher(
            [*agent_devices(), *qmp_option(qmp), "-daemonize", "-pidfile", pidfile]
        )
        status = await launcher.exit_status()
        self.assertEqual((status, launcher.stdout, launcher.stderr), (0, b"", b""))
        client = await connect_qmp(reactor, qmp, timeout=DEADLINE)
        self.addCleanup(self._hang_up, client)
        self.assertEqual((await client.execute("query-status"))["status"], "running")
        with open(pidfile) as f:
            self.assertEqual(int(f.read()), os.getpid())

    @deferred_test
    async def test_launchFailureIsPrintedAsQEMUPrintsIt(self) -> None:
        missing = self.path("no-such-directory/qmp")
        launcher = self.launcher([*agent_devices(), *qmp_option(missing)])
        status = await launcher.exit_status()
        self.assertEqual(
            (status, launcher.stderr),
            (
                1,
                stderr_lines(
                    f"-qmp unix:{missing},server=on,wait=off: "
                    f"Failed to bind socket to {missing}: No such file or directory"
                ),
            ),
        )

    @deferred_test
    async def test_missingIncomingFileIsReportedAndTheVMWaits(self) -> None:
        qmp, missing = self.path("qmp"), self.path("missing.state")
        launcher = self.launcher(
            [*agent_devices(), *qmp_option(qmp), "-incoming", f"exec:cat {missing}", "-daemonize"]
        )
        status = await launcher.exit_status()
        client = await connect_qmp(reactor, qmp, timeout=DEADLINE)
        self.addCleanup(self._hang_up, client)
        self.assertEqual(
            (status, launcher.stderr, (await client.execute("query-status"))["status"]),
            (0, f"cat: {missing}: No such file or directory\n".encode(), "inmigrate"),
        )

    @deferred_test
    async def test_unreachableHostIsAnError(self) -> None:
        missing = self.path("no-host")
        launcher = self.launcher(["-machine", "none"], control=missing)
        status = await launcher.exit_status()
        self.assertEqual(
            (status, launcher.stderr),
            (1, stderr_lines(f"no fakeqemu host at {missing}: No such file or directory")),
        )

    @deferred_test
    async def test_foregroundLauncherStaysUntilTheVMQuits(self) -> None:
        launcher, client, _ = await self.agent_vm(self.launcher)
        await client.execute("query-status")
        running_while_vm_runs = launcher.status is None
        await client.execute("quit")
        status = await launcher.exit_status()
        self.assertEqual((running_while_vm_runs, status, launcher.stderr), (True, 0, b""))

    @deferred_test
    async def test_foregroundLauncherExitsWithTheVMsStatus(self) -> None:
        launcher, _, _ = await self.agent_vm(self.launcher)
        (vm,) = await (await self.control_client()).call("list")
        await (await self.control_client()).call(
            "crash", vm=vm["vm"], message="virtio: zero sized buffers"
        )
        status = await launcher.exit_status()
        self.assertEqual(
            (status, launcher.stderr), (-6, stderr_lines("virtio: zero sized buffers"))
        )

    @deferred_test
    async def test_foregroundLauncherReportsARefusedRestore(self) -> None:
        state = self.path("vm.state")
        await self.save_state(state)
        launcher = self.launcher(
            [
                *agent_devices(legacy=True),
                *qmp_option(self.path("target.qmp")),
                "-incoming",
                f"exec:cat {state}",
            ]
        )
        status = await launcher.exit_status()
        self.assertEqual(
            (status, launcher.stderr),
            (
                1,
                stderr_lines(
                    "Failed to load virtio-console:virtio",
                    "error while loading state for instance 0x0 of device "
                    "'0000:00:01.0/virtio-console'",
                    "load of migration failed: Invalid argument",
                ),
            ),
        )

    @deferred_test
    async def test_sigtermToTheLauncherShutsTheVMDown(self) -> None:
        await self.assertSigtermShutsDown(self.launcher)

    @deferred_test
    async def test_killingTheForegroundLauncherKillsItsVM(self) -> None:
        launcher, client, _ = await self.agent_vm(self.launcher)
        events = EventRecorder(client)
        launcher.send_signal("KILL")
        await monitor_closed(client)
        self.assertEqual(
            (await launcher.exit_status(), events.names(), self.host.list()), (-9, [], [])
        )

    @deferred_test
    async def test_relativePathsResolveAgainstTheLaunchersDirectory(self) -> None:
        workdir = self.path("work")
        os.mkdir(workdir)
        launcher = self.launcher(
            [*agent_devices(), *qmp_option("vm.qmp"), "-daemonize", "-pidfile", "vm.pid"],
            cwd=workdir,
        )
        self.assertEqual(await launcher.exit_status(), 0)
        qmp = os.path.join(workdir, "vm.qmp")
        client = await connect_qmp(reactor, qmp, timeout=DEADLINE)
        self.addCleanup(self._hang_up, client)
        await client.execute("migrate", {"uri": "exec:cat > vm.state"})
        await self.wait_for_migration(client)
        self.assertEqual(
            sorted(os.listdir(workdir)), ["vm.pid", "vm.qmp", "vm.qmp.guest", "vm.state"]
        )
        self.assertTrue(os.path.exists(self.control_socket(qmp)))

    @deferred_test
    async def test_devicePathsAndForwardCommandsFollowTheLauncher(self) -> None:
        workdir = self.path("work")
        os.makedirs(os.path.join(workdir, "drive"))
        launcher = self.spawn(
            [
                *agent_devices(),
                *qmp_option("vm.qmp"),
                "-chardev",
                "file,id=console,path=console.log",
                "-serial",
                "chardev:console",
                "-fsdev",
                "local,id=d,path=drive,security_model=none",
                "-device",
                "virtio-9p-pci,fsdev=d,mount_tag=drive",
                "-netdev",
                "user,id=n,guestfwd=tcp:10.0.2.100:1-cmd:sh -c 'echo $FROM_LAUNCHER'",
                "-device",
                "virtio-net-pci,netdev=n",
                "-daemonize",
                "-pidfile",
                "vm.pid",
            ],
            env={"FAKEQEMU_HOST": self.control, "FROM_LAUNCHER": "launcher's environment"},
            cwd=workdir,
        )
        self.assertEqual(await launcher.exit_status(), 0)
        guest_dir = os.path.join(workdir, "vm.qmp.guest")
        forward = await self.open_socket(
            os.path.join(guest_dir, "tcp", "10.0.2.100:1"), Received()
        )
        await forward.closed
        self.assertEqual(
            (
                os.path.exists(os.path.join(workdir, "console.log")),
                os.readlink(os.path.join(guest_dir, "9p", "drive")),
                forward.received,
            ),
            (True, os.path.join(workdir, "drive"), b"launcher's environment\n"),
        )

    @deferred_test
    async def test_relativeIncomingPathResolvesAgainstTheLaunchersDirectory(self) -> None:
        workdir = self.path("work")
        os.mkdir(workdir)
        await self.save_state(f"{workdir}/vm.state")
        launcher = self.launcher(
            [*agent_devices(), *qmp_option("target.qmp"), "-incoming", "exec:cat vm.state"],
            cwd=workdir,
        )
        client = await self.monitor(os.path.join(workdir, "target.qmp"), launcher)
        status = (await client.execute("query-status"))["status"]
        deadline = reactor.seconds() + DEADLINE
        while status == "inmigrate" and reactor.seconds() < deadline:
            await pause()
            status = (await client.execute("query-status"))["status"]
        self.assertEqual(status, "running")


class LauncherLogfileTests(InProcessHostTestCase):
    """``-D FILE`` on a hosted VM: the launcher opens FILE as QEMU would; the host adds to it."""

    async def wait_for_log(self, path: str, expected: bytes) -> None:
        """Poll until the log file holds exactly ``expected``."""
        await wait_until(lambda: read_file(path) == expected, f"{expected!r} in {path}")

    @deferred_test
    async def test_daemonizedLateErrorGoesOnlyToTheLogfile(self) -> None:
        log = self.log_path()
        launcher = self.launcher(
            ["-machine", "none", "-chardev", "ringbuf,id=r,size=3", "-daemonize", "-D", log]
        )
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr, read_file(log), self.host.list()),
            (
                1,
                b"",
                stderr_lines(
                    "-chardev ringbuf,id=r,size=3: size of ringbuf chardev must be power of two"
                ),
                [],
            ),
        )

    @deferred_test
    async def test_optionLoopErrorStaysOnStderr(self) -> None:
        log = self.log_path()
        launcher = self.launcher(["-daemonize", "-D", log, "-bogus"])
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr, read_file(log)),
            (1, stderr_lines("-bogus: invalid option"), b"an earlier run\n"),
        )

    @deferred_test
    async def test_unopenableLogfileIsRefusedOnStderr(self) -> None:
        log = self.path("no-such-directory/vm.log")
        launcher = self.launcher(["-machine", "none", "-daemonize", "-D", log])
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr),
            (1, stderr_lines(f"Error opening logfile {log}: No such file or directory")),
        )

    @deferred_test
    async def test_startErrorOfADaemonizedVMGoesToTheLogfile(self) -> None:
        await self.assertStartErrorLogged(self.launcher)

    @deferred_test
    async def test_exitLinesOfADaemonizedVMGoToItsLogfile(self) -> None:
        qmp, log = self.path("qmp"), self.log_path()
        launcher = self.launcher([*agent_devices(), *qmp_option(qmp), "-daemonize", "-D", log])
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr, read_file(log)), (0, b"", b"")
        )
        client = await self.monitor(qmp)
        (vm,) = self.host.list()
        await (await self.control_client()).call("terminate", vm=vm["vm"], signal=15)
        await monitor_closed(client)
        await self.wait_for_log(log, stderr_lines("terminating on signal 15"))

    @deferred_test
    async def test_foregroundVMsExitLinesStayOnTheLaunchersStderr(self) -> None:
        qmp, log = self.path("qmp"), self.log_path()
        launcher = self.launcher([*agent_devices(), *qmp_option(qmp), "-D", log])
        await self.monitor(qmp, launcher)
        launcher.send_signal("TERM")
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr, read_file(log)),
            (0, stderr_lines("terminating on signal 15"), b""),
        )

    @deferred_test
    async def test_daemonizedRefusedRestoreLogsQEMUsLines(self) -> None:
        state = self.path("vm.state")
        await self.save_state(state)
        log = self.log_path()
        launcher = self.launcher(
            [
                *agent_devices(legacy=True),
                *qmp_option(self.path("target.qmp")),
                "-incoming",
                f"exec:cat {state}",
                "-daemonize",
                "-D",
                log,
            ]
        )
        self.assertEqual((await launcher.exit_status(), launcher.stderr), (0, b""))
        await self.wait_for_log(
            log,
            stderr_lines(
                "Failed to load virtio-console:virtio",
                "error while loading state for instance 0x0 of device "
                "'0000:00:01.0/virtio-console'",
                "load of migration failed: Invalid argument",
            ),
        )
        self.assertEqual([vm["qmp"] for vm in self.host.list()], [[self.path("source.qmp")]])

    @deferred_test
    async def test_missingIncomingFileComplaintLandsInTheLogfile(self) -> None:
        qmp, missing, log = self.path("qmp"), self.path("missing.state"), self.log_path()
        launcher = self.launcher(
            [
                *agent_devices(),
                *qmp_option(qmp),
                "-incoming",
                f"exec:cat {missing}",
                "-daemonize",
                "-D",
                log,
            ]
        )
        self.assertEqual(
            (await launcher.exit_status(), launcher.stderr, read_file(log)),
            (0, b"", f"cat: {missing}: No such file or directory\n".encode()),
        )

    @deferred_test
    async def test_relativeLogfileResolvesAgainstTheLaunchersDirectory(self) -> None:
        workdir = self.path("work")
        os.mkdir(workdir)
        log = self.log_path(workdir)
        launcher = self.launcher(
            [*agent_devices(), *qmp_option("vm.qmp"), "-daemonize", "-D", "vm.log"], cwd=workdir
        )
        self.assertEqual(await launcher.exit_status(), 0)
        (vm,) = self.host.list()
        self.host.get(vm["vm"]).vm.crash("virtio: zero sized buffers")
        await self.wait_for_log(log, stderr_lines("virtio: zero sized buffers"))


class HostProcessTests(HostTestCase):
    """``fakeqemu-host --control P serve`` as a real process, and its CLI."""

    def setUp(self) -> Deferred[None]:  # type: ignore[override]  # trial waits for it
        super().setUp()
        self.control = self.path("control")
        self.host_process = self.spawn(
            ["--control", self.control, "serve"], executable=FAKEQEMU_HOST
        )
        return Deferred.fromCoroutine(self.host_ready())

    async def host_ready(self) -> None:
        """Wait until the host process answers on its control socket."""
        deadline = reactor.seconds() + DEADLINE
        while True:
            try:
                client = await self.control_client()
            except ConnectError:
                if self.host_process.status is not None or reactor.seconds() > deadline:
                    raise AssertionError(
                        f"fakeqemu-host never served: {self.host_process.stdout!r}"
                    ) from None
                await pause()
                continue
            await client.call("list")
            return

    async def cli(self, *args: str) -> RecordedProcess:
        """Run ``fakeqemu-host --control P args`` to completion."""
        process = self.spawn(["--control", self.control, *args], executable=FAKEQEMU_HOST)
        await process.exit_status()
        return process

    async def daemonized_vm(self, name: str) -> str:
        """Launch a daemonized VM on the host process; its monitor socket."""
        qmp = self.path(f"{name}.qmp")
        launcher = self.launcher(["-name", name, *agent_devices(), *qmp_option(qmp), "-daemonize"])
        self.assertEqual((await launcher.exit_status(), launcher.stderr), (0, b""))
        return qmp

    @deferred_test
    async def test_vmOutlivesTheProcessThatLaunchedIt(self) -> None:
        qmp, pidfile = self.path("vm.qmp"), self.path("vm.pid")
        launcher = self.launcher(
            [*agent_devices(), *qmp_option(qmp), "-daemonize", "-pidfile", pidfile]
        )
        self.assertEqual(await launcher.exit_status(), 0)
        client = await connect_qmp(reactor, qmp, timeout=DEADLINE)
        self.addCleanup(self._hang_up, client)
        with open(pidfile) as f:
            host_pid = int(f.read())
        self.assertEqual(
            (await client.execute("query-status"), host_pid),
            (
                {"status": "running", "singlestep": False, "running": True},
                self.host_process.pid,
            ),
        )

    @deferred_test
    async def test_listPrintsTheVMsAsJSON(self) -> None:
        qmp = await self.daemonized_vm("listed")
        listing = await self.cli("list")
        self.assertEqual(
            (listing.status, json.loads(listing.stdout)),
            (
                0,
                [
                    {
                        "vm": "1",
                        "name": "listed",
                        "qmp": [qmp],
                        "status": "running",
                        "guest_dir": qmp + ".guest",
                        "attached": False,
                    }
                ],
            ),
        )

    @deferred_test
    async def test_killCommandMakesTheVMVanish(self) -> None:
        qmp = await self.daemonized_vm("victim")
        client = await connect_qmp(reactor, qmp, timeout=DEADLINE)
        events = EventRecorder(client)
        killed = await self.cli("kill", "1")
        await monitor_closed(client)
        again = await self.cli("kill", "1")
        self.assertEqual(
            (killed.status, events.names(), again.status, again.stderr),
            (0, [], 1, b"fakeqemu-host: no VM '1' on this host\n"),
        )

    @deferred_test
    async def test_crashCommandEndsAForegroundLauncherWithAbort(self) -> None:
        qmp = self.path("vm.qmp")
        launcher = self.launcher([*agent_devices(), *qmp_option(qmp)])
        await self.monitor(qmp, launcher)
        crashed = await self.cli("crash", "1", "--message", "virtio: zero sized buffers")
        status = await launcher.exit_status()
        self.assertEqual(
            (crashed.status, status, launcher.stderr),
            (0, -6, f"{PROGRAM}: virtio: zero sized buffers\n".encode()),
        )

    @deferred_test
    async def test_manyLaunchersShareOneHost(self) -> None:
        sockets = [await self.daemonized_vm(f"vm{index}") for index in range(3)]
        statuses = []
        for qmp in sockets:
            client = await connect_qmp(reactor, qmp, timeout=DEADLINE)
            statuses.append((await client.execute("query-status"))["status"])
            await self._hang_up(client)
        listing = await self.cli("list")
        self.assertEqual(
            (statuses, [vm["name"] for vm in json.loads(listing.stdout)]),
            (["running"] * 3, ["vm0", "vm1", "vm2"]),
        )


class EarlySignalTests(InProcessHostTestCase):
    """A signal that reaches a launcher before the host has answered it."""

    def control_factory(self) -> HostControlFactory:
        self.release: Deferred[None] = Deferred()
        return HeldReplyFactory(self.host, self.release)

    @deferred_test
    async def test_sigtermBeforeTheLaunchReplyStillShutsTheVMDown(self) -> None:
        # The VM runs, but its launcher has not heard so: QEMU would already handle SIGTERM.
        launcher, client, _ = await self.agent_vm(self.launcher)
        events = EventRecorder(client)
        launcher.send_signal("TERM")
        self.release.callback(None)
        shutdown = await events.first("SHUTDOWN")
        self.assertEqual(
            (shutdown.data, await launcher.exit_status(), launcher.stderr),
            (
                {"guest": False, "reason": "host-signal"},
                0,
                stderr_lines("terminating on signal 15"),
            ),
        )
