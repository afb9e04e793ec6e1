"""vmready.cli: the real CLI against the operator API on a unix socket, in-process."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import IO, Any

import yaml
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.interfaces import IListeningPort, IReactorProcess, IReactorUNIX
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import deferLater
from twisted.internet.utils import getProcessOutputAndValue
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Site

import vmready
from tests.fixtures import STARTED_UNDER_TCG, TCG_REASON, make_lifecycle
from tests.reactor import reactor
from vmready.api.operator import OperatorAPI
from vmready.cli.main import run
from vmready.cli.output import flatten, to_csv, to_yaml
from vmready.cli.parser import build_parser
from vmready.domain.states import TaskState, VMState
from vmready.hypervisor.cmdline import LEGACY_LAYOUT
from vmready.lifecycle.agenthistory import LinkChange
from vmready.lifecycle.core import Lifecycle
from vmready.protocols.ringbuffer import AgentStatus

_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(vmready.__file__)))
_HINT = "(is it running? start it with: twistd -n vmready)"


class RecordingSite(Site):
    """A Site that remembers every request line and can say when one arrives."""

    def __init__(self, resource: IResource) -> None:
        super().__init__(resource)
        self.requests: list[str] = []
        self.channels: list[Any] = []
        self._waiting: list[tuple[str, Deferred[None]]] = []

    def getResourceFor(self, request: IRequest) -> IResource:
        """Record ``METHOD /uri`` (waking whoever waits for it), then route as usual."""
        line = f"{request.method.decode()} {request.uri.decode()}"
        self.requests.append(line)
        self.channels.append(request.channel)  # type: ignore[attr-defined]
        for entry in list(self._waiting):
            if entry[0] == line:
                self._waiting.remove(entry)
                # Once this turn, in which the request is rendered, is over.
                reactor.callLater(0, entry[1].callback, None)
        resource: IResource = super().getResourceFor(request)
        return resource

    def when_request(self, line: str) -> Deferred[None]:
        """Fires just after ``METHOD /uri`` arrived and was handled."""
        arrived: Deferred[None] = Deferred()
        self._waiting.append((line, arrived))
        return arrived


class _BrokenPipe(io.StringIO):
    """stdout that goes away after ``lines`` writes (like ``| head``)."""

    def __init__(self, lines: int) -> None:
        super().__init__()
        self.lines = lines

    def write(self, text: str) -> int:
        if self.lines <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.lines -= 1
        return super().write(text)


def _envelope(metadata: Any) -> tuple[int, bytes]:
    """A sync answer, as the daemon serialises it (``json.dumps``: surrogates as escapes)."""
    body = {"type": "sync", "status": "Success", "status_code": 200, "metadata": metadata}
    return 200, json.dumps(body).encode()


def _error(code: int, error: str) -> tuple[int, bytes]:
    """An error answer."""
    return code, json.dumps({"type": "error", "error": error, "error_code": code}).encode()


class _CannedAPI(Resource):
    """A daemon answering from a table, ``/uri`` → (HTTP status, body) or None: never answer."""

    isLeaf = True

    def __init__(self, answers: dict[str, tuple[int, bytes] | None]) -> None:
        super().__init__()
        self.answers = answers

    def render(self, request: IRequest) -> bytes | int:
        """The canned answer; 404 for an unknown URI."""
        uri = request.uri.decode()
        answer = self.answers.get(uri, _error(404, f"{uri} not found"))
        if answer is None:
            return NOT_DONE_YET
        request.setResponseCode(answer[0])
        request.setHeader(b"Content-Type", b"application/json")
        return answer[1]


class _ConsoleProcess(ProcessProtocol):
    """``python -m vmready.cli.main …`` as a child process: its output and its exit status."""

    def __init__(self) -> None:
        self.out = b""
        self.err = b""
        self.ended: Deferred[int | None] = Deferred()
        self.first_line: Deferred[None] = Deferred()

    def outReceived(self, data: bytes) -> None:
        """Keep stdout; the first complete line fires ``first_line``."""
        self.out += data
        if b"\n" in self.out and not self.first_line.called:
            self.first_line.callback(None)

    def errReceived(self, data: bytes) -> None:
        """Keep stderr."""
        self.err += data

    def signal(self, name: str) -> None:
        """Send the signal ``name`` (``"INT"``, ``"TERM"``)."""
        assert self.transport is not None
        self.transport.signalProcess(name)

    def processEnded(self, reason: Failure) -> None:
        """Fires ``ended`` with the exit status (None if a signal killed it)."""
        assert isinstance(reason.value, ProcessDone | ProcessTerminated)
        self.ended.callback(reason.value.exitCode)


class UnixAPITestCase(TestCase):
    """A test API served on a temporary unix socket, and the CLI pointed at it."""

    timeout = 60

    def serve(self, resource: IResource) -> None:
        """Listen with ``resource`` on ``self.socket``, recording requests in ``self.site``."""
        self.dir = tempfile.mkdtemp(prefix="vmr-cli-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.socket = os.path.join(self.dir, "vmready.sock")
        self.site = RecordingSite(resource)
        # Site is a ServerFactory of its own channel type; listenUNIX's stub wants Factory[Any].
        site: Any = self.site
        self.port: IListeningPort = IReactorUNIX(reactor).listenUNIX(self.socket, site)
        self.addCleanup(self._close)

    async def _close(self) -> None:
        stopped = self.port.stopListening()
        if stopped is not None:
            await stopped
        for channel in self.site.channels:
            if channel.transport is not None and channel.connected:
                channel.transport.abortConnection()
        await deferLater(reactor, 0, lambda: None)

    async def cli(self, *argv: str, out: io.StringIO | None = None) -> tuple[int, str, str]:
        """Run ``vmready --socket <socket> argv…``; exit status, stdout, stderr."""
        stdout = io.StringIO() if out is None else out
        stderr = io.StringIO()
        code = await run(reactor, ["--socket", self.socket, *argv], stdout, stderr)
        return code, stdout.getvalue(), stderr.getvalue()

    def background(self, *argv: str, out: io.StringIO | None = None) -> Deferred[Any]:
        """The same, started now and finished later."""
        return Deferred.fromCoroutine(self.cli(*argv, out=out))

    def console(self, *argv: str) -> _ConsoleProcess:
        """``python -m vmready.cli.main --socket <socket> argv…`` started as a child process."""
        child = _ConsoleProcess()
        process = IReactorProcess(reactor).spawnProcess(
            child,
            sys.executable,
            [sys.executable, "-m", "vmready.cli.main", "--socket", self.socket, *argv],
            env={**os.environ, "PYTHONPATH": _SOURCE_ROOT},
            path=_SOURCE_ROOT,
        )

        async def reap() -> None:
            if not child.ended.called:
                process.signalProcess("KILL")
                await child.ended

        self.addCleanup(reap)
        return child

    def drop_connections(self) -> None:
        """What ``kill -9`` of the daemon does to its clients' connections."""
        for channel in self.site.channels:
            if channel.transport is not None:
                channel.transport.abortConnection()


class CLITestCase(UnixAPITestCase):
    """The operator API over a real Lifecycle, listening on a temporary unix socket."""

    def setUp(self) -> None:
        self.lifecycle: Lifecycle = make_lifecycle(self)
        self.serve(OperatorAPI(self.lifecycle, "fakeqemu").app.resource())

    async def launch(self, name: str = "web1", *options: str) -> None:
        """``vmready launch``, which must succeed."""
        code, out, err = await self.cli("launch", name, *options)
        self.assertEqual((code, err), (0, ""), out)

    def declare_ready(self, name: str = "web1") -> None:
        """What the guest API does when the workload says Ready."""
        self.successResultOf(
            Deferred.fromCoroutine(self.lifecycle.guestside.set_ready(name, True))
        )

    def agent_says(self, status: AgentStatus, name: str = "web1") -> None:
        """What the daemon's agent monitor does when the agent's status line changes."""
        self.patch(self.lifecycle.running, "agent_status", lambda _name: status)
        self.lifecycle.events.lifecycle(
            f"instance-agent-{status.value}", name, {"status": status.value}
        )


class ListAndInfoTests(CLITestCase):
    """``list`` and ``info`` in every format."""

    async def test_listTable(self) -> None:
        await self.launch("web1")
        await self.launch("db", "--memory", "512", "--cpus", "2")
        code, out, _ = await self.cli("list")
        self.assertEqual(code, 0)
        self.assertEqual(
            out,
            "NAME  STATUS   MEMORY  CPUS\ndb    RUNNING  512MiB  2\nweb1  RUNNING  256MiB  1\n",
        )

    async def test_listShowsStoppedAndReadyUpperCase(self) -> None:
        await self.launch("web1")
        await self.launch("web2")
        self.assertEqual((await self.cli("stop", "web2", "--force"))[0], 0)
        self.declare_ready("web1")
        _, out, _ = await self.cli("list", "-c", "nsdtr")
        self.assertEqual(
            out,
            "NAME  STATUS   DISPLAY  TASK  READY\n"
            "web1  READY    ACTIVE   -     yes\n"
            "web2  STOPPED  SHUTOFF  -     no\n",
        )

    async def test_listEmptyIsJustTheHeader(self) -> None:
        self.assertEqual(await self.cli("list"), (0, "NAME  STATUS  MEMORY  CPUS\n", ""))

    async def test_listShowsTheTaskInProgressAsTheStatus(self) -> None:
        await self.launch("web1")
        code, out, _ = await self.cli("stop", "web1", "--no-wait")
        self.assertEqual(code, 0, out)
        _, out, _ = await self.cli("list", "--columns", "name,status,lxd_status,task_state")
        self.assertEqual(
            out, "NAME  STATUS    LXD       TASK\nweb1  STOPPING  STOPPING  powering-off\n"
        )
        for operation in self.lifecycle.operations.list():
            await operation.when_done()
        _, out, _ = await self.cli("list", "-c", "ns")
        self.assertEqual(out, "NAME  STATUS\nweb1  STOPPED\n")

    async def test_listResizedAwaitsConfirmation(self) -> None:
        await self.launch("web1")
        self.assertEqual((await self.cli("resize", "web1", "--memory", "512"))[0], 0)
        _, out, _ = await self.cli("list", "-c", "nslmvp")
        self.assertEqual(
            out,
            "NAME  STATUS   LXD      MEMORY  VM       POWER\n"
            "web1  RESIZED  RUNNING  512MiB  resized  running\n",
        )

    async def test_everyColumnByLetterAndByName(self) -> None:
        await self.launch("web1")
        _, by_letter, _ = await self.cli("list", "-c", "nsmcraldvtpue")
        _, by_name, _ = await self.cli(
            "list",
            "-c",
            "name,status,memory,cpus,ready,agent,lxd_status,display_status,vm_state,"
            "task_state,power_state,uuid,error",
        )
        self.assertEqual(by_letter, by_name)
        header, row = by_letter.splitlines()
        self.assertEqual(
            header.split(),
            [
                "NAME", "STATUS", "MEMORY", "CPUS", "READY", "AGENT", "LXD", "DISPLAY", "VM",
                "TASK", "POWER", "UUID", "ERROR",
            ],
        )  # fmt: skip
        uuid = self.lifecycle.store.view.get_instance("web1").uuid
        self.assertEqual(
            row.split(),
            [
                "web1", "RUNNING", "256MiB", "1", "no", "unknown", "RUNNING", "ACTIVE",
                "active", "-", "running", uuid, "-",
            ],
        )  # fmt: skip

    async def test_aColumnNameAloneIsThatColumn(self) -> None:
        await self.launch("web1")
        self.assertEqual(await self.cli("list", "-c", "name"), (0, "NAME\nweb1\n", ""))
        self.assertEqual(await self.cli("list", "-c", "name,"), (0, "NAME\nweb1\n", ""))

    async def test_unknownColumnIsAUsageErrorNamingIt(self) -> None:
        code, out, err = await self.cli("list", "-c", "nsx")
        self.assertEqual((code, out), (2, ""))
        self.assertTrue(err.startswith("usage: vmready list"), err)
        self.assertIn(
            "vmready: error: argument -c/--columns: unknown column letter 'x' in 'nsx' "
            "(columns: n name, s status, m memory, c cpus, r ready,",
            err,
        )
        code, _, err = await self.cli("list", "--columns", "name,colour")
        self.assertEqual(code, 2)
        self.assertIn("argument -c/--columns: unknown column 'colour' (columns: n name,", err)
        code, _, err = await self.cli("list", "-c", ",")
        self.assertEqual(code, 2)
        self.assertIn("argument -c/--columns: no columns given", err)

    async def test_listCSVHasTheTableColumns(self) -> None:
        await self.launch("web1")
        await self.launch("db", "--memory", "512", "--cpus", "2")
        self.assertEqual(
            await self.cli("list", "--format", "csv"),
            (0, "NAME,STATUS,MEMORY,CPUS\ndb,RUNNING,512MiB,2\nweb1,RUNNING,256MiB,1\n", ""),
        )
        code, out, _ = await self.cli("list", "--format", "csv", "-c", "ntpe")
        self.assertEqual((code, out), (0, "NAME,TASK,POWER,ERROR\ndb,,running,\nweb1,,running,\n"))
        self.assertEqual(
            await self.cli("list", "--format", "csv", "-c", "n"), (0, "NAME\ndb\nweb1\n", "")
        )

    async def test_listCSVShowsTheError(self) -> None:
        await self.launch("web1")
        self.patch(self.lifecycle.driver, "program", ["/nonexistent/qemu"])
        await self.cli("rebuild", "web1")
        _, out, _ = await self.cli("list", "--format", "csv", "-c", "name,status,error")
        rows = list(csv.reader(io.StringIO(out)))
        self.assertEqual(rows[0], ["NAME", "STATUS", "ERROR"])
        self.assertEqual(rows[1][:2], ["web1", "ERROR"])
        self.assertIn("'/nonexistent/qemu'", rows[1][2])

    async def test_infoCSVIsTheObjectFlattened(self) -> None:
        await self.launch("web1", "-c", "user.role=web, db")
        code, out, err = await self.cli("info", "web1", "--format", "csv")
        self.assertEqual((code, err), (0, ""))
        header, row = list(csv.reader(io.StringIO(out)))
        cells = dict(zip(header, row, strict=True))
        self.assertEqual(header[:3], ["name", "uuid", "type"])
        self.assertEqual(cells["operator_status"], "RUNNING")
        self.assertEqual(cells["limits.memory_mib"], "256")
        self.assertEqual(cells["config.user.role"], "web, db")
        self.assertEqual(cells["agent.status"], "unknown")
        self.assertEqual(cells["task_state"], "")
        self.assertEqual(cells["faults"], "[]")
        self.assertNotIn("devices", cells)  # an empty object has no column

    async def test_actionsCSVIsOneRowAnActionWithItsStepsAsJSON(self) -> None:
        await self.launch("web1")
        code, out, _ = await self.cli("actions", "web1", "--format", "csv")
        header, row = list(csv.reader(io.StringIO(out)))
        cells = dict(zip(header, row, strict=True))
        self.assertEqual((code, cells["action"], cells["result"]), (0, "create", "success"))
        self.assertEqual([step["name"] for step in json.loads(cells["steps"])], ["spawning"])

    async def test_listJSONIsTheAPIObjects(self) -> None:
        await self.launch("web1")
        code, out, _ = await self.cli("list", "--format", "json")
        self.assertEqual(code, 0)
        instances = json.loads(out)
        self.assertEqual([i["name"] for i in instances], ["web1"])
        self.assertEqual(instances[0]["status"], "Running")
        self.assertEqual(instances[0]["limits"], {"memory_mib": 256, "cpus": 1})

    async def test_formatBeforeTheCommandToo(self) -> None:
        await self.launch("web1")
        code, out, _ = await self.cli("--format", "json", "list")
        self.assertEqual((code, json.loads(out)[0]["name"]), (0, "web1"))

    async def test_listYAMLIsTheSameDataAsJSON(self) -> None:
        await self.launch("web1", "-c", "user.role=web server")
        code, out, err = await self.cli("list", "--format", "yaml")
        self.assertEqual((code, err), (0, ""))
        _, as_json, _ = await self.cli("list", "--format", "json")
        instances = yaml.safe_load(out)
        self.assertEqual(instances, json.loads(as_json))
        # The API's key order, not sorted; block style, one key a line.
        self.assertEqual([list(i) for i in instances], [list(i) for i in json.loads(as_json)])
        self.assertEqual(list(instances[0])[:2], ["name", "uuid"])
        self.assertIn("- name: web1\n", out)
        self.assertIn("  config:\n    user.role: web server\n", out)
        self.assertIn("  task_state: null\n", out)

    async def test_infoTable(self) -> None:
        await self.launch("web1", "-c", "user.role=db")
        code, out, _ = await self.cli("info", "web1")
        self.assertEqual(code, 0)
        lines = out.splitlines()
        self.assertEqual(lines[0], "Name: web1")
        self.assertEqual(
            lines[3:6], ["Status: RUNNING", "LXD status: RUNNING", "Display status: ACTIVE"]
        )
        self.assertIn("Task state: -", lines)
        self.assertIn("Memory: 256MiB", lines)
        self.assertIn("Agent: unknown", lines)
        self.assertIn(
            "Serial layout: current (com.canonical.lxd on the agent ring buffer, "
            "org.linuxcontainers.lxd unwired)",
            lines,
        )
        self.assertIn("Boot source: nothing (no image, no kernel)", lines)
        self.assertIn(f"Accelerator: tcg ({TCG_REASON}); requested auto", lines)
        self.assertIn("Guest API transport: hvsock", lines)
        config = lines[lines.index("Config:") :]
        self.assertEqual(config[:2], ["Config:", "  user.role: db"])
        self.assertIn("  volatile.serial.layout: current", config)

    async def test_infoShowsTheAgentStatusAndListShowsReady(self) -> None:
        await self.launch("web1")
        self.agent_says(AgentStatus.CONNECTED)
        self.declare_ready()
        _, out, _ = await self.cli("info", "web1")
        self.assertIn("Agent: connected", out.splitlines())
        self.assertIn("Status: READY", out.splitlines())
        _, out, _ = await self.cli("list")
        self.assertEqual(out.splitlines()[1].split()[:2], ["web1", "READY"])

    async def test_infoStatusIsTheOneStatus(self) -> None:
        await self.launch("web1")
        await self.cli("resize", "web1", "--cpus", "2")
        _, out, _ = await self.cli("info", "web1")
        self.assertEqual(
            out.splitlines()[3:7],
            [
                "Status: RESIZED",
                "LXD status: RUNNING",
                "Display status: VERIFY_RESIZE",
                "VM state: resized",
            ],
        )

    async def test_infoShowsThePersistedError(self) -> None:
        await self.launch("web1")
        self.patch(self.lifecycle.driver, "program", ["/nonexistent/qemu"])
        await self.cli("rebuild", "web1")
        _, out, _ = await self.cli("info", "web1")
        self.assertIn("Status: ERROR", out.splitlines())
        self.assertIn("Error: cannot start web1: the hypervisor program", out)

    async def test_infoShowsTheFaultsStillStandingWithTheirTimes(self) -> None:
        await self.launch("web1")
        self.patch(self.lifecycle.driver, "program", ["/nonexistent/qemu"])
        await self.cli("rebuild", "web1")
        events = self.lifecycle.events
        events.lifecycle("agent-link-lost", "web1", {"reason": "the port closed"})
        events.server("store-write-failed", {"error": "database or disk is full"})
        _, out, _ = await self.cli("info", "web1")
        lines = out.splitlines()
        stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
        self.assertRegex(lines[-3], rf"^Last error: cannot start web1: .* \(at {stamp}\)$")
        self.assertRegex(lines[-2], rf"^Agent link: lost since {stamp}: the port closed$")
        self.assertRegex(lines[-1], rf"^Store: writes failing since {stamp}: database or disk")
        events.server("store-write-recovered", {})
        _, out, _ = await self.cli("info", "web1")
        self.assertNotIn("Store:", out)

    async def test_infoShowsWhereTheConsoleIsLogged(self) -> None:
        await self.launch("web1")
        _, out, _ = await self.cli("info", "web1")
        path = self.lifecycle.specs.console_log_path(
            self.lifecycle.store.view.get_instance("web1")
        )
        self.assertTrue(os.path.isabs(path), path)
        self.assertIn(
            f"Console log: {path} (vmready console web1 --show-log prints it)", out.splitlines()
        )
        # Right after the boot source lines.
        lines = out.splitlines()
        self.assertEqual(
            lines.index("Guest API transport: hvsock") + 1,
            lines.index(f"Console log: {path} (vmready console web1 --show-log prints it)"),
        )

    async def test_infoListsTheAgentLinksChangesNewestLast(self) -> None:
        await self.launch("web1")
        _, out, _ = await self.cli("info", "web1")
        self.assertIn("Agent link history: (no change since the daemon started)", out.splitlines())
        history = self.lifecycle.agent_history
        history.record("web1", LinkChange("started", 1_800_000_000.0))
        history.record("web1", LinkChange("connected", 1_800_000_001.0))
        lost = "lost: the agent said nothing for 15.0s (no heartbeat)"
        history.record("web1", LinkChange("stopped", 1_800_000_030.0, lost))
        self.lifecycle.events.lifecycle("agent-link-lost", "web1", {"reason": lost[6:]})
        _, out, _ = await self.cli("info", "web1")
        lines = out.splitlines()
        start = lines.index("Agent link history:")
        self.assertEqual(
            lines[start + 1 : start + 4],
            [
                "  2027-01-15 08:00:00  STARTED",
                "  2027-01-15 08:00:01  CONNECTED",
                f"  2027-01-15 08:00:30  STOPPED    {lost}",
            ],
        )
        # The standing fault follows, as before.
        self.assertRegex(lines[start + 4], r"^Agent link: lost since .*: the agent said nothing")
        self.assertEqual(len(lines), start + 5)

    async def test_infoUnknownInstanceExits1(self) -> None:
        self.assertEqual(
            await self.cli("info", "nope"), (1, "", "vmready: Error: Instance nope not found\n")
        )


class MetricsCommandTests(CLITestCase):
    """``vmready metrics`` prints the daemon's scrape as it is."""

    async def test_metricsPrintsThePrometheusText(self) -> None:
        await self.launch("web1")
        self.declare_ready("web1")
        code, out, err = await self.cli("metrics")
        self.assertEqual((code, err), (0, ""))
        self.assertIn("# TYPE vmready_instances gauge\n", out)
        self.assertIn('vmready_instances{status="READY"} 1\n', out)
        self.assertIn('vmready_actions_total{action="create",result="success"} 1\n', out)
        self.assertTrue(out.endswith("\n"))


class ActionCommandTests(CLITestCase):
    """launch, start, stop, restart, freeze, unfreeze, rebuild, resize, delete, actions."""

    async def test_launchSetsMemoryCPUsAndConfig(self) -> None:
        code, out, err = await self.cli(
            "launch", "web1", "--memory", "512", "--cpus", "2", "-c", "user.role=db"
        )
        self.assertEqual((code, out, err), (0, "Creating web1\nweb1: RUNNING\n", ""))
        self.assertEqual(
            self.lifecycle.store.view.get_instance("web1").config,
            {
                "limits.memory": "512",
                "limits.cpu": "2",
                "user.role": "db",
                "volatile.serial.layout": "current",
                **STARTED_UNDER_TCG,
            },
        )

    async def test_launchRejectedByTheDaemonExits1(self) -> None:
        code, _, err = await self.cli("launch", "web1", "-c", "volatile.x=1")
        self.assertEqual(code, 1)
        self.assertTrue(err.startswith("vmready: Error: Invalid config key 'volatile.x'"), err)

    async def test_launchRefusedByTheDaemonPrintsNoProgress(self) -> None:
        code, out, err = await self.cli("launch", "bad name")
        self.assertEqual((code, out), (1, ""))
        self.assertTrue(err.startswith("vmready: Error: Invalid instance name 'bad name'"), err)
        self.assertEqual(err.count("\n"), 1)

    async def test_launchConfigWithoutEqualsIsAUsageError(self) -> None:
        code, _, err = await self.cli("launch", "web1", "-c", "user.role")
        self.assertEqual(code, 2)
        self.assertIn("vmready: error: -c expects key=value, got 'user.role'\n", err)

    async def test_launchWaitReturnsOnceReady(self) -> None:
        reported = self.site.when_request("GET /1.0/instances/web1")
        launching = self.background("launch", "web1", "--wait", "--timeout", "30")
        await reported
        self.assertNoResult(launching)
        self.declare_ready()
        code, out, err = await launching
        self.assertEqual((code, out, err), (0, "Creating web1\nweb1: RUNNING\nweb1: READY\n", ""))

    async def test_everyActionReportsTheResultingStatus(self) -> None:
        await self.launch("web1")
        steps = [
            (["stop", "web1", "--force"], "web1: STOPPED\n"),
            (["start", "web1"], "web1: RUNNING\n"),
            (["restart", "web1", "--force"], "web1: RUNNING\n"),
            (["freeze", "web1"], "web1: FROZEN\n"),
            (["unfreeze", "web1"], "web1: RUNNING\n"),
            (["rebuild", "web1"], "web1: RUNNING\n"),
            (["resize", "web1", "--memory", "512"], "web1: RESIZED\n"),
            (["confirm-resize", "web1"], "web1: RUNNING\n"),
            (["resize", "web1", "--cpus", "2"], "web1: RESIZED\n"),
            (["revert-resize", "web1"], "web1: RUNNING\n"),
        ]
        for argv, expected in steps:
            self.assertEqual(await self.cli(*argv), (0, expected, ""), argv)
        record = self.lifecycle.store.view.get_instance("web1")
        self.assertEqual((record.memory_mib, record.cpus), (512, 1))

    async def test_stopTimeoutIsPassedOn(self) -> None:
        await self.launch("web1")
        self.assertEqual((await self.cli("stop", "web1", "--timeout", "0"))[0], 0)
        history = await self.lifecycle.store.actions.list_actions("web1")
        self.assertIn("forced stop after 0s timeout", [step.name for step in history[0].steps])

    async def test_noWaitReturnsWithTheOperation(self) -> None:
        await self.launch("web1")
        code, out, _ = await self.cli("stop", "web1", "--force", "--no-wait")
        self.assertEqual(code, 0)
        self.assertRegex(out, r"^Operation /1\.0/operations/[0-9a-f-]{36}: Stop instance web1\n$")
        for operation in self.lifecycle.operations.list():
            await operation.when_done()

    async def test_resizeNeedsMemoryOrCPUs(self) -> None:
        code, _, err = await self.cli("resize", "web1")
        self.assertEqual(code, 2)
        self.assertIn("resize needs --memory and/or --cpus", err)

    async def test_conflictExits1WithTheDaemonsWords(self) -> None:
        await self.launch("web1")
        self.assertEqual(
            await self.cli("start", "web1"),
            (
                1,
                "",
                "vmready: Error: Cannot start instance web1: it is running\n",
            ),
        )

    async def test_failedOperationPrintsItsError(self) -> None:
        await self.launch("web1")
        self.patch(self.lifecycle.driver, "program", ["/nonexistent/qemu"])
        code, out, err = await self.cli("rebuild", "web1")
        self.assertEqual((code, out), (1, ""))
        self.assertEqual(
            err,
            "vmready: Error: cannot start web1: the hypervisor program '/nonexistent/qemu' "
            "is not installed\n",
        )

    async def test_deleteRefusesARunningInstanceWithoutForce(self) -> None:
        await self.launch("web1")
        self.assertEqual(
            await self.cli("delete", "web1"),
            (1, "", "vmready: Error: instance web1 is RUNNING: stop it first or pass --force\n"),
        )
        self.assertEqual(await self.cli("delete", "web1", "--force"), (0, "Deleted web1\n", ""))
        self.assertEqual((await self.cli("info", "web1"))[0], 1)

    async def test_actionsInJSONPrintTheOperationAndTheInstanceAfterIt(self) -> None:
        code, out, err = await self.cli("launch", "web1", "--format", "json")
        self.assertEqual((code, err), (0, ""))
        result = json.loads(out)  # nothing but the result: no "Creating web1" line
        self.assertEqual(list(result), ["operation", "instance"])
        self.assertEqual(
            {key: result["operation"][key] for key in ("description", "status", "err")},
            {"description": "Creating instance web1", "status": "Success", "err": ""},
        )
        self.assertEqual(result["instance"]["operator_status"], "RUNNING")
        steps = [
            (["stop", "web1", "--force"], "Stop instance web1", "STOPPED"),
            (["start", "web1"], "Start instance web1", "RUNNING"),
            (["freeze", "web1"], "Freeze instance web1", "FROZEN"),
            (["unfreeze", "web1"], "Unfreeze instance web1", "RUNNING"),
            (["resize", "web1", "--cpus", "2"], "Resize instance web1", "RESIZED"),
            (["confirm-resize", "web1"], "Confirm-resize instance web1", "RUNNING"),
            (["snapshot", "web1", "s1"], "Snapshot instance web1", "RUNNING"),
            (["restore", "web1", "s1"], "Restore instance web1", "RUNNING"),
        ]
        for argv, description, status in steps:
            code, out, err = await self.cli(*argv, "--format", "json")
            self.assertEqual((code, err), (0, ""), argv)
            result = json.loads(out)
            self.assertEqual(
                (
                    result["operation"]["description"],
                    result["operation"]["status_code"],
                    result["instance"]["name"],
                    result["instance"]["operator_status"],
                ),
                (description, 200, "web1", status),
                argv,
            )

    async def test_deleteInYAMLHasNoInstanceAfterIt(self) -> None:
        await self.launch("web1")
        code, out, err = await self.cli("delete", "web1", "--force", "--format", "yaml")
        self.assertEqual((code, err), (0, ""))
        result = yaml.safe_load(out)
        self.assertEqual((result["operation"]["status"], result["instance"]), ("Success", None))

    async def test_noWaitInJSONIsTheOperationAsCreated(self) -> None:
        await self.launch("web1")
        code, out, _ = await self.cli("stop", "web1", "--force", "--no-wait", "--format", "json")
        result = json.loads(out)
        self.assertEqual(code, 0)
        self.assertEqual(result["instance"], None)
        self.assertEqual(result["operation"]["description"], "Stop instance web1")
        self.assertRegex(result["operation"]["id"], r"^[0-9a-f-]{36}$")
        for operation in self.lifecycle.operations.list():
            await operation.when_done()

    async def test_aFailedActionInJSONStillPrintsTheResultAndExits1(self) -> None:
        await self.launch("web1")
        self.patch(self.lifecycle.driver, "program", ["/nonexistent/qemu"])
        code, out, err = await self.cli("rebuild", "web1", "--format", "json")
        self.assertEqual(code, 1)
        self.assertTrue(err.startswith("vmready: Error: cannot start web1: "), err)
        result = json.loads(out)
        self.assertEqual(result["operation"]["status"], "Failure")
        self.assertIn("/nonexistent/qemu", result["operation"]["err"])
        self.assertEqual(result["instance"]["operator_status"], "ERROR")

    async def test_aRefusedActionInJSONPrintsNothing(self) -> None:
        await self.launch("web1")
        self.assertEqual(
            await self.cli("start", "web1", "--format", "json"),
            (1, "", "vmready: Error: Cannot start instance web1: it is running\n"),
        )

    async def test_actionInCSVIsOneFlatRow(self) -> None:
        await self.launch("web1")
        code, out, _ = await self.cli("stop", "web1", "--force", "--format", "csv")
        header, row = list(csv.reader(io.StringIO(out)))
        cells = dict(zip(header, row, strict=True))
        self.assertEqual(code, 0)
        self.assertEqual(cells["operation.status"], "Success")
        self.assertEqual(cells["instance.name"], "web1")
        self.assertEqual(cells["instance.operator_status"], "STOPPED")
        self.assertEqual(cells["instance.limits.cpus"], "1")

    async def test_launchWaitInJSONIsTheInstanceOnceReady(self) -> None:
        reported = self.site.when_request("GET /1.0/instances/web1")
        launching = self.background("launch", "web1", "--wait", "--format", "json")
        await reported
        self.assertNoResult(launching)
        self.declare_ready()
        code, out, err = await launching
        self.assertEqual((code, err), (0, ""))
        self.assertEqual(json.loads(out)["instance"]["operator_status"], "READY")

    async def test_snapshotDeleteInCSV(self) -> None:
        await self.launch("web1")
        await self.cli("snapshot", "web1", "s1")
        code, out, _ = await self.cli("snapshot", "delete", "web1", "s1", "--format", "csv")
        header, row = list(csv.reader(io.StringIO(out)))
        self.assertEqual((code, dict(zip(header, row, strict=True))["name"]), (0, "s1"))

    async def test_actionsTable(self) -> None:
        await self.launch("web1")
        await self.cli("stop", "web1", "--force")
        code, out, _ = await self.cli("actions", "web1")
        self.assertEqual(code, 0)
        lines = out.splitlines()
        self.assertEqual(lines[0].split(), ["ACTION", "RESULT", "STARTED", "FINISHED", "ERROR"])
        self.assertEqual(
            [line.split()[:2] for line in lines[1:]],
            [
                ["stop", "success"],
                ["powering-off", "success"],
                ["forced", "stop"],
                ["create", "success"],
                ["spawning", "success"],
            ],
        )

    async def test_actionsJSON(self) -> None:
        await self.launch("web1")
        code, out, _ = await self.cli("actions", "web1", "--format", "json")
        history = json.loads(out)
        self.assertEqual((code, [a["action"] for a in history]), (0, ["create"]))
        self.assertEqual(history[0]["steps"][0]["name"], "spawning")


class MonitorTests(CLITestCase):
    """``monitor``: live events until stdout or the daemon goes away."""

    async def test_jsonLinesUntilStdoutCloses(self) -> None:
        out = _BrokenPipe(lines=2)
        subscribed = self.site.when_request("GET /1.0/events")
        monitoring = self.background("monitor", "--format", "json", out=out)
        await subscribed
        await self.launch("web1")
        code, printed, err = await monitoring
        self.assertEqual((code, err), (0, ""))
        events = [json.loads(line) for line in printed.splitlines()]
        self.assertEqual(
            [(event["type"], event["metadata"]["action"]) for event in events],
            [("lifecycle", "instance-state"), ("lifecycle", "instance-created")],
        )

    async def test_readableLinesFilteredByType(self) -> None:
        out = _BrokenPipe(lines=2)
        subscribed = self.site.when_request("GET /1.0/events?type=lifecycle")
        monitoring = self.background("monitor", "--type", "lifecycle", out=out)
        await subscribed
        await self.launch("web1")
        code, printed, _ = await monitoring
        self.assertEqual(code, 0)
        lines = printed.splitlines()
        self.assertRegex(
            lines[0],
            r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d lifecycle instance-state web1 status=Starting "
            r"status_code=106 display_status=BUILD vm_state=building task_state=spawning "
            r"power_state=nostate$",
        )
        self.assertRegex(lines[1], r" lifecycle instance-created web1$")

    async def test_csvHasOneHeaderThenARowAnEvent(self) -> None:
        out = _BrokenPipe(lines=2)
        subscribed = self.site.when_request("GET /1.0/events?type=lifecycle")
        monitoring = self.background("monitor", "--type", "lifecycle", "--format", "csv", out=out)
        await subscribed
        await self.launch("web1")
        code, printed, _ = await monitoring
        self.assertEqual(code, 0)
        rows = list(csv.reader(io.StringIO(printed)))
        self.assertEqual(rows[0], ["timestamp", "type", "metadata"])
        self.assertEqual(rows[1][1], "lifecycle")
        metadata = json.loads(rows[1][2])
        self.assertEqual(metadata["action"], "instance-state")
        self.assertEqual(metadata["context"]["task_state"], "spawning")

    async def test_unknownTypeExits1WithTheDaemonsWords(self) -> None:
        code, _, err = await self.cli("monitor", "--type", "logging")
        self.assertEqual(code, 1)
        self.assertEqual(
            err, "vmready: Error: Invalid event type 'logging': expected lifecycle, operation\n"
        )

    async def test_daemonGoingAwayEndsTheMonitorWithOneLine(self) -> None:
        subscribed = self.site.when_request("GET /1.0/events")
        monitoring = self.background("monitor")
        await subscribed
        await deferLater(reactor, 0, lambda: None)
        for channel in self.site.channels:
            channel.transport.loseConnection()
        self.assertEqual(
            await monitoring,
            (1, "", f"vmready: lost the connection to the vmready daemon at {self.socket}\n"),
        )

    async def test_daemonKilledEndsTheMonitorWithOneLine(self) -> None:
        out = io.StringIO()
        subscribed = self.site.when_request("GET /1.0/events")
        monitoring = self.background("monitor", out=out)
        await subscribed
        await self.launch("web1")
        self.assertIn(" lifecycle instance-created web1\n", out.getvalue())
        self.drop_connections()
        code, _, err = await monitoring
        self.assertEqual(
            (code, err),
            (1, f"vmready: lost the connection to the vmready daemon at {self.socket}\n"),
        )


class WaitTests(CLITestCase):
    """``wait NAME status=…``: subscribes first, checks once, wakes on the event."""

    async def test_alreadyMetReturnsAtOnceAfterSubscribing(self) -> None:
        await self.launch("web1")
        self.site.requests.clear()
        self.assertEqual(
            await self.cli("wait", "web1", "status=running"), (0, "web1: RUNNING\n", "")
        )
        self.assertEqual(
            self.site.requests, ["GET /1.0/events?type=lifecycle", "GET /1.0/instances/web1"]
        )

    async def test_wakesOnTheEventWithoutPolling(self) -> None:
        await self.launch("web1")
        self.site.requests.clear()
        checked = self.site.when_request("GET /1.0/instances/web1")
        waiting = self.background("wait", "web1", "STATUS=Stopped", "--timeout", "30")
        await checked
        await deferLater(reactor, 0.2, lambda: None)
        self.assertNoResult(waiting)
        await (await self.lifecycle.act("web1", "stop", force=True)).when_done()
        self.assertEqual(await waiting, (0, "web1: STOPPED\n", ""))
        self.assertEqual(
            self.site.requests, ["GET /1.0/events?type=lifecycle", "GET /1.0/instances/web1"]
        )

    async def test_jsonSaysWhatMetTheCondition(self) -> None:
        await self.launch("web1")
        self.declare_ready()
        code, out, err = await self.cli("wait", "web1", "status=running", "--format", "json")
        self.assertEqual((code, err), (0, ""))
        self.assertEqual(
            json.loads(out), {"name": "web1", "condition": "status=running", "met": "ready"}
        )
        self.agent_says(AgentStatus.CONNECTED)
        self.assertEqual(
            await self.cli("wait", "web1", "agent", "--format", "csv"),
            (0, "name,condition,met\nweb1,agent,connected\n", ""),
        )

    async def test_readyIsSignalledByTheReadyEvent(self) -> None:
        await self.launch("web1")
        checked = self.site.when_request("GET /1.0/instances/web1")
        waiting = self.background("wait", "web1", "status=ready")
        await checked
        self.declare_ready()
        self.assertEqual(await waiting, (0, "web1: READY\n", ""))

    async def test_aReadyThatARunningTaskWillUndoDoesNotEndTheWait(self) -> None:
        await self.launch("web1")
        store = self.lifecycle.store
        await store.instances.claim_task(
            "web1", "restart", frozenset({VMState.ACTIVE}), TaskState.REBOOTING
        )
        checked = self.site.when_request("GET /1.0/instances/web1")
        waiting = self.background("wait", "web1", "status=ready", "--timeout", "30")
        await checked
        self.declare_ready()  # while the restart runs: the status says Restarting
        await deferLater(reactor, 0.2, lambda: None)
        self.assertNoResult(waiting)
        record = await store.instances.finish_task("web1", TaskState.REBOOTING, VMState.ACTIVE)
        self.lifecycle.journal.publish_state(record)  # the task ended; Ready still set
        self.assertEqual(await waiting, (0, "web1: READY\n", ""))

    async def test_runningIsMetByReady(self) -> None:
        await self.launch("web1")
        self.declare_ready()
        self.assertEqual(
            await self.cli("wait", "web1", "status=running"), (0, "web1: READY\n", "")
        )

    async def test_timeoutExits1(self) -> None:
        await self.launch("web1")
        self.assertEqual(
            await self.cli("wait", "web1", "status=stopped", "--timeout", "0.2"),
            (
                1,
                "",
                "vmready: timed out after 0.2s waiting for web1 status=stopped "
                "(status: RUNNING)\n",
            ),
        )

    async def test_unknownInstanceExits1(self) -> None:
        self.assertEqual(
            await self.cli("wait", "nope", "status=running"),
            (1, "", "vmready: Error: Instance nope not found\n"),
        )

    async def test_deletedWhileWaitingExits3(self) -> None:
        await self.launch("web1")
        checked = self.site.when_request("GET /1.0/instances/web1")
        waiting = self.background("wait", "web1", "status=stopped")
        await checked
        await (await self.lifecycle.act("web1", "delete")).when_done()
        self.assertEqual(
            await waiting, (3, "", "vmready: instance web1 was deleted while waiting\n")
        )

    async def test_errorWhileWaitingExits3WithTheReason(self) -> None:
        await self.launch("web1")
        checked = self.site.when_request("GET /1.0/instances/web1")
        waiting = self.background("wait", "web1", "status=ready")
        await checked
        vm = self.lifecycle.running.vms["web1"]
        assert vm.pid is not None
        os.kill(vm.pid, signal.SIGKILL)
        code, out, err = await waiting
        self.assertEqual((code, out), (3, ""))
        self.assertTrue(
            err.startswith("vmready: instance web1 went to ERROR while waiting: "), err
        )
        self.assertEqual(err.count("\n"), 1)

    async def test_agentWaitWakesWhenTheAgentConnects(self) -> None:
        await self.launch("web1")
        checked = self.site.when_request("GET /1.0/instances/web1")
        waiting = self.background("wait", "web1", "agent", "--timeout", "30")
        await checked
        self.agent_says(AgentStatus.STARTED)
        await deferLater(reactor, 0.1, lambda: None)
        self.assertNoResult(waiting)
        self.agent_says(AgentStatus.CONNECTED)
        self.assertEqual(await waiting, (0, "web1: agent CONNECTED\n", ""))

    async def test_agentAlreadyConnectedReturnsAtOnce(self) -> None:
        await self.launch("web1")
        self.agent_says(AgentStatus.CONNECTED)
        self.assertEqual(
            await self.cli("wait", "web1", "AGENT"), (0, "web1: agent CONNECTED\n", "")
        )

    async def test_agentWaitTimeoutSaysWhatTheAgentLastSaid(self) -> None:
        await self.launch("web1")
        self.agent_says(AgentStatus.STARTED)
        self.assertEqual(
            await self.cli("wait", "web1", "agent", "--timeout", "0.2"),
            (
                1,
                "",
                "vmready: timed out after 0.2s waiting for the agent of web1 to connect "
                "(agent: STARTED)\n",
            ),
        )

    async def test_agentWaitExits3WhenTheInstanceIsDeleted(self) -> None:
        await self.launch("web1")
        checked = self.site.when_request("GET /1.0/instances/web1")
        waiting = self.background("wait", "web1", "agent")
        await checked
        await (await self.lifecycle.act("web1", "delete")).when_done()
        self.assertEqual(
            await waiting, (3, "", "vmready: instance web1 was deleted while waiting\n")
        )

    async def test_unknownConditionNamesBothForms(self) -> None:
        code, _, err = await self.cli("wait", "web1", "agents")
        self.assertEqual(code, 2)
        self.assertIn("unknown condition 'agents': expected status=<status> or agent", err)

    async def test_waitingForErrorIsMetByError(self) -> None:
        await self.launch("web1")
        self.patch(self.lifecycle.driver, "program", ["/nonexistent/qemu"])
        await self.cli("rebuild", "web1")
        self.assertEqual(await self.cli("wait", "web1", "status=error"), (0, "web1: ERROR\n", ""))

    async def test_daemonKilledWhileWaitingExits1WithOneLine(self) -> None:
        await self.launch("web1")
        checked = self.site.when_request("GET /1.0/instances/web1")
        waiting = self.background("wait", "web1", "status=stopped")
        await checked
        await deferLater(reactor, 0, lambda: None)
        self.assertNoResult(waiting)
        self.drop_connections()
        self.assertEqual(
            await waiting,
            (1, "", f"vmready: lost the connection to the vmready daemon at {self.socket}\n"),
        )

    async def test_nonFiniteOrNegativeTimeoutIsAUsageError(self) -> None:
        await self.launch("web1")
        self.site.requests.clear()
        for value in ("nan", "NaN", "inf", "-inf", "infinity", "1e999", "-1"):
            code, out, err = await self.cli("wait", "web1", "status=stopped", f"--timeout={value}")
            self.assertEqual((code, out), (2, ""), value)
            self.assertTrue(
                err.endswith(
                    f"vmready: error: argument --timeout: expected 0 or more seconds, "
                    f"got {value!r}\n"
                ),
                err,
            )
        self.assertEqual(self.site.requests, [])

    async def test_everyTimeoutOptionRejectsNonFiniteSeconds(self) -> None:
        for argv in (
            ["stop", "web1", "--timeout", "inf"],
            ["restart", "web1", "--timeout", "nan"],
            ["launch", "web2", "--wait", "--timeout", "nan"],
        ):
            code, _, err = await self.cli(*argv)
            self.assertEqual(code, 2, argv)
            self.assertIn("vmready: error: argument --timeout: expected 0 or more seconds", err)
        self.assertEqual(self.site.requests, [])

    async def test_unknownConditionIsAUsageError(self) -> None:
        for condition in ("status=happy", "ip=10.0.0.1", "running"):
            code, _, err = await self.cli("wait", "web1", condition)
            self.assertEqual(code, 2, condition)
            self.assertIn("vmready: error: unknown ", err)
        self.assertEqual(self.site.requests, [])

    def test_helpDocumentsTheExitCodes(self) -> None:
        parser = build_parser()
        stdout = io.StringIO()
        self.patch(sys, "stdout", stdout)
        self.assertRaises(SystemExit, parser.parse_args, ["wait", "-h"])
        text = stdout.getvalue()
        self.assertIn("never polls", text)
        for line in (
            "0  the condition was met",
            "1  timed out (--timeout), or an error: unknown instance, the daemon unreachable",
            "2  usage error",
            "3  the instance was deleted or went to Error while waiting for another status",
            "130  interrupted (SIGINT, Ctrl-C); 143 for SIGTERM",
        ):
            self.assertIn(line, text)


def _fill_listen_queue(path: str) -> list[socket.socket]:
    """Connections to the unix socket ``path`` until its listening queue is full."""
    waiting: list[socket.socket] = []
    while True:
        client = socket.socket(socket.AF_UNIX)
        client.setblocking(False)
        try:
            client.connect(path)
        except BlockingIOError:
            client.close()
            return waiting
        waiting.append(client)


class NoDaemonTests(TestCase):
    """One clear line when nothing listens on the socket."""

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="vmr-cli-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.socket = os.path.join(self.dir, "vmready.sock")

    async def test_missingSocket(self) -> None:
        err = io.StringIO()
        code = await run(reactor, ["--socket", self.socket, "list"], io.StringIO(), err)
        self.assertEqual(code, 1)
        self.assertEqual(
            err.getvalue(),
            f"vmready: cannot reach the vmready daemon at {self.socket}: "
            f"No such file or directory {_HINT}\n",
        )

    async def test_staleSocket(self) -> None:
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(self.socket)
        stale.close()
        err = io.StringIO()
        code = await run(
            reactor, ["--socket", self.socket, "wait", "x", "status=ready"], None, err
        )
        self.assertEqual(code, 1)
        self.assertEqual(
            err.getvalue(),
            f"vmready: cannot reach the vmready daemon at {self.socket}: "
            f"Connection refused {_HINT}\n",
        )

    async def test_fullListenQueueSaysTheDaemonIsBusyNotThatItIsNotRunning(self) -> None:
        # A daemon too busy to accept: its socket's queue is full, so the kernel turns
        # a connect away (EAGAIN) although the daemon runs.
        busy = socket.socket(socket.AF_UNIX)
        self.addCleanup(busy.close)
        busy.bind(self.socket)
        busy.listen(0)
        for waiting in _fill_listen_queue(self.socket):
            self.addCleanup(waiting.close)
        err = io.StringIO()
        code = await run(reactor, ["--socket", self.socket, "list"], io.StringIO(), err)
        self.assertEqual(code, 1)
        self.assertEqual(
            err.getvalue(),
            f"vmready: cannot reach the vmready daemon at {self.socket}: its queue of "
            "connections waiting to be accepted is full (it is too busy to accept more "
            "now; try again)\n",
        )

    async def test_socketFromTheEnvironment(self) -> None:
        self.patch(os, "environ", {**os.environ, "VMREADY_SOCKET": self.socket})
        err = io.StringIO()
        self.assertEqual(await run(reactor, ["list"], io.StringIO(), err), 1)
        self.assertIn(f"daemon at {self.socket}: ", err.getvalue())

    async def test_socketInTheDataDir(self) -> None:
        environ = {k: v for k, v in os.environ.items() if k != "VMREADY_SOCKET"}
        self.patch(os, "environ", {**environ, "VMREADY_DATA_DIR": self.dir})
        err = io.StringIO()
        self.assertEqual(await run(reactor, ["list"], io.StringIO(), err), 1)
        self.assertIn(f"daemon at {self.socket}: ", err.getvalue())

    async def test_consoleScriptPrintsOneLineAndExits1(self) -> None:
        out, err, code = await getProcessOutputAndValue(
            sys.executable,
            ["-m", "vmready.cli.main", "--socket", self.socket, "list"],
            env={**os.environ, "PYTHONPATH": _SOURCE_ROOT},
            path=_SOURCE_ROOT,
        )
        self.assertEqual((code, out), (1, b""))
        self.assertEqual(
            err.decode(),
            f"vmready: cannot reach the vmready daemon at {self.socket}: "
            f"No such file or directory {_HINT}\n",
        )


class VersionTests(TestCase):
    async def test_versionIsTheOneTheDaemonReports(self) -> None:
        # GET /1.0's environment.server_version is vmready.__version__ too (lxc version).
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = await run(reactor, ["--version"], io.StringIO(), io.StringIO())
        self.assertEqual((code, printed.getvalue()), (0, f"vmready {vmready.__version__}\n"))


def _strict_utf8() -> tuple[IO[str], io.BytesIO]:
    """A text stream like a UTF-8 terminal's (strict encoding), and the bytes written to it."""
    raw = io.BytesIO()
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict", write_through=True), raw


class OddDaemonAnswersTests(UnixAPITestCase):
    """Whatever the daemon answers, the CLI prints it or a message, never a traceback."""

    _INSTANCE = {
        "name": "web1",
        "uuid": "0b7c4e5e-0000-4000-8000-000000000001",
        "status": "Error",
        "display_status": "ERROR",
        "limits": {"memory_mib": 256, "cpus": 1},
        "config": {"user.note": "\ud800"},
        "error": "odd \udfff",
    }

    def setUp(self) -> None:
        self.api = _CannedAPI({"/1.0/instances/web1": _envelope(self._INSTANCE)})
        self.serve(self.api)

    async def strict_cli(self, *argv: str) -> tuple[int, str, str]:
        """``cli`` printing to strict UTF-8 streams, as a terminal would."""
        (out, out_bytes), (err, err_bytes) = _strict_utf8(), _strict_utf8()
        code = await run(reactor, ["--socket", self.socket, *argv], out, err)
        return code, out_bytes.getvalue().decode(), err_bytes.getvalue().decode()

    async def test_loneSurrogatesInATableAreEscaped(self) -> None:
        code, out, err = await self.strict_cli("info", "web1")
        self.assertEqual((code, err), (0, ""))
        self.assertIn("Error: odd \\udfff\n", out)
        self.assertTrue(out.endswith("Config:\n  user.note: \\ud800\n"), out)

    async def test_loneSurrogatesInYAMLAreEscaped(self) -> None:
        code, out, err = await self.strict_cli("info", "web1", "--format", "yaml")
        self.assertEqual((code, err), (0, ""))
        self.assertIn('config:\n  user.note: "\\uD800"\n', out)
        _, as_json, _ = await self.strict_cli("info", "web1", "--format", "json")
        self.assertEqual(yaml.safe_load(out), json.loads(as_json))
        self.assertEqual(yaml.safe_load(out)["config"], {"user.note": "\ud800"})

    async def test_loneSurrogatesInCSVAreEscaped(self) -> None:
        code, out, err = await self.strict_cli("info", "web1", "--format", "csv")
        self.assertEqual((code, err), (0, ""))
        header, row = list(csv.reader(io.StringIO(out)))
        cells = dict(zip(header, row, strict=True))
        self.assertEqual((cells["config.user.note"], cells["error"]), ("\\ud800", "odd \\udfff"))

    async def test_anInstanceFromADaemonWithoutOperatorStatusShowsItsLXDStatus(self) -> None:
        self.api.answers["/1.0/instances?recursion=1"] = _envelope([self._INSTANCE])
        code, out, err = await self.strict_cli("list")
        self.assertEqual(
            (code, out, err), (0, "NAME  STATUS  MEMORY  CPUS\nweb1  ERROR   256MiB  1\n", "")
        )

    async def test_loneSurrogatesInAnErrorAreEscaped(self) -> None:
        self.api.answers["/1.0/instances/web2"] = _error(400, "bad \ud800")
        self.assertEqual(
            await self.strict_cli("info", "web2"), (1, "", "vmready: Error: bad \\ud800\n")
        )

    async def test_undecodableNameFromArgvIsSentAsItsBytes(self) -> None:
        # What Python makes of ``vmready info $'\xff'``.
        name = os.fsdecode(b"\xff")
        code, out, err = await self.strict_cli("info", name)
        self.assertEqual(self.site.requests, ["GET /1.0/instances/%FF"])
        self.assertEqual(
            (code, out, err), (1, "", "vmready: Error: /1.0/instances/%FF not found\n")
        )

    async def test_undecodableEventTypeFromArgvIsSentAsItsBytes(self) -> None:
        code, _, err = await self.strict_cli("monitor", "--type", os.fsdecode(b"\xff"))
        self.assertEqual(self.site.requests, ["GET /1.0/events?type=%FF"])
        self.assertEqual((code, err), (1, "vmready: Error: /1.0/events?type=%FF not found\n"))

    async def test_aCancelledRequestReportsNothing(self) -> None:
        # How a signal ends a command: main() cancels it; it must unwind without a word.
        self.api.answers["/1.0/instances/web2"] = None
        out, err = io.StringIO(), io.StringIO()
        asked = self.site.when_request("GET /1.0/instances/web2")
        command = Deferred.fromCoroutine(
            run(reactor, ["--socket", self.socket, "info", "web2"], out, err)
        )
        await asked
        command.cancel()
        self.failureResultOf(command, CancelledError)
        self.assertEqual((out.getvalue(), err.getvalue()), ("", ""))


class ConsoleScriptTests(CLITestCase):
    """``python -m vmready.cli.main`` as a separate process against the listening API."""

    async def test_listAsJSONInASubprocess(self) -> None:
        await self.launch("web1")
        out, err, code = await getProcessOutputAndValue(
            sys.executable,
            ["-m", "vmready.cli.main", "--socket", self.socket, "list", "--format", "json"],
            env={**os.environ, "PYTHONPATH": _SOURCE_ROOT},
            path=_SOURCE_ROOT,
        )
        self.assertEqual((code, err), (0, b""))
        self.assertEqual([i["name"] for i in json.loads(out)], ["web1"])

    async def test_ctrlCDuringMonitorExits130Quietly(self) -> None:
        subscribed = self.site.when_request("GET /1.0/events")
        monitor = self.console("monitor", "--format", "json")
        await subscribed
        await self.launch("web1")
        await monitor.first_line
        monitor.signal("INT")
        self.assertEqual((await monitor.ended, monitor.err), (130, b""))
        self.assertEqual(json.loads(monitor.out.splitlines()[0])["type"], "lifecycle")

    async def test_sigtermDuringMonitorExits143Quietly(self) -> None:
        subscribed = self.site.when_request("GET /1.0/events")
        monitor = self.console("monitor", "--format", "json")
        await subscribed
        await self.launch("web1")
        await monitor.first_line
        monitor.signal("TERM")
        self.assertEqual((await monitor.ended, monitor.err), (143, b""))

    async def test_ctrlCDuringWaitExits130Quietly(self) -> None:
        await self.launch("web1")
        checked = self.site.when_request("GET /1.0/instances/web1")
        waiting = self.console("wait", "web1", "status=stopped")
        await checked
        await deferLater(reactor, 0.2, lambda: None)
        waiting.signal("INT")
        self.assertEqual((await waiting.ended, waiting.out, waiting.err), (130, b"", b""))

    async def test_sigtermDuringWaitExits143Quietly(self) -> None:
        await self.launch("web1")
        checked = self.site.when_request("GET /1.0/instances/web1")
        waiting = self.console("wait", "web1", "status=stopped")
        await checked
        await deferLater(reactor, 0.2, lambda: None)
        waiting.signal("TERM")
        self.assertEqual((await waiting.ended, waiting.out, waiting.err), (143, b"", b""))

    async def test_daemonKilledDuringMonitorIsOneLine(self) -> None:
        subscribed = self.site.when_request("GET /1.0/events")
        monitor = self.console("monitor", "--format", "json")
        await subscribed
        await self.launch("web1")
        await monitor.first_line
        self.drop_connections()
        self.assertEqual(
            (await monitor.ended, monitor.err.decode()),
            (1, f"vmready: lost the connection to the vmready daemon at {self.socket}\n"),
        )

    async def test_usageErrorExits2(self) -> None:
        _, err, code = await getProcessOutputAndValue(
            sys.executable,
            ["-m", "vmready.cli.main", "--socket", self.socket, "explode"],
            env={**os.environ, "PYTHONPATH": _SOURCE_ROOT},
            path=_SOURCE_ROOT,
        )
        self.assertEqual(code, 2)
        self.assertEqual(err, b"vmready: unknown command 'explode' (see 'vmready --help')\n")


class YAMLTests(SynchronousTestCase):
    """``--format yaml``: PyYAML's block style; the same data as JSON, keys in their order."""

    def assertSameDataAsJSON(self, value: Any) -> str:
        """``to_yaml(value)`` loads back to what ``--format json`` would print; its text."""
        text = to_yaml(value)
        self.assertEqual(yaml.safe_load(text), json.loads(json.dumps(value)))
        return text

    def test_nestedMappingsAndSequences(self) -> None:
        text = self.assertSameDataAsJSON(
            {"name": "web1", "limits": {"cpus": 2}, "tags": ["a", {"b": 1, "c": None}]}
        )
        self.assertEqual(text, "name: web1\nlimits:\n  cpus: 2\ntags:\n- a\n- b: 1\n  c: null\n")

    def test_keysKeepTheirOrder(self) -> None:
        value = {"zone": 1, "action": {"status": "Running", "context": {"z": 1, "a": 2}}}
        loaded = yaml.safe_load(self.assertSameDataAsJSON(value))
        self.assertEqual(list(loaded), ["zone", "action"])
        self.assertEqual(list(loaded["action"]), ["status", "context"])
        self.assertEqual(list(loaded["action"]["context"]), ["z", "a"])

    def test_emptyCollections(self) -> None:
        self.assertEqual(
            self.assertSameDataAsJSON({"config": {}, "steps": []}), "config: {}\nsteps: []\n"
        )
        self.assertEqual(self.assertSameDataAsJSON([]), "[]\n")

    def test_ambiguousStringsStayStrings(self) -> None:
        # Each would load as a bool, a number, null, a date, a mapping or a comment unquoted.
        strings = ["true", "no", "on", "y", "null", "~", "512", "-1", "1e3", "0x1F", ".inf"]
        strings += ["", "a: b", "#x", "- x", "2024-01-01T00:00:00Z", "2024-01-01", " padded "]
        self.assertSameDataAsJSON(strings)
        self.assertSameDataAsJSON({text: text for text in strings})

    def test_scalars(self) -> None:
        self.assertSameDataAsJSON([True, False, 0, -7, 1.5, 1e300, None, "line\nbreak", "tab\t"])

    def test_unicodeIsPrintedAsIs(self) -> None:
        text = self.assertSameDataAsJSON({"user.note": "café ☕"})
        self.assertEqual(text, "user.note: café ☕\n")

    def test_longStringsAreNotFolded(self) -> None:
        description = "com.canonical.lxd on the agent ring buffer, " * 5
        text = self.assertSameDataAsJSON({"serial_layout": {"description": description}})
        self.assertEqual(len(text.splitlines()), 2)

    def test_plainStringsStayPlain(self) -> None:
        value = {"source": "/1.0/instances/web1", "user.role": "web server"}
        self.assertEqual(
            self.assertSameDataAsJSON(value),
            "source: /1.0/instances/web1\nuser.role: web server\n",
        )


class CSVTests(SynchronousTestCase):
    """``to_csv``: JSON data as flat rows, the way docs/operator-guide.md describes."""

    def test_nestedObjectsBecomeDottedColumns(self) -> None:
        self.assertEqual(
            to_csv({"name": "web1", "limits": {"memory_mib": 256, "cpus": 1}, "devices": {}}),
            "name,limits.memory_mib,limits.cpus\nweb1,256,1\n",
        )

    def test_scalarsAsJSONWritesThemAndArraysAsOneJSONCell(self) -> None:
        self.assertEqual(
            to_csv({"a": None, "b": True, "c": False, "d": 1.5, "e": ["x", {"y": 1}]}),
            'a,b,c,d,e\n,true,false,1.5,"[""x"",{""y"":1}]"\n',
        )

    def test_rowsTakeEveryKeyInTheOrderFirstSeen(self) -> None:
        self.assertEqual(
            to_csv([{"a": 1, "c": {"x": 2}}, {"b": 3, "a": 4}]),
            "a,c.x,b\n1,2,\n4,,3\n",
        )

    def test_anEmptyListPrintsNothing(self) -> None:
        self.assertEqual(to_csv([]), "")

    def test_cellsThatNeedQuotesAreQuoted(self) -> None:
        text = to_csv({"error": 'a, "b"\nc'})
        self.assertEqual(text, 'error\n"a, ""b""\nc"\n')
        self.assertEqual(list(csv.reader(io.StringIO(text))), [["error"], ['a, "b"\nc']])

    def test_valuesThatAreNotObjectsAreOneColumn(self) -> None:
        self.assertEqual(to_csv(["a", "b"]), "value\na\nb\n")
        self.assertEqual(flatten({"config": {"limits.cpu": "2"}}), {"config.limits.cpu": "2"})


class SnapshotCommandTests(CLITestCase):
    """snapshot, snapshots, restore."""

    async def test_snapshotListRestore(self) -> None:
        await self.launch("web1", "-c", "user.role=db")
        self.assertEqual(
            await self.cli("snapshot", "web1", "s1", "--stateful"),
            (0, "web1: RUNNING\n", ""),
        )
        code, out, _ = await self.cli("snapshots", "web1")
        self.assertEqual(code, 0)
        self.assertEqual(out.splitlines()[0].split(), ["NAME", "STATEFUL", "LAYOUT", "CREATED"])
        self.assertEqual(out.splitlines()[1].split()[:3], ["s1", "yes", "current"])
        self.assertEqual(
            await self.cli("restore", "web1", "s1", "--stateful"),
            (0, "web1: RUNNING\n", ""),
        )

    async def test_snapshotVerbsCreateListDeleteRestore(self) -> None:
        await self.launch("web1")
        self.assertEqual(
            await self.cli("snapshot", "create", "web1", "s1"), (0, "web1: RUNNING\n", "")
        )
        await self.cli("snapshot", "web1", "s2")  # the short form is "create"
        code, out, _ = await self.cli("snapshot", "list", "web1")
        self.assertEqual([line.split()[0] for line in out.splitlines()[1:]], ["s1", "s2"])
        self.assertEqual(
            await self.cli("snapshot", "delete", "web1", "s1"),
            (0, "Snapshot s1 of web1 deleted\n", ""),
        )
        code, out, _ = await self.cli("--format", "json", "snapshot", "delete", "web1", "s2")
        self.assertEqual((code, json.loads(out)["name"]), (0, "s2"))
        code, out, _ = await self.cli("snapshot", "list", "web1", "--format", "json")
        self.assertEqual(json.loads(out), [])

    async def test_snapshotDeleteErrorsAreOneLine(self) -> None:
        await self.launch("web1")
        code, out, err = await self.cli("snapshot", "delete", "web1", "nope")
        self.assertEqual(out, "")
        self.assertNotEqual(code, 0)
        self.assertEqual(err, "vmready: Error: Snapshot nope of instance web1 not found\n")
        code, _, err = await self.cli("snapshot")
        self.assertEqual(code, 2)
        self.assertIn("VERB", err)

    async def test_refusedStatefulRestoreIsOneLineAndExit1(self) -> None:
        await self.launch("web1")
        await self.cli("snapshot", "web1", "s1", "--stateful")
        self.patch(self.lifecycle.booting, "serial_layout", LEGACY_LAYOUT)
        code, out, err = await self.cli("restore", "web1", "s1", "--stateful")
        self.assertEqual((code, out), (1, ""))
        self.assertTrue(
            err.startswith("vmready: Error: Cannot restore the state of snapshot s1"), err
        )
        self.assertEqual(err.count("\n"), 1)
