"""What an honest Ready costs: latency, agent-status detection, guest API and ring-buffer polling.

One ``fakeqemu-host`` runs every VM; the daemon is ``VMReadyService`` exactly as
``twistd vmready --data-dir D`` builds it (``vmready.daemon.tap.makeService``,
default options, so the default ``PollIntervals`` and a 10 s power sync), run
in a child process of this script (``--role daemon``) with ``FAKEQEMU_HOST`` set,
so that it can answer "how many ring-buffer reads so far" from its
``AgentMonitor.reads`` counters.  The agents are the real ``vmready.agent``
(``load_config`` + ``build_agent`` on each instance's config drive, default
heartbeat and retries), many per process in ``--agent-workers`` child processes
(``--role agents``), all on one asyncio loop in a thread of that process beside
the reactor that serves the benchmark's commands.  This process is the guest
program, the operator's ``wait`` client and the guest API load generator.  The instance count grows
in stages (``--counts``, default 1, 100, 1000): each stage creates the missing
instances through the operator API, starts their agents, waits until the
daemon reports every agent CONNECTED, and then measures with all of them
connected and being polled:

- **ring-buffer reads/s**: the sum of every ``AgentMonitor.reads`` in the
  daemon, read at both ends of a ``--reads-window`` while nothing else
  happens, divided by the window; with the daemon's and fakeqemu-host's CPU
  use over the same window;
- **ready latency**: a ``vmready.cli.waiter.Waiter`` for ``ready`` (what
  ``vmready wait NAME ready`` runs) subscribes to the operator API's events;
  then the guest program sends ``PATCH /1.0 {"state":"Ready"}`` to the
  instance's agent socket (what ``vmready-agent notify`` sends, here from
  twisted.web's Agent on a unix endpoint); the latency runs from just before
  the PATCH is sent until the waiter's event arrives (whichever of the
  ``instance-state`` Ready or the ``instance-ready`` event comes first: the
  former).  PATCHes are one at a time
  (sequential), every instance of the stage once, each from Started (an
  instance left Ready by an earlier stage is set back to Started first,
  untimed); with one instance the PATCH is repeated ``--single-repeats``
  times, an untimed Started between.  The PATCH's own answer time (the guest's
  view) is shown too;
- **agent-status detection**: an agent is stopped (it writes ``STOPPED``) and,
  once the daemon has announced that, started again (it writes ``STARTED`` as
  its serial port opens, then ``CONNECTED`` after the host's CONNECT and its
  dial).  The worker stamps each status line just before the agent hands it
  to its serial port; the latency runs from that stamp until the
  ``instance-agent-<status>`` event reaches an operator API event stream in
  this process.  Stamps cross processes: ``time.perf_counter`` is
  ``CLOCK_MONOTONIC`` on Linux, one clock for the whole machine.  Each line is
  read at the pace the daemon's ``AgentLink`` sets for the state it was in:
  STOPPED while CONNECTED (``connected`` interval), STARTED while STOPPED
  (``started``), CONNECTED while a CONNECT is outstanding (``connecting``);
  ``--cycles`` cycles per stage, on as many different instances as there are,
  ``--wave`` at a time (one at a time with one instance), each change after a
  random pause of up to 1 s so that the line falls at a random phase of the
  daemon's polling (without it, a restart right after the daemon's read would
  always wait a full interval);
- **guest API requests/s** (first stage only, so the daemon is quiet): this
  process sends ``GET /1.0`` to the daemon's guest API as an agent does
  (the instance's client certificate, the daemon's pinned, a new connection
  per request; here from twisted.web: ``PinnedServerTLS`` over
  ``HybridVSockClientEndpoint``), and the same to a bare Twisted server in its own child process
  (``--role bare``): a plain ``twisted.web`` ``Site`` answering the daemon's
  ``GET /1.0`` body bytes, behind ``MutualServerTLS`` with the daemon's
  certificate (accepting exactly that client certificate) on the same hybrid
  vsock transport, logging to a file as the daemon does.  With 1 and
  ``--rps-concurrency`` requests in flight, ``--rps-rounds`` rounds of
  ``--rps-seconds`` per server (each after a 0.5 s warm-up), alternating
  between the two so that a passing load on this shared machine does not
  favour one side; the median round is shown, and the ratio daemon / bare of
  the medians.  CPU use of server and client over the round says which side
  was the limit.

Everything started here (host, daemon, agent workers, bare server, the
directory under /tmp) is torn down at the end.  Figures only: nothing here
passes or fails.

    .venv/bin/python benchmarks/ready.py            # 1, 100 and 1,000 instances
    .venv/bin/python benchmarks/ready.py --quick    # 1, 10 and 40, short windows
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence

import attrs
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import wrapClientTLS
from twisted.logger import LogLevel, globalLogPublisher
from twisted.web.client import Agent, readBody
from twisted.web.iweb import IAgent

from benchmarks._bareserver import bare_site
from benchmarks._children import Children, log_to, serve_control
from benchmarks._fleet import (
    CREATE_CONCURRENCY,
    EVENT_TIMEOUT,
    Fleet,
    OneEndpoint,
    create_all,
    devlxd_socket,
    find_drives,
    notify,
    p50_p99,
    plural,
    run_parent,
    run_roles,
    start_agents,
    teardown,
    timed_ready,
)
from benchmarks._measure import cpu_seconds, reactor, report, show_problems, sleep
from vmready.agentlink import (
    HybridVSockAddress,
    HybridVSockClientEndpoint,
    HybridVSockServerEndpoint,
    PollIntervals,
)
from vmready.daemon import Options
from vmready.domain import raise_file_limit
from vmready.trust import CertificatePair, PinnedServerTLS

SCRIPT = os.path.abspath(__file__)
# Seconds, at most, of random pause before an agent is stopped or started in a cycle.
PHASE_JITTER = 1.0

DEFAULT_POLL = PollIntervals()


# -- the bare TLS server child -------------------------------------------------------


def run_bare(directory: str) -> None:
    """``--role bare``: a plain twisted.web Site behind the daemon's mutual TLS, nothing else."""
    raise_file_limit()
    log_to(os.path.join(directory, "bare-server.log"), LogLevel.info)

    async def serve(data_dir: str, client_cert: str, body: str, path: str) -> int:
        factory = bare_site(data_dir, client_cert, body.encode("utf-8"))
        port = await HybridVSockServerEndpoint(reactor, path).listen(factory)
        address = port.getHost()
        assert isinstance(address, HybridVSockAddress)
        return address.port

    serve_control({"serve": serve})
    reactor.run()


def guest_api_client(drive: str, socket_base: str, port: int) -> IAgent:
    """The guest API at hybrid vsock ``socket_base``/``port``, with the drive's client pair."""
    with (
        open(os.path.join(drive, "agent.crt"), "rb") as c,
        open(os.path.join(drive, "agent.key"), "rb") as k,
        open(os.path.join(drive, "server.crt"), "rb") as s,
    ):
        tls = PinnedServerTLS(CertificatePair(c.read(), k.read()), s.read())
    endpoint = wrapClientTLS(tls, HybridVSockClientEndpoint(reactor, socket_base, port))
    client: IAgent = Agent.usingEndpointFactory(reactor, OneEndpoint(endpoint))
    return client


async def get_state(client: IAgent) -> tuple[int, bytes]:
    """``GET /1.0`` on a new connection: the status and the body."""
    response = await client.request(b"GET", b"http://vmready-host/1.0")
    return response.code, await readBody(response)


@attrs.define
class Bench(Fleet):
    """Everything the stages share: the fleet, and the instances of the stages so far."""

    names: list[str] = attrs.field(factory=list)
    ready: set[str] = attrs.field(factory=set)
    summary: list[str] = attrs.field(factory=list)

    def say(self, line: str, summary: bool = False) -> None:
        """Print a figure (and keep it for the summary)."""
        report(line)
        if summary:
            self.summary.append(line.removeprefix("  "))

    def socket_of(self, name: str) -> str:
        """The devlxd socket of ``name``'s agent."""
        return devlxd_socket(self.drives[name])


async def grow(bench: Bench, count: int) -> None:
    """Create instances up to ``count``, start their agents, wait until all are CONNECTED."""
    new = [f"r{index}" for index in range(len(bench.names), count)]
    if not new:
        return
    started = time.perf_counter()
    await create_all(bench.client, new)
    created = time.perf_counter() - started
    bench.drives.update(find_drives(bench.data_dir))
    connected_before = list(bench.names)
    bench.names.extend(new)
    started = time.perf_counter()
    await start_agents(
        bench.workers, bench.worker_of, bench.drives, bench.watch, new, connected_before
    )
    connected = time.perf_counter() - started
    statuses = Counter(
        str((instance.get("agent") or {}).get("status"))
        for instance in await bench.client.get("/1.0/instances?recursion=1")
    )
    report(
        f"  set-up:       {plural(len(new), 'instance')} created (ACTIVE) in {created:.1f} s "
        f"({CREATE_CONCURRENCY} in flight); their agents started and CONNECTED in "
        f"{connected:.1f} s; the daemon's agent statuses now: {dict(statuses)}"
    )


# -- the parent: measurements ----------------------------------------------------------


async def measure_reads(bench: Bench, count: int) -> None:
    """Ring-buffer reads per second over a quiet window, from the daemon's counters."""
    window = bench.args.reads_window
    daemon_cpu, host_cpu = cpu_seconds(bench.daemon.pid), cpu_seconds(bench.host.pid)
    before = await bench.daemon.call("reads")
    await sleep(window)
    after = await bench.daemon.call("reads")
    daemon_cpu = cpu_seconds(bench.daemon.pid) - daemon_cpu
    host_cpu = cpu_seconds(bench.host.pid) - host_cpu
    seconds = after["at"] - before["at"]
    rate = (after["reads"] - before["reads"]) / seconds
    bench.say(
        f"  ring-buffer reads, {plural(count, 'instance')}: {rate:.1f} ringbuf-reads/s at "
        f"steady state (sum of AgentMonitor.reads over {seconds:.1f} s; "
        f"{plural(after['monitors'], 'monitor')}, "
        f"agents {after['statuses']}; {count / DEFAULT_POLL.safety:.1f}/s is one safety read "
        f"per {DEFAULT_POLL.safety:g} s each)",
        summary=count == bench.args.counts[-1],
    )
    bench.say(
        f"  CPU over that window: daemon {100 * daemon_cpu / seconds:.1f}%, fakeqemu-host "
        f"{100 * host_cpu / seconds:.1f}% of one CPU",
        summary=count == bench.args.counts[-1],
    )


async def set_state(bench: Bench, name: str, state: str) -> None:
    """The guest program's PATCH, untimed."""
    await notify(bench.socket_of(name), state, EVENT_TIMEOUT)
    if state == "Ready":
        bench.ready.add(name)
    else:
        bench.ready.discard(name)


async def one_ready(bench: Bench, name: str) -> tuple[float, float]:
    """One timed Ready: (PATCH sent → wait client's event, PATCH sent → PATCH answered)."""
    timed = await timed_ready(bench.client, name, bench.socket_of(name))
    bench.ready.add(name)
    return timed


async def measure_ready(bench: Bench, count: int) -> None:
    """Ready latency with every instance of the stage connected: one PATCH at a time."""
    for name in sorted(bench.ready):
        await set_state(bench, name, "Started")
    events: list[float] = []
    answers: list[float] = []
    if count == 1:
        plan = [bench.names[0]] * bench.args.single_repeats
        how = f"{len(plan)} PATCHes of the one instance, one at a time, an untimed Started between"
    else:
        plan = list(bench.names[:count])
        how = f"{len(plan)} PATCHes, one per instance, one at a time"
    for index, name in enumerate(plan):
        if name in bench.ready:
            await set_state(bench, name, "Started")
        try:
            to_event, to_answer = await one_ready(bench, name)
        except Exception as e:  # one failed PATCH is reported, not fatal
            report(f"  PATCH {index} ({name}) failed: {type(e).__name__}: {e}")
            continue
        events.append(to_event)
        answers.append(to_answer)
    bench.say(
        f"  ready latency, {plural(count, 'instance')}: {p50_p99(events)} "
        f"(guest PATCH to the agent socket sent → Ready event at a waiting `wait` client; {how})",
        summary=True,
    )
    bench.say(f"    the PATCH's own answer at the guest: {p50_p99(answers)}")


@attrs.define
class Detections:
    """Status line written → ``instance-agent-<status>`` event arrived, per status."""

    stopped: list[float] = attrs.field(factory=list)
    started: list[float] = attrs.field(factory=list)
    connected: list[float] = attrs.field(factory=list)


async def cycle(bench: Bench, name: str, found: Detections) -> None:
    """Stop ``name``'s agent, wait for the daemon to see it, start it again; three samples."""
    worker = bench.worker_of[name]
    # A random pause before each change, so the line falls at a random phase of the polling.
    await sleep(random.uniform(0.0, PHASE_JITTER))
    stopped_event = bench.watch.expect(name, "instance-agent-stopped")
    written = await worker.call("stop_agent", name=name)
    found.stopped.append(await stopped_event - written["stopped"])
    started_event = bench.watch.expect(name, "instance-agent-started")
    connected_event = bench.watch.expect(name, "instance-agent-connected")
    await sleep(random.uniform(0.0, PHASE_JITTER))
    written = await worker.call("start_agent", name=name)
    found.started.append(await started_event - written["started"])
    found.connected.append(await connected_event - written["connected"])


async def measure_detection(bench: Bench, count: int) -> None:
    """Agent-status detection latency over ``--cycles`` stop/start cycles."""
    cycles = bench.args.cycles
    found = Detections()
    if count == 1:
        for _ in range(cycles):
            await cycle(bench, bench.names[0], found)
        how = f"{cycles} stop/start cycles of the one agent, one at a time"
    else:
        step = max(1, count // cycles)
        chosen = bench.names[:count][::step][:cycles]
        wave = bench.args.wave
        for offset in range(0, len(chosen), wave):
            await gatherResults(
                [
                    Deferred.fromCoroutine(cycle(bench, name, found))
                    for name in chosen[offset : offset + wave]
                ]
            )
        how = f"{len(chosen)} stop/start cycles of different agents, {wave} at a time"
    poll = DEFAULT_POLL
    bench.say(
        f"  agent-status detection, {plural(count, 'instance')} ({how}): "
        "status line written → event at an operator API event stream",
        summary=True,
    )
    bench.say(
        f"    instance-agent-stopped:   {p50_p99(found.stopped)} "
        "(read on its port's VSERPORT_CHANGE)",
        summary=True,
    )
    bench.say(
        f"    instance-agent-started:   {p50_p99(found.started)} "
        "(read on its port's VSERPORT_CHANGE)",
        summary=True,
    )
    bench.say(
        f"    instance-agent-connected: {p50_p99(found.connected)} "
        f"(on VSERPORT_CHANGE; follow-ups from {poll.follow_up:g} s after a CONNECT)",
        summary=True,
    )


@attrs.define
class Throughput:
    """Requests completed in a window, and the CPU both sides used."""

    requests: int
    errors: int
    seconds: float
    server_cpu: float
    client_cpu: float

    @property
    def rate(self) -> float:
        """Requests per second."""
        return self.requests / self.seconds

    def describe(self) -> str:
        """``N req/s (server x% CPU, client y%)``."""
        errors = f", {self.errors} errors" if self.errors else ""
        return (
            f"{self.rate:.0f} req/s (server {100 * self.server_cpu / self.seconds:.0f}% of a CPU, "
            f"this client {100 * self.client_cpu / self.seconds:.0f}%{errors})"
        )


async def hammer(agent: IAgent, seconds: float, concurrency: int, server_pid: int) -> Throughput:
    """``GET /1.0`` through ``agent`` (a new connection per request) for ``seconds``."""
    done = [0, 0]
    deadline = time.perf_counter() + seconds

    async def loop() -> None:
        while time.perf_counter() < deadline:
            try:
                code, _ = await get_state(agent)
            except Exception:  # counted, not fatal
                done[1] += 1
                continue
            done[0 if code == 200 else 1] += 1

    server_cpu, client_cpu = cpu_seconds(server_pid), cpu_seconds(os.getpid())
    started = time.perf_counter()
    await gatherResults([Deferred.fromCoroutine(loop()) for _ in range(concurrency)])
    elapsed = time.perf_counter() - started
    return Throughput(
        done[0],
        done[1],
        elapsed,
        cpu_seconds(server_pid) - server_cpu,
        cpu_seconds(os.getpid()) - client_cpu,
    )


async def measure_guest_api(bench: Bench) -> None:
    """Guest API GET /1.0 per second, daemon against a bare Twisted TLS server."""
    name = bench.names[0]
    drive = bench.drives[name]
    with open(os.path.join(drive, "agent.json")) as f:
        daemon_base = str(json.load(f)["transport"]).removeprefix("hvsock:")
    daemon_agent = guest_api_client(drive, daemon_base, bench.guest_port)
    _, body = await get_state(daemon_agent)
    bare = bench.children.spawn_role("bare-server", "bare", bench.directory)
    try:
        bare_path = os.path.join(bench.directory, "bare.sock")
        bare_port = await bare.call(
            "serve",
            data_dir=bench.data_dir,
            client_cert=os.path.join(drive, "agent.crt"),
            body=body.decode("utf-8"),
            path=bare_path,
        )
        bare_agent = guest_api_client(drive, bare_path, bare_port)
        _, bare_body = await get_state(bare_agent)
        same = bare_body == body
        seconds, rounds = bench.args.rps_seconds, bench.args.rps_rounds
        bench.say(
            f"  guest API GET /1.0, one mutual-TLS connection per request (as the agent "
            f"connects); the bare server answers {'the same' if same else 'DIFFERENT'} "
            f"{len(body)} body bytes; {rounds} rounds of {seconds:g} s per server, alternating, "
            f"each after a 0.5 s warm-up; median round (CPU of that round), range:",
            summary=True,
        )
        servers = (
            ("vmready daemon", daemon_agent, bench.daemon.pid),
            ("bare Twisted TLS Site", bare_agent, bare.pid),
        )
        for concurrency in sorted({1, bench.args.rps_concurrency}):
            results: list[list[Throughput]] = [[] for _ in servers]
            for _ in range(rounds):
                for (_, agent, pid), mine in zip(servers, results, strict=True):
                    await hammer(agent, 0.5, concurrency, pid)
                    mine.append(await hammer(agent, seconds, concurrency, pid))
            medians = []
            for (server, _, _), mine in zip(servers, results, strict=True):
                ordered = sorted(mine, key=lambda result: result.rate)
                median = ordered[(len(ordered) - 1) // 2]
                medians.append(median.rate)
                bench.say(
                    f"    {concurrency} in flight, {server + ':':23} {median.describe()}, "
                    f"range {ordered[0].rate:.0f}-{ordered[-1].rate:.0f} req/s",
                    summary=True,
                )
            bench.say(
                f"    {concurrency} in flight, ratio daemon/bare:   {medians[0] / medians[1]:.2f}",
                summary=True,
            )
    finally:
        await bare.terminate()


# -- the parent: the run -------------------------------------------------------------


async def run(args: argparse.Namespace, children: Children, directory: str) -> list[str]:
    """All stages, in order; the summary lines."""
    bench: Bench | None = None
    try:
        bench = await Bench.start(args, children, directory)
        poll = DEFAULT_POLL
        report(
            f"vmready ready benchmark: fakeqemu, {os.cpu_count()} CPUs, counts "
            f"{', '.join(str(c) for c in args.counts)}; daemon pid {bench.daemon.pid} "
            f"(VMReadyService as twistd builds it, default options: agent link reads on "
            f"VSERPORT_CHANGE, safety read every {poll.safety:g} s, power sync every "
            f"{Options()['power-sync-interval']} s); fakeqemu-host pid {bench.host.pid}; "
            f"{len(bench.workers)} agent worker processes (default heartbeat and retries)"
        )
        for count in args.counts:
            report(f"\n{plural(count, 'instance')}")
            await grow(bench, count)
            await sleep(1.0)
            await measure_reads(bench, count)
            await measure_ready(bench, count)
            await measure_detection(bench, count)
            if count == args.counts[0]:
                await measure_guest_api(bench)
    finally:
        await teardown(bench, children, directory)
    return bench.summary


def counts(text: str) -> list[int]:
    """``1,100,1000`` as an increasing list of counts."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of counts: {text!r}") from None
    if not values or min(values) < 1 or values != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"counts must be increasing and 1 or more: {text!r}")
    return values


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` changes the defaults."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small counts and short windows")
    parser.add_argument("--counts", type=counts, help="instance counts (default 1,100,1000)")
    parser.add_argument("--agent-workers", type=int, default=2, help="agent processes (2)")
    parser.add_argument("--single-repeats", type=int, help="PATCHes with 1 instance (50)")
    parser.add_argument("--cycles", type=int, help="agent stop/start cycles per stage (20)")
    parser.add_argument("--wave", type=int, default=10, help="cycles at once (10)")
    parser.add_argument("--reads-window", type=float, help="seconds of read counting (10)")
    parser.add_argument("--rps-seconds", type=float, help="seconds per guest API round (4)")
    parser.add_argument("--rps-concurrency", type=int, default=8, help="requests in flight (8)")
    parser.add_argument("--rps-rounds", type=int, help="alternating rounds per server (3)")
    parser.add_argument("--keep", action="store_true", help="keep the directory and its logs")
    parser.add_argument("--role", choices=("daemon", "agents", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("role_directory", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "counts": [1, 10, 40] if quick else [1, 100, 1000],
        "single_repeats": 10 if quick else 50,
        "cycles": 5 if quick else 20,
        "reads_window": 3.0 if quick else 10.0,
        "rps_seconds": 2.0 if quick else 4.0,
        "rps_rounds": 1 if quick else 3,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Run the benchmark (or, with ``--role``, one of its child processes)."""
    args = parse(argv)
    if run_roles(args.role, args.role_directory, {"bare": run_bare}):
        return
    raise_file_limit()
    globalLogPublisher.addObserver(show_problems)
    started = time.perf_counter()
    summary, code = run_parent(
        SCRIPT, "vmrr-", args.keep, lambda children, directory: run(args, children, directory)
    )
    if summary:
        report("\nsummary")
        for line in summary:
            report(f"  {line}")
    report(f"\ntotal: {time.perf_counter() - started:.0f} s")
    sys.exit(code)


if __name__ == "__main__":
    main()
