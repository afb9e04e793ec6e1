"""A cluster of real ``twistd vmready`` members on a PostgreSQL server of its own.

What ``benchmarks/cluster_faults.py`` and ``benchmarks/api_load.py`` share: the
PostgreSQL server the tests use (``tests.postgres``: initdb and pg_ctl in a
temporary directory, a unix socket only), a database of its own, and members
started as ``benchmarks.crash.Daemon`` starts a daemon, each in a data dir of
its own with the cluster's options (``--store``, ``--member-name``,
``--https-address``, ``--member-address``, ``--lease-seconds``).

With a ``FaultProxy`` every member reaches PostgreSQL through a route of its
own (a TCP port on 127.0.0.1 relayed to PostgreSQL's unix socket) and the
other members through the route in front of each one's mutual-TLS port (the
address it joins with, ``--member-address``), so that the proxy can cut a
member off.  Without one, members reach PostgreSQL on its unix socket and
each other directly.

Each daemon process that holds a member's name is an ``Incarnation``: the
member's ``epoch``-th (a restart after a kill is the next one, and so is
another daemon taking the name over), with the times it was spawned, joined
and ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Sequence
from typing import Any

import attrs
import psycopg
from twisted.internet.endpoints import TCP4ClientEndpoint, UNIXClientEndpoint

from benchmarks._faultproxy import LOOPBACK, FaultProxy, Route
from benchmarks._measure import reactor
from benchmarks.crash import Daemon
from tests.postgres import PostgresServer
from vmready.cli import Client

__all__ = ["Cluster", "Incarnation", "Member", "free_port"]

STORE_TIMEOUT = 5


def free_port() -> int:
    """A TCP port of 127.0.0.1 nobody listens on now."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


@attrs.define(eq=False)
class Incarnation:
    """One daemon process that was (or is) member ``member``, its ``epoch``-th."""

    member: str
    epoch: int
    data_dir: str
    https_port: int
    daemon: Daemon
    client: Client
    spawned: float
    joined: float | None = None
    ended: float | None = None
    frozen: bool = False

    @property
    def label(self) -> str:
        """``m2#3``: member m2's third daemon."""
        return f"{self.member}#{self.epoch}"

    @property
    def pid(self) -> int:
        return self.daemon.process.pid

    def alive(self) -> bool:
        """Whether the process still runs (a frozen one does); notes when it ended."""
        if self.daemon.process.poll() is None:
            return True
        if self.ended is None:
            self.ended = time.time()
        return False

    def signal(self, number: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, number)


@attrs.define(eq=False)
class Member:
    """A member name, the routes in front of it, and every daemon that held it."""

    name: str
    pg_route: Route | None = None
    https_route: Route | None = None
    incarnations: list[Incarnation] = attrs.field(factory=list)
    # Data dirs made for it so far (a takeover gets a new one, with a new certificate).
    data_dirs: int = 0

    @property
    def current(self) -> Incarnation:
        """The daemon that holds (or last held) the name."""
        return self.incarnations[-1]


class Cluster:
    """Members sharing one database of ``server``, reached through ``proxy`` if given."""

    def __init__(
        self,
        root: str,
        server: PostgresServer,
        database: str,
        names: Sequence[str],
        lease_seconds: float,
        proxy: FaultProxy | None = None,
        options: Sequence[str] = (),
        environment: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.server = server
        self.database = database
        self.proxy = proxy
        self.lease_seconds = lease_seconds
        self.options = tuple(options)
        self.environment = environment
        self.members = {name: Member(name) for name in names}

    @property
    def store_url(self) -> str:
        """The database on PostgreSQL's unix socket (the harness' own reads)."""
        return self.server.url(self.database)

    def pg_socket(self) -> str:
        return os.path.join(self.server.directory, ".s.PGSQL.5432")

    async def start(self) -> None:
        """Routes (with a proxy) and a daemon for every member; returns once all serve."""
        if self.proxy is not None:
            for member in self.members.values():
                member.pg_route = await self.proxy.add_route(
                    "postgres", UNIXClientEndpoint(reactor, self.pg_socket()), member.name
                )
                # Its upstream is the port of whichever daemon holds the name (``spawn``).
                member.https_route = await self.proxy.add_route(
                    member.name, TCP4ClientEndpoint(reactor, LOOPBACK, free_port())
                )
        spawned = [self.spawn(member) for member in self.members.values()]
        for incarnation in spawned:
            await self.serving(incarnation)

    def spawn(self, member: Member, new_data_dir: bool = False) -> Incarnation:
        """A new daemon for ``member``: in its last data dir (a restart), or a new one (another
        host taking the name over: its own certificate)."""
        if new_data_dir or member.data_dirs == 0:
            member.data_dirs += 1
        suffix = "" if member.data_dirs == 1 else f".{member.data_dirs}"
        data_dir = os.path.join(self.root, member.name + suffix)
        os.makedirs(data_dir, exist_ok=True)
        epoch = len(member.incarnations) + 1
        https_port = free_port()
        if member.pg_route is not None and member.https_route is not None:
            store = (
                f"postgresql://postgres@{member.pg_route.address}/{self.database}?sslmode=disable"
            )
            address = member.https_route.address
            member.https_route.upstream = TCP4ClientEndpoint(reactor, LOOPBACK, https_port)
        else:
            store, address = self.store_url, f"{LOOPBACK}:{https_port}"
        options = [
            *("--store", store, "--member-name", member.name),
            *("--https-address", f"{LOOPBACK}:{https_port}", "--member-address", address),
            *("--lease-seconds", f"{self.lease_seconds:g}", *self.options),
        ]
        daemon = Daemon(data_dir, epoch, options, self.environment)
        incarnation = Incarnation(
            member.name,
            epoch,
            data_dir,
            https_port,
            daemon,
            Client(reactor, os.path.join(data_dir, "vmready.sock")),
            time.time(),
        )
        member.incarnations.append(incarnation)
        if self.proxy is not None:
            self.proxy.processes[incarnation.pid] = member.name
        return incarnation

    async def serving(self, incarnation: Incarnation) -> None:
        """Once ``incarnation`` answers and logged its recovery (it joined before that)."""
        await incarnation.daemon.recovered(incarnation.client)
        incarnation.joined = self.joined_at(incarnation)

    def joined_at(self, incarnation: Incarnation) -> float:
        """When ``incarnation`` took its member's lease: the row's ``joined_at`` if it took
        the name over (another certificate), else when it was spawned (a restart keeps the
        row's ``joined_at``; its predecessor was dead by then)."""
        row = self.query("SELECT joined_at FROM members WHERE name = %s", (incarnation.member,))
        return max(float(row[0][0]), incarnation.spawned) if row else incarnation.spawned

    def query(self, sql: str, parameters: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of one read on the store, as committed (the harness' own connection)."""
        with psycopg.connect(
            self.store_url, autocommit=True, connect_timeout=STORE_TIMEOUT
        ) as connection:
            return list(connection.execute(sql, parameters).fetchall())

    def lease_ran_out(self, name: str) -> bool:
        """Whether member ``name``'s lease ran out, on the store's clock."""
        rows = self.query(
            "SELECT lease_expires < EXTRACT(EPOCH FROM clock_timestamp()) FROM members"
            " WHERE name = %s",
            (name,),
        )
        return bool(rows and rows[0][0])

    def online(self) -> dict[str, bool]:
        """Each member in the store and whether it holds its lease now."""
        rows = self.query(
            "SELECT name, lease_expires >= EXTRACT(EPOCH FROM clock_timestamp()) FROM members"
        )
        return {str(name): bool(held) for name, held in rows}

    def live(self) -> list[Incarnation]:
        """The daemons that hold their members' names now (frozen ones too)."""
        return [m.current for m in self.members.values() if m.current.alive()]

    def every_incarnation(self) -> list[Incarnation]:
        return [i for m in self.members.values() for i in m.incarnations]

    def kill_all(self) -> None:
        """Every daemon started, SIGKILLed (a frozen one too)."""
        for incarnation in self.every_incarnation():
            if incarnation.alive():
                incarnation.daemon.kill9()
                incarnation.ended = time.time()
