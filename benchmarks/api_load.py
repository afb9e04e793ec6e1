"""Load held: many clients on the operator API of one daemon or of a cluster, for minutes.

    .venv/bin/python benchmarks/api_load.py --clients 200 --instances 1000 --members 1
    .venv/bin/python benchmarks/api_load.py --clients 200 --instances 1000 --members 3

One ``fakeqemu-host`` runs every VM in one process; ``--instances`` instances
are launched through the API (16 at a time) on one ``twistd vmready`` daemon
(``--members 1``: SQLite, a single host) or on a cluster of real members on a
PostgreSQL server of its own (``--members 3``, as ``benchmarks/cluster.py``
runs them: ``benchmarks._clusterworld``).  Then ``--clients`` clients run for
``--seconds`` (default 300), each bound to one member (chosen at random), each
on its own connections to that member's unix socket (``vmready.cli.client``,
what the CLI uses: a connection per request), shared among
``--client-processes`` processes (4), each with its own reactor, as real
clients are processes of their own: 200 clients on one reactor kept it
busy, and an answer that came while it was busy was timed late (how late
the clients' reactors ran is shown: ``clients' reactors late``):

- a ``--streams`` share of them (default 0.1) hold a ``/1.0/events`` stream
  each, opened again every ``--stream-seconds`` (30): they count the events
  they read and the streams refused or cut;
- the others loop: a pause drawn from an exponential of mean ``--think``
  seconds (1.0: 200 clients offer about 200 requests a second, an open load
  rather than as many as the daemon can take), then one request: an instance
  ``GET`` (85 %), ``GET /1.0/instances?recursion=1`` (10 %) or a state change
  (5 %: ``freeze`` or ``unfreeze`` of one of its own instances, each client
  acting on instances no other client touches, so a 409 is its own doing).
  Each request is timed from sending to the end of its answer.  A list's
  answer is read whole but not decoded: with 1,000 instances it is 1.2 MB
  of JSON, and decoding it in the clients' one process (a single reactor,
  on the daemon's cores) took most of that process's time and delayed the
  timing of every other request.

A request that gets anything but a 2xx is an **error**, unless it is a limit
answer the API documents (429 or 503 ``Too many connections …``: **limited**)
or a 409 to a state change (the instance was still busy with the client's
own previous change: **conflicts**).  The daemon's RSS (``VmRSS``; the largest
member's in a cluster) is read every 5 s: its value after the first minute
(the first fifth of a shorter run) and at the end are shown, and the growth
between them.

Figures only; nothing passes or fails.  The last line is exactly
``clients=… rps=… p50_ms=… p99_ms=… errors=… rss_mb=…``: requests per
second, the p50 and p99 of every request's time, the errors, the RSS at the
end.  Lines before it give each kind's figures, the limited answers, the
conflicts, the events read, the RSS over time, how late the clients'
reactors ran (a tick every 20 ms) and each process's share of a core while
the clients ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs
from twisted.internet.defer import CancelledError, Deferred, TimeoutError, gatherResults
from twisted.internet.task import LoopingCall
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import SkipTest

from benchmarks._clusterworld import Cluster
from benchmarks._fleet import create_all
from benchmarks._measure import (
    cpu_seconds,
    nearest_rank,
    react,
    reactor,
    report,
    sleep,
    status_kib,
)
from benchmarks.crash import Daemon
from benchmarks.lifecycle import Processes, start_host
from tests.postgres import postgres_server
from vmready.cli import APIError, Client, CommandError, LineStream, instance_path
from vmready.domain import raise_file_limit

REQUEST_TIMEOUT = 60.0
RSS_SECONDS = 5.0
LAG_TICK = 0.02
# Processes the clients are shared among by default: real clients are processes of their
# own, and 200 on one reactor ran it late by 13-17 ms at p99, 4 by 7 ms (``Lag``).
CLIENT_PROCESSES = 4
LIMIT_ANSWER = "Too many connections"
KINDS = ("get", "list", "state")
WEIGHTS = (85, 10, 5)


@attrs.define
class Figures:
    """What the clients saw."""

    times: dict[str, list[float]] = attrs.field(factory=lambda: {kind: [] for kind in KINDS})
    errors: Counter[str] = attrs.field(factory=Counter)
    limited: int = 0
    conflicts: int = 0
    events: int = 0
    streams_opened: int = 0
    streams_failed: int = 0

    def error(self, what: str) -> None:
        # A broken connection's reason is a list of Failure reprs: keep what each one says.
        said = what.replace("[Failure instance: Traceback (failure with no frames): ", "")
        self.errors[said[:200]] += 1


@attrs.define
class Target:
    """A daemon the clients talk to: its client, its process, its instances."""

    label: str
    client: Client
    pid: int
    socket: str


class Load:
    """The clients, each a loop on the reactor until ``deadline``."""

    def __init__(
        self, targets: Sequence[Target], names: Sequence[str], args: Any, share: int = 0
    ) -> None:
        self.targets = targets
        self.names = list(names)
        self.args = args
        # Which of the ``--client-processes`` processes this is: it runs every client
        # whose index is ``share`` modulo their number.
        self.share = share
        self.figures = Figures()
        self.deadline = 0.0

    async def run(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        streams = round(self.args.clients * self.args.streams)
        requesters = self.args.clients - streams
        # Each requester its own instances for its state changes (none if there are too few).
        shares = [self.names[index::requesters] for index in range(requesters)]
        loops = []
        for index in range(self.share, self.args.clients, self.args.client_processes):
            rng = random.Random(f"{self.args.seed}-{index}")
            target = rng.choice(self.targets)
            if index < streams:
                loops.append(Deferred.fromCoroutine(self.stream(rng, target)))
            else:
                mine = shares[index - streams]
                loops.append(Deferred.fromCoroutine(self.requests(rng, target, mine)))
        await gatherResults(loops)

    async def requests(self, rng: random.Random, target: Target, mine: list[str]) -> None:
        frozen: set[str] = set()
        while True:
            await sleep(rng.expovariate(1 / self.args.think))
            if time.monotonic() >= self.deadline:
                return
            kind = rng.choices(KINDS, WEIGHTS)[0]
            if kind == "state" and not mine:
                kind = "get"
            if kind == "get":
                await self.timed(kind, target, "GET", instance_path(rng.choice(self.names)))
            elif kind == "list":
                await self.timed(kind, target, "GET", "/1.0/instances?recursion=1", decoded=False)
            else:
                name = rng.choice(mine)
                action = "unfreeze" if name in frozen else "freeze"
                body = {"action": action}
                path = instance_path(name, "state")
                if await self.timed(kind, target, "PUT", path, body):
                    frozen.symmetric_difference_update({name})

    async def timed(
        self,
        kind: str,
        target: Target,
        method: str,
        path: str,
        body: Any = None,
        decoded: bool = True,
    ) -> bool:
        """One request, timed; whether it was answered 2xx (``decoded``: its JSON read too)."""
        sent = time.perf_counter()
        client = target.client
        call = client.request(method, path, body) if decoded else client.get_raw(path)
        try:
            request = Deferred.fromCoroutine(call)
            await request.addTimeout(REQUEST_TIMEOUT, reactor)
        except APIError as e:
            if e.code in (429, 503) and e.error.startswith(LIMIT_ANSWER):
                self.figures.limited += 1
            elif e.code == 409 and kind == "state":
                self.figures.conflicts += 1
            else:
                self.figures.error(f"{kind} {e.code} {e.error}")
            return False
        except (CommandError, CancelledError, TimeoutError) as e:
            self.figures.error(f"{kind} {type(e).__name__} {e}")
            return False
        self.figures.times[kind].append(time.perf_counter() - sent)
        return True

    async def stream(self, rng: random.Random, target: Target) -> None:
        """Hold an event stream, opened again every ``--stream-seconds``."""
        await sleep(rng.uniform(0, self.args.think))
        while time.monotonic() < self.deadline:
            opened: LineStream | None = None
            try:
                opened = await target.client.events(["lifecycle", "operation"], self.counted)
                self.figures.streams_opened += 1
            except APIError as e:
                if e.code in (429, 503) and e.error.startswith(LIMIT_ANSWER):
                    self.figures.limited += 1
                else:
                    self.figures.error(f"stream {e.code} {e.error}")
            except CommandError as e:
                self.figures.error(f"stream {e}")
            hold = min(self.args.stream_seconds, self.deadline - time.monotonic())
            ended = opened.ended if opened is not None else None
            await sleep(max(0.0, hold))
            if opened is not None:
                if ended is not None and ended.called:
                    self.figures.streams_failed += 1
                opened.close()

    def counted(self, event: dict[str, Any]) -> None:
        self.figures.events += 1


class Lag:
    """How late the clients' own reactor runs: a tick every ``LAG_TICK`` s, its lateness kept.

    Every time is taken on that reactor, so a request answered while it was
    busy is timed late by as much: this lateness is what the clients' one
    process adds to the figures, not the daemon.
    """

    def __init__(self) -> None:
        self.late: list[float] = []
        self.due = 0.0
        self.loop = LoopingCall(self.tick)
        self.loop.clock = reactor

    def start(self) -> None:
        self.due = time.monotonic()
        self.loop.start(LAG_TICK)

    def tick(self) -> None:
        now = time.monotonic()
        if self.due:
            self.late.append(max(0.0, now - self.due))
        self.due = now + LAG_TICK


class CPU:
    """Each process's CPU time over the clients' run, as a share of one core."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.began = time.monotonic()
        self.first = self.read()

    def read(self) -> dict[str, float]:
        seconds = {}
        for label, pid in self.pids.items():
            with contextlib.suppress(OSError):
                seconds[label] = cpu_seconds(pid)
        return seconds

    def shares(self) -> dict[str, float]:
        elapsed = time.monotonic() - self.began
        last = self.read()
        return {
            label: (last[label] - self.first[label]) / elapsed
            for label in last
            if label in self.first
        }


class RSS:
    """The largest ``VmRSS`` among the daemons, every few seconds."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.samples: list[tuple[float, float]] = []
        self.started = time.monotonic()
        self.loop = LoopingCall(self.sample)
        self.loop.clock = reactor

    def sample(self) -> None:
        largest = 0.0
        for pid in self.pids:
            with contextlib.suppress(OSError, RuntimeError):
                largest = max(largest, status_kib(pid, "VmRSS") / 1024)
        self.samples.append((time.monotonic() - self.started, largest))

    def at(self, seconds: float) -> float:
        """The first sample at or after ``seconds`` into the run (the last one if none)."""
        for when, rss in self.samples:
            if when >= seconds:
                return rss
        return self.samples[-1][1]


def percentile_ms(samples: Sequence[float], fraction: float) -> float:
    return nearest_rank(samples, fraction) * 1000 if samples else float("nan")


async def start_targets(
    args: Any, root: str, environment: dict[str, str]
) -> tuple[list[Target], Cluster | None]:
    """The daemon, or the cluster's members, serving."""
    if args.members == 1:
        data_dir = os.path.join(root, "daemon")
        os.makedirs(data_dir)
        daemon = Daemon(data_dir, 0, (), environment)
        path = os.path.join(data_dir, "vmready.sock")
        client = Client(reactor, path)
        await daemon.recovered(client)
        return [Target("daemon", client, daemon.process.pid, path)], None
    try:
        server = postgres_server()
    except SkipTest as e:
        raise SystemExit(f"api_load: {e}") from None
    database = server.create_database(migrated=True)
    names = [f"m{index + 1}" for index in range(args.members)]
    cluster = Cluster(root, server, database, names, 15.0, environment=environment)
    await cluster.start()
    targets = [
        Target(i.label, i.client, i.pid, os.path.join(i.data_dir, "vmready.sock"))
        for i in cluster.live()
    ]
    return targets, cluster


async def run(args: argparse.Namespace, root: str, processes: Processes, out: list[str]) -> None:
    _, control = await start_host(processes, root)
    environment = {**os.environ, "FAKEQEMU_HOST": control}
    environment.pop("FAKEQEMU_GUEST_DIR", None)
    cluster: Cluster | None = None
    try:
        began = time.monotonic()
        targets, cluster = await start_targets(args, root, environment)
        names = instance_names(args.instances)
        await create_all(targets[0].client, names)
        report(
            f"members={args.members} instances={args.instances} "
            f"launched after {time.monotonic() - began:.1f}s"
        )
        rss = RSS([target.pid for target in targets])
        rss.loop.start(RSS_SECONDS)
        if args.client_processes == 1:
            ran = await run_here(args, targets, names)
        else:
            ran = await run_in_processes(args, targets)
        rss.sample()
        rss.loop.stop()
        out.extend(summary(args, ran, rss))
    finally:
        if cluster is not None:
            cluster.kill_all()
            with contextlib.suppress(Exception):
                cluster.server.drop_database(cluster.database)


@attrs.define
class Ran:
    """What the clients saw, how late their reactors ran, each process's share of a core."""

    figures: Figures
    late: list[float]
    elapsed: float
    cpu: dict[str, float]


def instance_names(count: int) -> list[str]:
    """The instances the benchmark launches, by name."""
    return [f"vm{index:04d}" for index in range(count)]


async def run_share(
    args: Any, targets: Sequence[Target], names: Sequence[str], share: int
) -> tuple[Figures, list[float], float]:
    """Clients ``share`` modulo ``--client-processes``, on this process's reactor, timed.

    What they saw, how late the reactor ran, and how long they ran.
    """
    lag = Lag()
    lag.start()
    load = Load(targets, names, args, share)
    started = time.monotonic()
    await load.run(args.seconds)
    elapsed = time.monotonic() - started
    lag.loop.stop()
    return load.figures, lag.late, elapsed


async def run_here(args: Any, targets: Sequence[Target], names: Sequence[str]) -> Ran:
    """Every client on this process's reactor."""
    cpu = CPU({**{target.label: target.pid for target in targets}, "clients": os.getpid()})
    figures, late, elapsed = await run_share(args, targets, names, 0)
    return Ran(figures, late, elapsed, cpu.shares())


async def run_in_processes(args: Any, targets: Sequence[Target]) -> Ran:
    """The clients shared among ``--client-processes`` processes, each with its own reactor.

    Each runs this script with ``--worker K`` (its share: every client whose
    index is K modulo their number, drawing what it does from the same seed as
    in one process) and prints what its clients saw as one JSON line.
    """
    cpu = CPU({target.label: target.pid for target in targets})
    common = [
        *("--clients", str(args.clients), "--seconds", f"{args.seconds:g}"),
        *("--instances", str(args.instances), "--think", f"{args.think:g}"),
        *("--streams", f"{args.streams:g}", "--stream-seconds", f"{args.stream_seconds:g}"),
        *("--seed", str(args.seed), "--client-processes", str(args.client_processes)),
        *[argument for target in targets for argument in ("--socket", target.socket)],
    ]
    workers = [
        getProcessOutputAndValue(
            sys.executable, [__file__, "--worker", str(share), *common], env=dict(os.environ)
        )
        for share in range(args.client_processes)
    ]
    figures, late, elapsed, busy = Figures(), [], [], 0.0
    for output, errors, code in await gatherResults(workers):
        if code != 0:
            raise SystemExit(f"api_load: a client process failed ({code}):\n{errors.decode()}")
        document = json.loads(output.decode().splitlines()[-1])
        merge(figures, document["figures"])
        late.extend(document["late"])
        elapsed.append(document["elapsed"])
        busy += document["cpu_seconds"]
    mean_elapsed = statistics.mean(elapsed)
    shares = {**cpu.shares(), "clients": busy / mean_elapsed}
    return Ran(figures, late, mean_elapsed, shares)


def merge(figures: Figures, document: dict[str, Any]) -> None:
    """Add what one client process saw (``figures_json``) to ``figures``."""
    for kind in KINDS:
        figures.times[kind].extend(document["times"][kind])
    figures.errors.update(document["errors"])
    figures.limited += document["limited"]
    figures.conflicts += document["conflicts"]
    figures.events += document["events"]
    figures.streams_opened += document["streams_opened"]
    figures.streams_failed += document["streams_failed"]


def figures_json(figures: Figures) -> dict[str, Any]:
    """``figures`` as one client process tells them (``merge`` reads them)."""
    return {
        "times": figures.times,
        "errors": dict(figures.errors),
        "limited": figures.limited,
        "conflicts": figures.conflicts,
        "events": figures.events,
        "streams_opened": figures.streams_opened,
        "streams_failed": figures.streams_failed,
    }


async def work(args: Any, out: list[str]) -> None:
    """One client process: its share of the clients, on the daemons' sockets given."""
    targets = [
        Target(f"t{index}", Client(reactor, path), 0, path)
        for index, path in enumerate(args.socket)
    ]
    began_cpu = cpu_seconds(os.getpid())
    figures, late, elapsed = await run_share(
        args, targets, instance_names(args.instances), args.worker
    )
    document = {
        "figures": figures_json(figures),
        "late": late,
        "elapsed": elapsed,
        "cpu_seconds": cpu_seconds(os.getpid()) - began_cpu,
    }
    out.append(json.dumps(document))


def summary(args: Any, ran: Ran, rss: RSS) -> list[str]:
    """The figures' lines, the last one the one line the run is known by."""
    figures, elapsed, late_ones = ran.figures, ran.elapsed, ran.late
    lines = []
    every = [t for times in figures.times.values() for t in times]
    for kind in KINDS:
        times = figures.times[kind]
        lines.append(
            f"{kind}: requests={len(times)} p50_ms={percentile_ms(times, 0.5):.1f} "
            f"p99_ms={percentile_ms(times, 0.99):.1f} "
            f"max_ms={max(times, default=float('nan')) * 1000:.1f}"
        )
    lines.append(
        f"limited={figures.limited} conflicts={figures.conflicts} events={figures.events} "
        f"streams_opened={figures.streams_opened} streams_cut={figures.streams_failed}"
    )
    for what, count in figures.errors.most_common(5):
        lines.append(f"  error x{count}: {what}")
    first = min(60.0, elapsed / 5)
    early, late = rss.at(first), rss.samples[-1][1]
    growth = (late - early) / early * 100 if early else float("nan")
    sizes = [size for _, size in rss.samples]
    lines.append(
        f"rss_mb after {first:.0f}s={early:.1f} at the end={late:.1f} growth_pct={growth:.1f} "
        f"max={max(sizes):.1f} mean={statistics.mean(sizes):.1f}"
    )
    lines.append(
        f"clients' reactors late: processes={args.client_processes} "
        f"p50_ms={percentile_ms(late_ones, 0.5):.1f} p99_ms={percentile_ms(late_ones, 0.99):.1f} "
        f"max_ms={max(late_ones, default=float('nan')) * 1000:.1f}"
    )
    lines.append(
        "cpu_cores " + " ".join(f"{label}={share:.2f}" for label, share in ran.cpu.items())
    )
    lines.append(
        f"clients={args.clients} rps={len(every) / elapsed:.1f} "
        f"p50_ms={percentile_ms(every, 0.5):.1f} p99_ms={percentile_ms(every, 0.99):.1f} "
        f"errors={sum(figures.errors.values())} rss_mb={late:.1f}"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Launch the instances, run the clients, print the figures and the one line last."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--members", type=int, default=1, choices=(1, 2, 3))
    parser.add_argument("--think", type=float, default=1.0, help="mean seconds between requests")
    parser.add_argument("--streams", type=float, default=0.1, help="share of stream clients")
    parser.add_argument("--stream-seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--client-processes",
        type=int,
        default=CLIENT_PROCESSES,
        help="processes the clients are shared among (1: all on this one)",
    )
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--socket", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        out: list[str] = []
        react(lambda: work(args, out), out, lambda: None)
        return
    if args.clients < 1 or args.instances < 1 or args.seconds <= 0 or args.client_processes < 1:
        parser.error(
            "--clients, --instances and --client-processes must be at least 1, "
            "--seconds more than 0"
        )
    raise_file_limit()
    root = tempfile.mkdtemp(prefix="vmal-", dir="/tmp")
    processes = Processes()
    lines: list[str] = []

    def cleanup() -> None:
        Daemon.kill_all()
        processes.kill_all()
        shutil.rmtree(root, ignore_errors=True)

    react(lambda: run(args, root, processes, lines), lines, cleanup)


if __name__ == "__main__":
    main()
