"""The machinery the fleet benchmarks share: one fakeqemu-host, the daemon and real agents in
child processes, an operator event stream, and the guest's PATCH.

``benchmarks/ready.py`` and ``benchmarks/agent_link.py`` are built on it.  Each
script runs itself as its own child processes (``--role daemon``, ``--role
agents``: ``run_roles``), started through ``benchmarks._children``.

- ``run_daemon``: ``VMReadyService`` exactly as ``twistd vmready --data-dir D``
  builds it (``vmready.daemon.tap.makeService``, default options), with
  ``FAKEQEMU_HOST`` set by the parent, answering ``ready`` (pid, guest API
  port) and ``reads`` (the sum of every ``AgentMonitor.reads``, optionally per
  instance, and the agents' statuses) on its stdin/stdout;
- ``run_agents`` (``benchmarks._agentworker``): many real agents in one
  process, each status line stamped as it is written;
- ``Fleet``: the running processes, started (``Fleet.start``) and torn down
  (``teardown``) the same way by every fleet benchmark;
- ``EventWatch``: one operator API event stream, stamping each lifecycle event
  as it arrives;
- ``notify``: the guest program's ``PATCH /1.0`` on an agent's devlxd socket.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import attrs
from twisted.internet import task
from twisted.internet.defer import Deferred, DeferredSemaphore, gatherResults
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.logger import LogLevel
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from benchmarks._agentworker import run_agents
from benchmarks._children import (
    FAKEQEMU_HOST,
    POLL_SECONDS,
    START_TIMEOUT,
    STOP_TIMEOUT,
    Child,
    Children,
    host_answers,
    log_to,
    serve_control,
)
from benchmarks._measure import ms, nearest_rank, reactor, report, sleep
from vmready.api import BytesProducer
from vmready.cli import Client, LineStream, Waiter
from vmready.daemon import Options, VMReadyService, makeService

EVENT_TIMEOUT = 30.0
CREATE_CONCURRENCY = 16
AGENT_CHUNK = 50

_Fleet = TypeVar("_Fleet", bound="Fleet")


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
    await host_answers(control, lambda: host.running, "host.log")
    return host, control


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
    operation = await client.operation(
        "POST", "/1.0/instances", {"name": name, "config": {}, "start": True}
    )
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


# -- the parent: the fleet's processes, started and stopped ---------------------------


@attrs.define
class Fleet:
    """fakeqemu-host, the daemon on it, the agent workers and an operator event stream."""

    args: argparse.Namespace
    directory: str
    data_dir: str
    children: Children
    client: Client
    watch: EventWatch
    stream: LineStream
    daemon: Child
    host: Child
    workers: list[Child]
    guest_port: int
    drives: dict[str, str] = attrs.field(factory=dict)
    worker_of: dict[str, Child] = attrs.field(factory=dict)

    @classmethod
    async def start(
        cls: type[_Fleet], args: argparse.Namespace, children: Children, directory: str
    ) -> _Fleet:
        """Host, daemon (answering), event stream, ``args.agent_workers`` workers."""
        host, control = await start_host(children, directory)
        data_dir = os.path.join(directory, "d")
        os.makedirs(data_dir, mode=0o700)
        environment = dict(os.environ)
        environment.pop("FAKEQEMU_GUEST_DIR", None)
        environment["FAKEQEMU_HOST"] = control
        daemon = children.spawn_role("daemon", "daemon", data_dir, env=environment)
        info = await daemon.call("ready", timeout=START_TIMEOUT)
        client = Client(reactor, os.path.join(data_dir, "vmready.sock"))
        watch = EventWatch()
        stream = await client.events(["lifecycle"], watch.on_event)
        workers = [
            children.spawn_role(f"agents{index}", "agents", directory)
            for index in range(args.agent_workers)
        ]
        return cls(
            args, directory, data_dir, children, client, watch, stream, daemon, host, workers,
            int(info["guest_port"]),
        )  # fmt: skip


async def teardown(fleet: Fleet | None, children: Children, directory: str) -> None:
    """Stop the agents, then every child; show what they logged as problems."""
    started = time.perf_counter()
    if fleet is not None:
        for worker in fleet.workers:
            if worker.running:
                try:
                    await worker.call("stop_all", timeout=STOP_TIMEOUT)
                except Exception as e:
                    report(f"  stopping {worker.label}: {e}")
        fleet.stream.close()
        await fleet.stream.ended
    for child in reversed(children.started):
        await child.terminate()
    report("\nwarnings and errors the children logged")
    log_problems(directory)
    report(
        f"\nteardown: agents, daemon and fakeqemu-host (with every VM) stopped in "
        f"{time.perf_counter() - started:.1f} s"
    )


def run_roles(role: str | None, directory: str, others: dict[str, Callable[[str], None]]) -> bool:
    """Run this process as the child ``role`` asks for (daemon, agents, ``others``); whether
    it was one."""
    roles = {"daemon": run_daemon, "agents": run_agents, **others}
    if role is None:
        return False
    roles[role](directory)
    return True


def run_parent(
    script: str,
    prefix: str,
    keep: bool,
    run: Callable[[Children, str], Awaitable[Any]],
) -> tuple[Any, int | str | None]:
    """``run`` on the reactor in a new directory under /tmp; every child is killed and the
    directory removed (unless ``keep``) after.  Its result (None if it failed), and the
    status to exit with."""
    directory = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    children = Children(directory, script)
    result: list[Any] = []

    async def entry() -> None:
        result.append(await run(children, directory))

    code: int | str | None = 0
    try:
        task.react(lambda _reactor: Deferred.fromCoroutine(entry()), [])
    except SystemExit as e:
        code = e.code
    finally:
        children.kill_left_over()
        if keep:
            report(f"kept {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
    return (result[0] if result else None), code
