"""kill -9 at random moments: does the daemon lose, strand or misreport anything on restart?

A real ``twistd -n vmready`` daemon runs a fleet of ``--vms`` fakeqemu VMs (each
its own process, daemonized: a kill of the daemon leaves them running, as
with QEMU), each guest running the real agent (the config drive's zipapp, one
process per VM boot, killed when its VM goes: ``benchmarks/_crashworld.Guests``).
Then, ``--kills`` times:

1. a burst of 1 to ``--burst`` random actions through the operator API
   (``vmready.cli.client.Client`` on the unix socket, what the CLI uses):
   launch, stop, start, restart, resize, confirm/revert a resize, rebuild,
   snapshot, restore, delete, and Ready PATCHes from guest programs to their
   agents (``PATCH /1.0 {"state":"Ready"}``, what ``vmready-agent notify``
   sends); each request waits only for its answer, not for its operation;
2. a random delay of up to ``--max-delay`` seconds, so that the kill lands
   mid-transition, then ``kill -9`` of the daemon;
3. the committed store is read (its own SQLite connection), the daemon is
   started again, and once it logged its recovery and every task ended
   (``--settle`` bound) the checks run:

   - **lost**: an instance whose create was answered, or whose row was
     committed when the daemon died, that is not listed now, though no delete
     of it was ever sent;
   - **stuck**: an instance still in a task once the ``--settle`` bound is over;
   - **inconsistent**: an instance the store says runs (active, paused or
     resized, power running or paused) without a live VM process that serves
     (its QMP socket accepts, its guest answers), or one the store says is
     stopped with a VM process; a running VM whose ``-m``/``-smp`` differ from
     the store's memory/cpus (a half-applied resize); a VM process under the
     data dir that belongs to no instance; an instance that is Ready though
     its workload never sent Ready in this boot; and an instance that runs,
     whose agent lives and whose workload's Ready was acknowledged in this
     boot, that is not Ready again within ``--ready-timeout`` (the agent
     re-reports it to the new daemon).

Seeded (``--seed``): the same seed fires the same actions with the same
delays (the moments the kill lands still vary with the machine's load).  Each
kill prints one line; a kill with a problem prints what was fired, the
committed rows at the kill and every problem.  The last line is exactly
``kills=N lost=… stuck=… inconsistent=…`` (counts of instances, summed over
the kills).

    .venv/bin/python benchmarks/crash.py --kills 100 --vms 8 --seed 1
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import attrs
from twisted.internet.task import LoopingCall

from benchmarks._crashworld import (
    Guests,
    Row,
    committed_rows,
    kill_vms,
    run_dir_of,
    vm_answers,
    vm_processes,
)
from benchmarks._fleet import notify
from benchmarks._measure import react, reactor, report, sleep
from vmready.cli import Client, CommandError, instance_path
from vmready.domain import raise_file_limit

TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")
START_TIMEOUT = 120.0
POLL_SECONDS = 0.1
GUEST_SYNC_SECONDS = 0.2
RUNNING_STATES = ("active", "paused", "resized")
MEMORY_CHOICES = (96, 128, 160, 192)
CPU_CHOICES = (1, 2)
# What to fire at an instance in each vm_state (an instance mid-task gets anything: a 409).
CHOICES = {
    "active": ("stop", "restart", "resize", "rebuild", "snapshot", "restore", "delete")
    + ("ready",) * 3,
    "stopped": ("start", "start", "resize", "rebuild", "snapshot", "restore", "delete"),
    "resized": ("resize-end", "resize-end", "delete", "ready"),
    "paused": ("stop", "delete"),
    "error": ("start", "rebuild", "restore", "delete"),
}
ALL_CHOICES = tuple(sorted({kind for kinds in CHOICES.values() for kind in kinds}))
# The daemon as tests/system.py runs it: quick follow-ups after a CONNECT, short stops.
DAEMON_OPTIONS = ("--agent-follow-up", "0.02", "--stop-timeout", "1")


class Daemon:
    """One ``twistd -n vmready`` process; each start logs to a file of its own.

    ``options``: more of ``twistd vmready``'s options (a cluster member's, say);
    ``environment``: the daemon's, if not this process' own.
    """

    # Every daemon started, so that none outlives the run (also one stopped by a signal).
    started_all: list[subprocess.Popen[bytes]] = []

    def __init__(
        self,
        data_dir: str,
        start: int,
        options: Sequence[str] = (),
        environment: dict[str, str] | None = None,
    ) -> None:
        self.log_path = os.path.join(data_dir, f"twistd-{start}.log")
        argv = [TWISTD, "-n", "--pidfile", "", "--logfile", self.log_path, "vmready"]
        argv += ["--config", ""]  # whatever /etc/vmready/vmready.yaml the host has
        argv += ["--data-dir", data_dir, *DAEMON_OPTIONS, *options]
        with open(os.path.join(data_dir, f"twistd-{start}.out"), "wb") as output:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=environment,
            )
        self.started = time.monotonic()
        Daemon.started_all.append(self.process)

    def _log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    async def recovered(self, client: Client) -> float:
        """Once the API answers and the daemon logged its recovery; seconds since spawned."""
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"the daemon exited ({self.process.returncode}); {self.log_path}")
            if time.monotonic() - self.started > START_TIMEOUT:
                raise SystemExit(f"the daemon did not recover within {START_TIMEOUT:g}s")
            log = self._log()
            if "recovering instances failed" in log:
                raise SystemExit(f"the daemon's recovery failed; see {self.log_path}")
            if "recovered " in log:
                try:
                    await client.get("/1.0")
                    return time.monotonic() - self.started
                except CommandError:
                    pass
            await sleep(POLL_SECONDS)

    def kill9(self) -> None:
        """``kill -9``: no clean-up of any kind."""
        self.process.kill()
        self.process.wait()

    @classmethod
    def kill_all(cls) -> None:
        """Every daemon started that still runs, SIGKILLed (the last resort on the way out)."""
        for process in cls.started_all:
            if process.poll() is None:
                process.kill()
                process.wait()

    def tracebacks(self) -> int:
        """How many tracebacks this start logged."""
        return self._log().count("Traceback")


class Fleet:
    """What the operator and the guest programs asked for, and what was answered."""

    def __init__(self, client: Client, guests: Guests, data_dir: str, vms: int) -> None:
        self.client = client
        self.guests = guests
        self.data_dir = data_dir
        self.vms = vms
        self.created: set[str] = set()  # creates answered
        self.delete_sent: set[str] = set()
        self.snapshots: dict[str, list[str]] = {}
        self._next = 0
        self.fired: list[str] = []

    async def instances(self) -> list[dict[str, Any]]:
        """``GET /1.0/instances?recursion=1``."""
        listed: list[dict[str, Any]] = await self.client.get("/1.0/instances?recursion=1")
        return listed

    async def _send(self, what: str, method: str, path: str, body: Any = None) -> None:
        try:
            await self.client.request(method, path, body)
            self.fired.append(f"{what}: accepted")
        except CommandError as e:
            self.fired.append(f"{what}: refused ({str(e).splitlines()[0][:80]})")

    async def launch(self, rng: random.Random) -> None:
        self._next += 1
        name = f"c{self._next}"
        memory = rng.choice(MEMORY_CHOICES)
        body = {"name": name, "config": {"limits.memory": str(memory)}, "start": True}
        await self._send(f"launch {name}", "POST", "/1.0/instances", body)
        if self.fired[-1].endswith("accepted"):
            self.created.add(name)

    async def fire(self, rng: random.Random, instances: list[dict[str, Any]]) -> None:
        """One random action on one random instance (or a launch)."""
        live = [i for i in instances if i["name"] not in self.delete_sent]
        if len(live) < self.vms and (not live or rng.random() < 0.3):
            await self.launch(rng)
            return
        instance = rng.choice(live)
        name = instance["name"]
        state = instance_path(name, "state")
        choices = CHOICES.get(instance["vm_state"], ALL_CHOICES)
        kind = rng.choice(ALL_CHOICES if instance["task_state"] else choices)
        if kind in ("stop", "restart"):
            force = rng.random() < 0.5
            body = {"action": kind, "force": force, "timeout": 1}
            await self._send(f"{kind} {name} force={force}", "PUT", state, body)
        elif kind == "start":
            await self._send(f"start {name}", "PUT", state, {"action": "start"})
        elif kind == "resize":
            body = {"memory": rng.choice(MEMORY_CHOICES), "cpus": rng.choice(CPU_CHOICES)}
            path = instance_path(name, "actions", "resize")
            await self._send(f"resize {name} {body}", "POST", path, body)
        elif kind == "resize-end":
            action = rng.choice(("confirm-resize", "revert-resize"))
            path = instance_path(name, "actions", action)
            await self._send(f"{action} {name}", "POST", path, {})
        elif kind == "rebuild":
            path = instance_path(name, "actions", "rebuild")
            await self._send(f"rebuild {name}", "POST", path, {})
        elif kind == "snapshot":
            taken = self.snapshots.setdefault(name, [])
            snapshot = f"s{len(taken) + 1}"
            stateful = rng.random() < 0.5
            body = {"name": snapshot, "stateful": stateful}
            path = instance_path(name, "snapshots")
            await self._send(f"snapshot {name} {snapshot} stateful={stateful}", "POST", path, body)
            if self.fired[-1].endswith("accepted"):
                taken.append(snapshot)
        elif kind == "restore":
            snapshot = rng.choice(self.snapshots.get(name) or ["s1"])
            stateful = rng.random() < 0.5
            body = {"restore": snapshot, "stateful": stateful, "force": stateful}
            await self._send(f"restore {name} {body}", "PUT", instance_path(name), body)
        elif kind == "delete":
            self.delete_sent.add(name)
            await self._send(f"delete {name}", "DELETE", instance_path(name))
        else:
            await self.ready(name, instance["uuid"])

    async def ready(self, name: str, instance_uuid: str) -> None:
        """The workload declares Ready to its agent, as ``vmready-agent notify ready`` does."""
        run_dir = run_dir_of(self.data_dir, instance_uuid)
        boot = self.guests.agent_pid_for(run_dir)
        socket = self.guests.devlxd_socket(run_dir)
        if boot is None or socket is None:
            self.fired.append(f"ready {name}: no agent runs")
            return
        self.guests.attempted[run_dir] = boot
        try:
            await notify(socket, "Ready", 5.0)
        except Exception as e:  # any failure: not acknowledged, said so
            self.fired.append(f"ready {name}: not acknowledged ({str(e)[:60]})")
            return
        self.guests.acknowledged[run_dir] = boot
        self.fired.append(f"ready {name} (boot {boot}): acknowledged")


async def settle(fleet: Fleet, timeout: float) -> tuple[list[dict[str, Any]], float]:
    """Until no instance is in a task (or ``timeout``): the instances then, and the seconds."""
    started = time.monotonic()
    while True:
        instances = await fleet.instances()
        busy = [i for i in instances if i["task_state"] is not None]
        if not busy or time.monotonic() - started > timeout:
            return instances, time.monotonic() - started
        await sleep(POLL_SECONDS)


def vm_problems(data_dir: str, instances: list[dict[str, Any]]) -> list[str]:
    """Store versus the VM processes that really run."""
    problems = []
    vms = vm_processes(data_dir)
    known = set()
    for instance in instances:
        run_dir = run_dir_of(data_dir, instance["uuid"])
        known.add(run_dir)  # its VM is an instance's, even while it is stuck
        if instance["task_state"] is not None:
            continue  # counted as stuck
        name, vm_state, power = instance["name"], instance["vm_state"], instance["power_state"]
        vm = vms.get(run_dir)
        runs = vm_state in RUNNING_STATES and power in ("running", "paused")
        if vm_state == "error":
            continue
        if runs and (vm is None or not vm_answers(run_dir)):
            problems.append(f"{name}: {vm_state}/{power} but no VM process serves")
        elif not runs and vm is not None:
            problems.append(f"{name}: {vm_state}/{power} but VM pid {vm.pid} runs")
        elif vm is not None:
            limits = instance["limits"]
            if (vm.memory_mib, vm.cpus) != (limits["memory_mib"], limits["cpus"]):
                problems.append(
                    f"{name}: store {limits['memory_mib']} MiB/{limits['cpus']} cpus, "
                    f"VM runs {vm.memory_mib} MiB/{vm.cpus} cpus"
                )
    problems += [
        f"VM pid {vm.pid} runs for no instance ({d})" for d, vm in vms.items() if d not in known
    ]
    return problems


async def consistent(data_dir: str, fleet: Fleet, bound: float) -> list[str]:
    """VM problems that are still there after ``bound`` seconds (exits take a moment)."""
    deadline = time.monotonic() + bound
    while True:
        problems = vm_problems(data_dir, await fleet.instances())
        if not problems or time.monotonic() > deadline:
            return problems
        await sleep(POLL_SECONDS * 5)


async def ready_problems(fleet: Fleet, guests: Guests, timeout: float) -> list[str]:
    """Ready re-established where the agent re-reports it; never Ready without it."""
    deadline = time.monotonic() + timeout
    while True:
        problems = []
        vms = vm_processes(fleet.data_dir)
        for instance in await fleet.instances():
            run_dir = run_dir_of(fleet.data_dir, instance["uuid"])
            vm = vms.get(run_dir)
            boot = vm.pid if vm is not None else None
            ready = instance["status"] == "Ready"
            if ready and guests.attempted.get(run_dir) != boot:
                problems.append(f"{instance['name']}: Ready, but no Ready was sent in boot {boot}")
            runs = (
                instance["vm_state"] in ("active", "resized")
                and instance["power_state"] == "running"
            )
            expected = (
                runs
                and boot is not None
                and guests.acknowledged.get(run_dir) == boot
                and guests.agent_pid_for(run_dir) == boot
            )
            if expected and not ready:
                problems.append(
                    f"{instance['name']}: Ready acknowledged in boot {boot}, "
                    f"still {instance['status']} after {timeout:g}s"
                )
        if not problems or time.monotonic() > deadline:
            return problems
        await sleep(POLL_SECONDS * 5)


_PROBLEMS = ("lost", "stuck", "inconsistent")


@attrs.define
class Kills:
    """The run of kills: the daemon of the moment, what was fired, what was found."""

    args: argparse.Namespace
    data_dir: str
    client: Client
    fleet: Fleet
    guests: Guests
    rng: random.Random
    daemon: Daemon
    starts: int = 0
    totals: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(_PROBLEMS, 0))

    async def kill_once(self, kill: int) -> None:
        """A burst of actions, ``kill -9`` after a random delay, a new daemon; what it shows."""
        args, fleet = self.args, self.fleet
        fleet.fired = []
        for _ in range(self.rng.randint(1, args.burst)):
            await fleet.fire(self.rng, await fleet.instances())
            await sleep(self.rng.uniform(0, 0.05))
        delay = self.rng.uniform(0, args.max_delay)
        await sleep(delay)
        self.daemon.kill9()
        tracebacks = self.daemon.tracebacks()
        rows = committed_rows(os.path.join(self.data_dir, "vmready.sqlite"))
        self.starts += 1
        self.daemon = Daemon(self.data_dir, self.starts)
        recovered = await self.daemon.recovered(self.client)
        instances, settled = await settle(fleet, args.settle)
        listed = {i["name"] for i in instances}
        expected = (fleet.created | set(rows)) - fleet.delete_sent
        found = {
            "lost": sorted(expected - listed),
            "stuck": [f"{i['name']}: {i['task_state']}" for i in instances if i["task_state"]],
            "inconsistent": await consistent(self.data_dir, fleet, 5.0)
            + await ready_problems(fleet, self.guests, args.ready_timeout),
        }
        fleet.created -= set(found["lost"])  # counted once
        for what, items in found.items():
            self.totals[what] += len(items)
        mid = sorted(f"{r.name}:{r.task_state}" for r in rows.values() if r.task_state)
        errors = sum(i["vm_state"] == "error" for i in instances)
        report(
            f"kill {kill}: {len(fleet.fired)} actions, +{delay:.2f}s, mid-task {mid or '-'}; "
            f"recovered in {recovered:.1f}s, settled {settled:.1f}s; "
            f"{len(instances)} instances, {errors} in error"
        )
        if args.verbose:
            report(f"  fired {fleet.fired}")
        if any(found.values()) or tracebacks:
            self.show_problems(kill, rows, found, tracebacks)

    def show_problems(
        self, kill: int, rows: dict[str, Row], found: dict[str, list[str]], tracebacks: int
    ) -> None:
        """What was fired and committed at a kill that left a problem, and each problem."""
        report(f"  seed {self.args.seed}, kill {kill}: fired {self.fleet.fired}")
        report(f"  committed at the kill: {sorted(map(str, rows.values()))}")
        for what, items in found.items():
            for item in items:
                report(f"  {what}: {item}")
        if tracebacks:
            report(
                f"  the killed daemon logged {tracebacks} tracebacks "
                f"(twistd-{self.starts - 1}.log)"
            )


async def run(args: argparse.Namespace, directory: str, guests: Guests, out: list[str]) -> None:
    rng = random.Random(args.seed)
    data_dir = directory
    client = Client(reactor, os.path.join(data_dir, "vmready.sock"))
    fleet = Fleet(client, guests, data_dir, args.vms)
    kills = Kills(args, data_dir, client, fleet, guests, rng, Daemon(data_dir, 0))
    syncing = LoopingCall(guests.sync)
    syncing.clock = reactor
    syncing.start(GUEST_SYNC_SECONDS)
    try:
        await kills.daemon.recovered(client)
        for _ in range(args.vms):
            await fleet.launch(rng)
        await settle(fleet, args.settle)
        began = time.monotonic()
        for kill in range(1, args.kills + 1):
            await kills.kill_once(kill)
        report(f"time: {time.monotonic() - began:.0f} s for {args.kills} kills")
        totals = kills.totals
        out.append(
            f"kills={args.kills} lost={totals['lost']} stuck={totals['stuck']} "
            f"inconsistent={totals['inconsistent']}"
        )
    finally:
        if syncing.running:
            syncing.stop()
        kills.daemon.kill9()


def main(argv: Sequence[str] | None = None) -> None:
    """Run the kills; print a line per kill and the totals last."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--vms", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--burst", type=int, default=4, help="most actions fired per kill")
    parser.add_argument("--max-delay", type=float, default=0.6, help="most seconds to the kill")
    parser.add_argument("--settle", type=float, default=60.0, help="bound for tasks to end")
    parser.add_argument("--ready-timeout", type=float, default=30.0)
    parser.add_argument("--verbose", action="store_true", help="what each kill fired")
    parser.add_argument("--keep", action="store_true", help="keep the data dir")
    args = parser.parse_args(argv)
    raise_file_limit()
    # Short: the VMs' guest sockets live under it and must stay below 107 bytes.
    directory = tempfile.mkdtemp(prefix="vmrc-", dir="/tmp")
    guests = Guests(directory, os.path.join(directory, "agents"))
    out: list[str] = []

    def cleanup() -> None:
        Daemon.kill_all()
        guests.stop()
        kill_vms(directory)
        if args.keep:
            print(f"kept {directory}", file=sys.stderr)
        else:
            shutil.rmtree(directory, ignore_errors=True)

    react(lambda: run(args, directory, guests, out), out, cleanup)


if __name__ == "__main__":
    main()
