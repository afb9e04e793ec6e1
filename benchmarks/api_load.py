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
what the CLI uses: a connection per request):

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
conflicts, the events read and the RSS over time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs
from twisted.internet.defer import CancelledError, Deferred, TimeoutError, gatherResults
from twisted.internet.task import LoopingCall
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


class Load:
    """The clients, each a loop on the reactor until ``deadline``."""

    def __init__(self, targets: Sequence[Target], names: Sequence[str], args: Any) -> None:
        self.targets = targets
        self.names = list(names)
        self.args = args
        self.figures = Figures()
        self.deadline = 0.0

    async def run(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        streams = round(self.args.clients * self.args.streams)
        requesters = self.args.clients - streams
        # Each requester its own instances for its state changes (none if there are too few).
        shares = [self.names[index::requesters] for index in range(requesters)]
        loops = []
        for index in range(self.args.clients):
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
        client = Client(reactor, os.path.join(data_dir, "vmready.sock"))
        await daemon.recovered(client)
        return [Target("daemon", client, daemon.process.pid)], None
    try:
        server = postgres_server()
    except SkipTest as e:
        raise SystemExit(f"api_load: {e}") from None
    database = server.create_database(migrated=True)
    names = [f"m{index + 1}" for index in range(args.members)]
    cluster = Cluster(root, server, database, names, 15.0, environment=environment)
    await cluster.start()
    targets = [Target(i.label, i.client, i.pid) for i in cluster.live()]
    return targets, cluster


async def run(args: argparse.Namespace, root: str, processes: Processes, out: list[str]) -> None:
    _, control = await start_host(processes, root)
    environment = {**os.environ, "FAKEQEMU_HOST": control}
    environment.pop("FAKEQEMU_GUEST_DIR", None)
    cluster: Cluster | None = None
    try:
        began = time.monotonic()
        targets, cluster = await start_targets(args, root, environment)
        names = [f"vm{index:04d}" for index in range(args.instances)]
        await create_all(targets[0].client, names)
        report(
            f"members={args.members} instances={args.instances} "
            f"launched after {time.monotonic() - began:.1f}s"
        )
        rss = RSS([target.pid for target in targets])
        rss.loop.start(RSS_SECONDS)
        lag = Lag()
        lag.start()
        cpu = CPU({**{target.label: target.pid for target in targets}, "clients": os.getpid()})
        load = Load(targets, names, args)
        started = time.monotonic()
        await load.run(args.seconds)
        elapsed = time.monotonic() - started
        rss.sample()
        rss.loop.stop()
        lag.loop.stop()
        out.extend(summary(args, load.figures, rss, elapsed, lag, cpu.shares()))
    finally:
        if cluster is not None:
            cluster.kill_all()
            with contextlib.suppress(Exception):
                cluster.server.drop_database(cluster.database)


def summary(
    args: Any, figures: Figures, rss: RSS, elapsed: float, lag: Lag, cpu: dict[str, float]
) -> list[str]:
    """The figures' lines, the last one the one line the run is known by."""
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
        f"clients' reactor late: p50_ms={percentile_ms(lag.late, 0.5):.1f} "
        f"p99_ms={percentile_ms(lag.late, 0.99):.1f} "
        f"max_ms={max(lag.late, default=float('nan')) * 1000:.1f}"
    )
    lines.append("cpu_cores " + " ".join(f"{label}={share:.2f}" for label, share in cpu.items()))
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
    args = parser.parse_args(argv)
    if args.clients < 1 or args.instances < 1 or args.seconds <= 0:
        parser.error("--clients and --instances must be at least 1, --seconds more than 0")
    raise_file_limit()
    root = tempfile.mkdtemp(prefix="vmal-", dir="/tmp")
    processes = Processes()
    out: list[str] = []

    def cleanup() -> None:
        Daemon.kill_all()
        processes.kill_all()
        shutil.rmtree(root, ignore_errors=True)

    react(lambda: run(args, root, processes, out), out, cleanup)


if __name__ == "__main__":
    main()
