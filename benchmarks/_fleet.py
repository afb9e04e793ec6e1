"""The machinery the fleet benchmarks share: one fakeqemu-host, the daemon and real agents in
child processes, an operator event stream, and the guest's PATCH.

``benchmarks/ready.py`` and ``benchmarks/agent_link.py`` are built on it.  Each
script runs itself as its own child processes (``--role daemon``, ``--role
agents``), so a script's ``main`` hands those roles to ``run_daemon`` and
``run_agents`` here; ``Children`` is told which script to start.

- ``run_daemon``: ``VMReadyService`` exactly as ``twistd vmready --data-dir D``
  builds it (``vmready.daemon.tap.makeService``, default options), with
  ``FAKEQEMU_HOST`` set by the parent, answering ``ready`` (pid, guest API
  port) and ``reads`` (the sum of every ``AgentMonitor.reads``, optionally per
  instance, and the agents' statuses) on its stdin/stdout;
- ``run_agents``: many real ``vmready.agent`` agents (``load_config`` +
  ``build_agent`` on each instance's config drive) on one asyncio loop in a
  thread, each agent's serial writes stamped with ``time.perf_counter`` (one
  ``CLOCK_MONOTONIC`` for every process of the machine) so that the parent can
  time a status line from the moment the agent wrote it;
- ``EventWatch``: one operator API event stream, stamping each lifecycle event
  as it arrives;
- ``notify``: the guest program's ``PATCH /1.0`` on an agent's devlxd socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import glob
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from twisted.internet import reactor as installed_reactor
from twisted.internet import stdio
from twisted.internet.defer import Deferred, DeferredSemaphore, gatherResults
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)
from twisted.protocols.basic import LineReceiver
from twisted.python.failure import Failure
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from benchmarks._measure import ms, nearest_rank, report, sleep
from fakeqemu._hostclient import HostClient, HostUnreachable
from vmready.agent.config import AgentConfig, load_config
from vmready.agent.main import configure_logging
from vmready.agent.service import Agent as GuestAgent
from vmready.agent.service import build_agent
from vmready.api.web import BytesProducer
from vmready.cli.client import Client
from vmready.cli.waiter import Waiter
from vmready.daemon.service import VMReadyService
from vmready.daemon.tap import Options, makeService
from vmready.domain.limits import raise_file_limit

BIN_DIRECTORY = os.path.dirname(os.path.abspath(sys.executable))
FAKEQEMU_HOST = os.path.join(BIN_DIRECTORY, "fakeqemu-host")
START_TIMEOUT = 120.0
CALL_TIMEOUT = 300.0
EVENT_TIMEOUT = 30.0
CREATE_CONCURRENCY = 16
AGENT_CHUNK = 50
POLL_SECONDS = 0.05

STOP_TIMEOUT = 60.0
# The agent's first status line and the two the cycles time.
STOPPED_LINE = b"STOPPED\n"
STARTED_LINE = b"STARTED\n"
CONNECTED_LINE = b"CONNECTED\n"
CHATTY_FACTORIES = (
    "twisted.web.client._HTTP11ClientFactory",
    "twisted.internet.endpoints.OneShotFactory",
)

reactor: Any = installed_reactor
Handler = Callable[..., Coroutine[Any, Any, Any]]


# -- figures ------------------------------------------------------------------


def plural(count: int, word: str) -> str:
    """``1 instance``, ``2 instances``."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def p50_p99(samples: Sequence[float]) -> str:
    """``p50 …, p99 …, max …`` of latency samples."""
    if not samples:
        return "no samples"
    return (
        f"p50 {ms(nearest_rank(samples, 0.5))}, p99 {ms(nearest_rank(samples, 0.99))}, "
        f"max {ms(max(samples))}"
    )


# -- child processes: a JSON line per command on stdin, a JSON line per answer on stdout ----


class ChildError(Exception):
    """A child process answered a command with an error, or went away."""


class ControlChannel(LineReceiver):
    """The child's end: runs each command's handler, answers with its result or error."""

    delimiter = b"\n"
    MAX_LENGTH = 64 * 1024 * 1024

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers

    def lineReceived(self, line: bytes) -> None:
        message = json.loads(line)
        ident = message["id"]
        handler = self.handlers.get(message["cmd"])
        if handler is None:
            self._answer({"id": ident, "error": f"unknown command {message['cmd']!r}"})
            return
        running = Deferred.fromCoroutine(handler(**message.get("args", {})))
        running.addCallbacks(
            lambda result: self._answer({"id": ident, "result": result}),
            lambda failure: self._answer(
                {"id": ident, "error": f"{failure.type.__name__}: {failure.getErrorMessage()}"}
            ),
        )

    def _answer(self, message: dict[str, Any]) -> None:
        assert self.transport is not None
        self.transport.write(json.dumps(message).encode("utf-8") + b"\n")

    def connectionLost(self, reason: Failure | None = None) -> None:
        # The benchmark went away (or closed our stdin): stop, cleanly.
        if reactor.running:
            reactor.stop()


class Child(ProcessProtocol):
    """The parent's end of one child process: ``call`` a command, ``terminate`` it."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.ended: Deferred[None] = Deferred()
        self.exit_code: int | None = None
        self._buffer = b""
        self._pending: dict[int, Deferred[Any]] = {}
        self._next = 0

    @property
    def pid(self) -> int:
        """The child's process id."""
        assert self.transport is not None and self.transport.pid is not None
        return int(self.transport.pid)

    @property
    def running(self) -> bool:
        """The child has not exited yet."""
        return not self.ended.called

    def outReceived(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            waiter = self._pending.pop(message["id"], None)
            if waiter is None:
                continue
            if "error" in message:
                waiter.errback(ChildError(f"{self.label}: {message['error']}"))
            else:
                waiter.callback(message["result"])

    def processEnded(self, reason: Failure) -> None:
        if isinstance(reason.value, ProcessDone | ProcessTerminated):
            self.exit_code = reason.value.exitCode
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            waiter.errback(ChildError(f"{self.label} exited ({reason.getErrorMessage()})"))
        self.ended.callback(None)

    def call(self, command: str, timeout: float = CALL_TIMEOUT, **args: Any) -> Deferred[Any]:
        """Send ``command``; fires with the child's answer."""
        if not self.running or self.transport is None:
            raise ChildError(f"{self.label} is not running")
        self._next += 1
        waiter: Deferred[Any] = Deferred()
        self._pending[self._next] = waiter
        line = json.dumps({"id": self._next, "cmd": command, "args": args}).encode("utf-8")
        self.transport.write(line + b"\n")
        return waiter.addTimeout(timeout, reactor)

    async def terminate(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; returns once it exited."""
        if not self.running:
            return
        assert self.transport is not None
        self.transport.signalProcess("TERM")
        deadline = time.monotonic() + timeout
        while self.running:
            if time.monotonic() > deadline:
                self.transport.signalProcess("KILL")
                break
            await sleep(POLL_SECONDS)
        await self.ended


class Children:
    """Every process this benchmark started, so that nothing outlives it."""

    def __init__(self, directory: str, script: str) -> None:
        """``script`` is the benchmark that runs as its own children (``--role …``)."""
        self.directory = directory
        self.script = script
        self.started: list[Child] = []

    def spawn(
        self,
        label: str,
        argv: Sequence[str],
        log_name: str,
        environment: dict[str, str] | None = None,
        control: bool = True,
    ) -> Child:
        """Start ``argv``; stderr (and stdout, without ``control``) to ``log_name``."""
        child = Child(label)
        with open(os.path.join(self.directory, log_name), "ab") as log:
            fds: dict[int, int | str] = {0: "w", 1: "r" if control else log.fileno()}
            fds[2] = log.fileno()
            reactor.spawnProcess(
                child,
                argv[0],
                list(argv),
                env=dict(os.environ) if environment is None else environment,
                childFDs=fds,
            )
        self.started.append(child)
        return child

    def spawn_role(
        self, label: str, role: str, *extra: str, env: dict[str, str] | None = None
    ) -> Child:
        """This script as a child in ``role``."""
        argv = [sys.executable, self.script, "--role", role, *extra]
        return self.spawn(label, argv, f"{label}.log", env)

    def kill_left_over(self) -> None:
        """Last resort once the reactor is gone: SIGKILL every child still running."""
        for child in self.started:
            if child.running and child.transport is not None and child.transport.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(child.transport.pid), signal.SIGKILL)


def serve_control(handlers: dict[str, Handler]) -> None:
    """Answer the parent's commands on stdin/stdout."""
    stdio.StandardIO(ControlChannel(handlers), reactor=reactor)


def log_to(path: str, level: LogLevel) -> None:
    """Log this child at ``level`` and above to ``path`` (as twistd or the agent would)."""
    levels = LogLevelFilterPredicate(defaultLogLevel=level)
    for chatty in CHATTY_FACTORIES:
        levels.setLogLevelForNamespace(chatty, LogLevel.warn)
    log = open(path, "a")  # noqa: SIM115 - open for the life of the process
    globalLogBeginner.beginLoggingTo(
        [FilteringLogObserver(textFileLogObserver(log), [levels])], redirectStandardIO=False
    )


# -- the daemon child -------------------------------------------------------------


def run_daemon(data_dir: str) -> None:
    """``--role daemon``: the service ``twistd -n vmready --data-dir`` would run, plus counters."""
    options = Options()
    options.parseOptions(["--data-dir", data_dir])
    service: VMReadyService = makeService(options)  # raises the file limit too
    log_to(os.path.join(data_dir, "vmready.log"), LogLevel.info)
    recovered: Deferred[None] = Deferred()

    def settled(result: object) -> None:
        # Recovery's failure is in the daemon's log; the benchmark goes on, as the daemon does.
        recovered.callback(None)

    service.recovered.addBoth(settled)

    async def ready() -> dict[str, Any]:
        if not recovered.called:
            await recovered
        lifecycle = service.lifecycle
        assert lifecycle is not None and lifecycle.reach.link is not None
        return {"pid": os.getpid(), "guest_port": lifecycle.reach.link.port}

    async def reads(per_instance: bool = False) -> dict[str, Any]:
        lifecycle = service.lifecycle
        assert lifecycle is not None
        by_name = dict(lifecycle.running.monitors)
        monitors = list(by_name.values())
        answer = {
            "at": time.perf_counter(),
            "reads": sum(monitor.reads for monitor in monitors),
            "monitors": len(monitors),
            "statuses": dict(Counter(monitor.status.value for monitor in monitors)),
        }
        if per_instance:
            # The counters themselves, by instance name (a monitor is replaced when its VM
            # restarts, so a counter can go back to 0: the parent takes that into account).
            answer["per_instance"] = {name: monitor.reads for name, monitor in by_name.items()}
        return answer

    # The garbage collector's pauses of 5 ms or more: (when it ended, seconds, generation).
    pauses: list[tuple[float, float, int]] = []
    collecting: dict[str, float] = {}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            collecting["since"] = now
            return
        took = now - collecting.get("since", now)
        if took >= 0.005:
            pauses.append((now, took, info["generation"]))

    gc.callbacks.append(on_gc)

    async def gc_pauses(since: float = 0.0) -> dict[str, Any]:
        return {"pauses": [pause for pause in pauses if pause[0] >= since]}

    serve_control({"ready": ready, "reads": reads, "gc": gc_pauses})
    reactor.callWhenRunning(service.startService)
    reactor.addSystemEventTrigger("before", "shutdown", service.stopService)
    reactor.run()


# -- the agent worker child ----------------------------------------------------------


class AgentLoop:
    """The agents' asyncio loop, in a thread beside the reactor that serves the commands."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="agents", daemon=True).start()

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Deferred[Any]:
        """``coroutine`` run on the agents' loop; its result as a Deferred on the reactor."""
        result: Deferred[Any] = Deferred()

        def done(future: Any) -> None:
            error = future.exception()
            if error is not None:
                reactor.callFromThread(result.errback, error)
            else:
                reactor.callFromThread(result.callback, future.result())

        asyncio.run_coroutine_threadsafe(coroutine, self.loop).add_done_callback(done)
        return result


class StampedAgent:
    """One real agent whose status lines are time-stamped as it hands them to the serial port."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.name = config.instance or config.socket
        self.agent: GuestAgent = build_agent(config)
        self.running = False
        self._expected: dict[bytes, asyncio.Future[float]] = {}
        keeper = self.agent.serial
        assert keeper is not None
        write = keeper.write

        def stamped(data: bytes, announce: bool = False) -> bool:
            now = time.perf_counter()
            written = write(data, announce)
            if written:
                waiter = self._expected.pop(data, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(now)
            return written

        # The one instrument: the keeper's write, wrapped; the agent is otherwise untouched.
        keeper.write = stamped  # type: ignore[method-assign]

    def expect(self, line: bytes) -> asyncio.Future[float]:
        """Resolves to the time ``line`` is next written to the serial port (in the loop)."""
        waiter: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._expected[line] = waiter
        return waiter

    async def start(self) -> None:
        """Start the agent (in the agents' loop)."""
        await self.agent.start()
        self.running = True

    async def stop(self) -> None:
        """Stop the agent (in the agents' loop)."""
        self.running = False
        await self.agent.stop()


def run_agents(directory: str) -> None:
    """``--role agents``: many agents in one process, started and cycled on command."""
    raise_file_limit()
    log_to(os.path.join(directory, f"agents-{os.getpid()}.log"), LogLevel.info)
    configure_logging()  # the agents' own lines, to stderr: the same log file
    agents: dict[str, StampedAgent] = {}
    loop = AgentLoop()

    async def start_all(drives: list[str]) -> int:
        for drive in drives:
            agent = StampedAgent(load_config({"config-drive": drive}))
            agents[agent.name] = agent
            await agent.start()
        return len(drives)

    async def start(drives: list[str]) -> int:
        started: int = await loop.run(start_all(drives))
        return started

    async def stop_one(agent: StampedAgent, unstamped: bool) -> dict[str, Any]:
        stopped = agent.expect(STOPPED_LINE)
        asked = time.perf_counter()
        await agent.stop()
        if unstamped and not stopped.done():
            # The agent's stop is over (its port closed, flushed) and no STOPPED went through
            # the keeper's write: time from the moment it was asked to stop instead.
            stopped.cancel()
            return {"stopped": asked, "asked": asked, "stamped": False}
        return {"stopped": await asyncio.wait_for(stopped, EVENT_TIMEOUT), "asked": asked}

    async def stop_agent(name: str, unstamped: bool = False) -> dict[str, Any]:
        """Stop ``name``'s agent; ``unstamped``: no STOPPED line seen is not an error."""
        result: dict[str, Any] = await loop.run(stop_one(agents[name], unstamped))
        return result

    async def start_one(agent: StampedAgent) -> dict[str, float]:
        started, connected = agent.expect(STARTED_LINE), agent.expect(CONNECTED_LINE)
        await agent.start()
        return {
            "started": await asyncio.wait_for(started, EVENT_TIMEOUT),
            "connected": await asyncio.wait_for(connected, EVENT_TIMEOUT),
        }

    async def start_agent(name: str) -> dict[str, float]:
        agent = agents[name] = StampedAgent(agents[name].config)
        result: dict[str, float] = await loop.run(start_one(agent))
        return result

    async def stop_running() -> int:
        running = [agent for agent in agents.values() if agent.running]
        await asyncio.gather(*(agent.stop() for agent in running))
        return len(running)

    async def stop_all() -> int:
        stopped: int = await loop.run(stop_running())
        return stopped

    serve_control(
        {
            "start": start,
            "stop_agent": stop_agent,
            "start_agent": start_agent,
            "stop_all": stop_all,
        }
    )
    reactor.run()


# -- the parent: twisted.web clients for the guest's two conversations ---------------------


@implementer(IAgentEndpointFactory)
class OneEndpoint:
    """Every URL goes to the same endpoint."""

    def __init__(self, endpoint: Any) -> None:
        self._endpoint = endpoint

    def endpointForURI(self, uri: Any) -> Any:
        return self._endpoint


async def notify(socket_path: str, state: str, timeout: float) -> None:
    """What ``vmready-agent notify`` sends: ``PATCH /1.0`` on the agent's socket."""
    agent = Agent.usingEndpointFactory(
        reactor, OneEndpoint(UNIXClientEndpoint(reactor, socket_path))
    )
    body = json.dumps({"state": state}).encode("utf-8")
    headers = Headers({b"Content-Type": [b"application/json"]})
    sending = agent.request(b"PATCH", b"http://lxd/1.0", headers, BytesProducer(body))
    response = await sending.addTimeout(timeout, reactor)
    answer = await readBody(response).addTimeout(timeout, reactor)
    if not 200 <= response.code < 300:
        raise RuntimeError(f"PATCH /1.0 answered {response.code}: {answer!r}")


def devlxd_socket(drive: str) -> str:
    """The devlxd socket of the agent whose config drive is ``drive``."""
    with open(os.path.join(drive, "agent.json")) as f:
        return str(json.load(f)["devlxd_socket"])


async def timed_ready(client: Client, name: str, socket: str) -> tuple[float, float]:
    """One timed Ready: (PATCH sent → wait client's event, PATCH sent → PATCH answered).

    A ``Waiter`` for ``ready`` (what ``vmready wait NAME ready`` runs) subscribes
    first; then the guest program's PATCH goes to the agent's ``socket``.
    """
    waiter = Waiter(client, name, "ready")
    await waiter.subscribe()
    arrived: list[float] = []

    def stamp(outcome: tuple[int, str | None]) -> tuple[int, str | None]:
        arrived.append(time.perf_counter())
        return outcome

    try:
        outcome = waiter.outcome.addCallback(stamp)
        sent = time.perf_counter()
        await notify(socket, "Ready", EVENT_TIMEOUT)
        answered = time.perf_counter()
        code, message = await outcome.addTimeout(EVENT_TIMEOUT, reactor)
        if code != 0:
            raise RuntimeError(f"the wait client for {name} ended: {message}")
    finally:
        waiter.close()
    return arrived[0] - sent, answered - sent


# -- the parent: set-up ------------------------------------------------------------


async def start_host(children: Children, directory: str) -> tuple[Child, str]:
    """A ``fakeqemu-host`` serving on ``<directory>/host.ctl``, once it answers."""
    control = os.path.join(directory, "host.ctl")
    host = children.spawn(
        "fakeqemu-host", [FAKEQEMU_HOST, "--control", control, "serve"], "host.log", control=False
    )
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            with HostClient(control) as client:
                client.call("list")
            return host, control
        except HostUnreachable:
            if not host.running or time.monotonic() > deadline:
                raise SystemExit("fakeqemu-host did not start; see host.log") from None
            await sleep(POLL_SECONDS)


class EventWatch:
    """One operator API event stream: when each expected event arrived, and each agent's status."""

    def __init__(self) -> None:
        self.agent: dict[str, str] = {}
        self._expected: dict[tuple[str, str], list[Deferred[float]]] = {}

    def on_event(self, event: dict[str, Any]) -> None:
        """A lifecycle event: stamp it first, then look at it."""
        now = time.perf_counter()
        metadata = event.get("metadata") or {}
        action = str(metadata.get("action", ""))
        name = str(metadata.get("source", "")).removeprefix("/1.0/instances/")
        if action.startswith("instance-agent-"):
            self.agent[name] = action.removeprefix("instance-agent-")
        for waiter in self._expected.pop((name, action), []):
            waiter.callback(now)

    def expect(self, name: str, action: str, timeout: float = EVENT_TIMEOUT) -> Deferred[float]:
        """Fires with the arrival time of the next ``action`` event about ``name``."""
        waiter: Deferred[float] = Deferred()
        self._expected.setdefault((name, action), []).append(waiter)
        return waiter.addTimeout(timeout, reactor)

    def connected(self, names: Sequence[str]) -> int:
        """How many of ``names`` the events last showed CONNECTED."""
        return sum(self.agent.get(name) == "connected" for name in names)


async def create(client: Client, name: str) -> None:
    """POST one instance and wait for its operation; RuntimeError if it failed."""
    operation = await client.operation("POST", "/1.0/instances", {"name": name, "config": {}})
    done = await client.wait_operation(operation)
    if done.get("status") != "Success":
        raise RuntimeError(f"creating {name} failed: {done.get('err')}")


def find_drives(data_dir: str) -> dict[str, str]:
    """Instance name → config drive directory, from every drive's agent.json."""
    drives: dict[str, str] = {}
    for path in glob.glob(os.path.join(data_dir, "run", "*", "config-drive", "agent.json")):
        with open(path) as f:
            drives[str(json.load(f)["instance"])] = os.path.dirname(path)
    return drives


async def create_all(client: Client, names: Sequence[str]) -> None:
    """Create every one of ``names``, ``CREATE_CONCURRENCY`` at a time."""
    semaphore = DeferredSemaphore(CREATE_CONCURRENCY)
    await gatherResults(
        [semaphore.run(lambda n: Deferred.fromCoroutine(create(client, n)), n) for n in names]
    )


async def wait_connected(watch: EventWatch, names: Sequence[str], timeout: float) -> None:
    """Until the events showed every agent of ``names`` CONNECTED; SystemExit after ``timeout``."""
    deadline = time.monotonic() + timeout
    while watch.connected(names) < len(names):
        if time.monotonic() > deadline:
            missing = [n for n in names if watch.agent.get(n) != "connected"]
            raise SystemExit(f"agents not CONNECTED after {timeout:g}s: {missing[:10]}")
        await sleep(POLL_SECONDS)


async def start_agents(
    workers: Sequence[Child],
    worker_of: dict[str, Child],
    drives: dict[str, str],
    watch: EventWatch,
    names: Sequence[str],
    connected_before: Sequence[str] = (),
) -> None:
    """Start the agents of ``names``, ``AGENT_CHUNK`` at a time spread over ``workers``.

    Each chunk connects (``connected_before`` and every earlier chunk stay
    CONNECTED too) before the next dials: a gentler start than all at once.
    """
    for offset in range(0, len(names), AGENT_CHUNK):
        chunk = names[offset : offset + AGENT_CHUNK]
        calls = []
        for index, worker in enumerate(workers):
            mine = chunk[index :: len(workers)]
            for name in mine:
                worker_of[name] = worker
            if mine:
                calls.append(worker.call("start", drives=[drives[n] for n in mine]))
        await gatherResults(calls)
        await wait_connected(
            watch, [*connected_before, *names[: offset + len(chunk)]], START_TIMEOUT
        )


PROBLEM_LEVELS = (
    "#warn]",
    "#error]",
    "#critical]",
    "Traceback",
    "vmready-agent: warning: ",
    "vmready-agent: error: ",
    "vmready-agent: critical: ",
)


def log_problems(directory: str) -> None:
    """Warnings and errors the children logged: a count per log, and a few examples."""
    found = False
    paths = sorted(glob.glob(os.path.join(directory, "**", "*.log"), recursive=True))
    for path in paths:
        with open(path, errors="replace") as f:
            problems = [line.rstrip() for line in f if any(p in line for p in PROBLEM_LEVELS)]
        if not problems:
            continue
        found = True
        kinds = Counter((line.partition("] ")[2] or line)[:100] for line in problems)
        report(f"  {os.path.relpath(path, directory)}: {plural(len(problems), 'problem line')}")
        for text, seen in kinds.most_common(3):
            report(f"    {seen} x {text}")
    if not found:
        report("  none")
