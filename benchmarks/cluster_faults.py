"""The cluster under faults: random faults while operators act, then a checker over the history.

    .venv/bin/python benchmarks/cluster_faults.py --faults 100 --members 3 --seed 1

It starts a PostgreSQL server of its own (``tests.postgres``, as the tests
do) and ``--members`` real ``twistd vmready`` members on one database, each
with fakeqemu VMs (one daemonized process per VM, as QEMU) and a real agent
per VM boot (``benchmarks._crashworld.Guests``).  Members reach PostgreSQL and
each other only through a TCP proxy on 127.0.0.1 that this process runs
(``benchmarks._faultproxy``): a partition is real sockets going silent.

While ``--clients`` clients act through randomly chosen members (the unix
socket of each; an action on another member's instance is relayed by the
member asked), each waiting for its operation: launch, start, stop, restart,
resize with confirm or revert, snapshot, rename, delete, and Ready PATCHes
from guest programs to their agents; one operation at a time per instance,
each recorded with what the client was told (``benchmarks._history.ClientOp``).
Meanwhile ``--faults`` faults, one after another, each after a random pause
of up to ``--gap`` seconds, each of a kind chosen at random:

- ``postgres``: PostgreSQL stopped with ``pg_ctl stop -m immediate``,
  started again after 1 to 6 s;
- ``kill``: a member ``SIGKILL``ed, started again after 0.5 to 3 s;
- ``freeze``: a member ``SIGSTOP``ped for 1.2 to 2 times its lease, then
  ``SIGCONT``inued.  In ``--takeover-share`` of them (default a half), once
  its lease ran out another daemon takes its name over meanwhile (a new data
  dir, so a new certificate: an operator replacing a host they think dead),
  so that the frozen daemon wakes up with its member's instances another
  daemon's; it must stop by itself (it is killed, and counted, if it has not
  within ``--lease-seconds`` + 30 s), then its VMs are killed (its host is
  gone);
- ``partition``: a member cut off from PostgreSQL and from the other members
  (both ways) for 1.2 to 2.5 times its lease, then healed.

Then everything is healed (nothing frozen, nothing cut off, PostgreSQL up),
the clients stop, and once the cluster settled (every member online, no
task claimed, every member's listing as the store's; at most ``--settle``
seconds) the history is checked (``benchmarks._history.check``): lost, stuck,
inconsistent, double master.  The history has what the clients were told,
the store's action history (its rows say nothing of which daemon ran an
action: see the double-master rule), what each daemon said it ran (the
``instance-state`` events on its own ``/1.0/events`` stream: a member relays
no event of its own name, so each daemon's stream tells its own actions), the
lease epochs (each daemon to hold a member's name is the next epoch, from
when it joined), the final rows, each member's listing, and the VMs.

Seeded: ``--seed`` (printed first) fixes the fault schedule (kinds, members,
pauses, durations) and each client's choices; the moments faults land among
the actions still vary with the machine's load.  One line per fault; each
violation; the last line is exactly
``faults=N actions=… lost=… stuck=… inconsistent=… double_master=…``.
``--history FILE`` writes everything recorded, as JSON, for a closer look.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine, Sequence
from datetime import datetime
from typing import Any, TypeVar

import attrs
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.error import ConnectError
from twisted.internet.task import LoopingCall
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest

from benchmarks._clusterworld import Cluster, Incarnation, Member
from benchmarks._crashworld import Guests, kill_vms, run_dir_of, vm_processes
from benchmarks._faultproxy import FaultProxy
from benchmarks._fleet import notify
from benchmarks._history import (
    ClientOp,
    FinalInstance,
    Grant,
    History,
    Outcome,
    Span,
    Verdict,
    check,
    spans_from_events,
)
from benchmarks._measure import react, reactor, report, sleep
from benchmarks.crash import CPU_CHOICES, MEMORY_CHOICES, vm_problems
from tests.postgres import postgres_server
from vmready.cli.client import APIError, DaemonUnreachable, LineStream, instance_path
from vmready.cli.errors import CommandError
from vmready.domain.limits import raise_file_limit
from vmready.domain.states import ACTIONS

KINDS = ("postgres", "kill", "freeze", "partition")
# Actions clients send, by the instance's vm_state (an instance mid-task gets any: a 409).
WORKLOAD_CHOICES = {
    "active": ("stop", "restart", "resize", "snapshot", "delete", "ready", "ready"),
    "stopped": ("start", "start", "resize", "snapshot", "rename", "delete"),
    "resized": ("resize-end", "resize-end", "delete", "ready"),
    "paused": ("stop", "delete"),
    "error": ("start", "delete"),
}
ALL_CHOICES = tuple(sorted({k for kinds in WORKLOAD_CHOICES.values() for k in kinds}))
# The store's action rows that are actions (a task, or a rename); the rest are its own notes.
STORE_ACTIONS = frozenset({*ACTIONS, "rename"})
REQUEST_TIMEOUT = 45.0
OPERATION_TIMEOUT = 90.0
READY_TIMEOUT = 5.0
REFRESH_SECONDS = 1.0
GUEST_SYNC_SECONDS = 0.5
POLL_SECONDS = 0.2
STOP_GRACE = 30.0
T = TypeVar("T")
# What a connection to a member's socket fails with when the request was never sent.
NOT_SENT = (os.strerror(errno.ENOENT), os.strerror(errno.ECONNREFUSED))


# -- what the clients do ----------------------------------------------------------------


@attrs.define(eq=False)
class Ref:
    """An instance as the clients know it: its key (the name it was launched with), its
    name now, what the last listing showed, and whether a client is acting on it."""

    key: str
    name: str
    uuid: str | None = None
    vm_state: str | None = None
    task_state: str | None = None
    location: str | None = None
    memory: int = 0
    cpus: int = 1
    busy: bool = False
    gone: bool = False
    renames: int = 0
    snapshots: int = 0
    # The last acknowledged resize: (new size, size before).
    resized: tuple[tuple[int, int], tuple[int, int]] | None = None


class Recorder:
    """Every operation sent and what its client was told; every event each daemon sent."""

    def __init__(self) -> None:
        self.ops: list[ClientOp] = []
        self.keys: dict[str, str] = {}
        self.events: dict[str, list[dict[str, Any]]] = {}
        self.streams: list[LineStream] = []

    def op(self, **fields: Any) -> ClientOp:
        done = ClientOp(id=len(self.ops) + 1, **fields)
        self.ops.append(done)
        return done

    async def listen(self, incarnation: Incarnation) -> None:
        """Record the events on ``incarnation``'s own stream (its own actions among them)."""
        recorded = self.events.setdefault(incarnation.label, [])
        try:
            stream = await incarnation.client.events(["lifecycle"], recorded.append)
        except CommandError as e:
            report(f"  cannot follow the events of {incarnation.label}: {e.message}")
            return
        self.streams.append(stream)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


def within(call: Coroutine[Any, Any, T], seconds: float) -> Deferred[T]:
    """``call`` as a Deferred cancelled (TimeoutError) if it has not ended in ``seconds``."""
    return Deferred.fromCoroutine(call).addTimeout(seconds, reactor)


def _outcome(error: Exception) -> tuple[Outcome, str]:
    """What an error tells a client about whether its request was carried out."""
    if isinstance(error, APIError):
        return ("refused" if error.code < 500 else "unknown"), f"{error.code} {error.error}"
    if isinstance(error, DaemonUnreachable):
        # Only a socket that is not there, or refuses, proves nothing was sent: a frozen
        # daemon's socket takes the connection and may read the request once it wakes.
        sure = any(reason in error.message for reason in NOT_SENT)
        return ("refused" if sure else "unknown"), error.message[:200]
    if isinstance(error, CancelledError | TimeoutError):
        return "unknown", "no answer in time"
    return "unknown", str(error).splitlines()[0][:200]


class Workload:
    """``clients`` loops acting on the instances through random members."""

    def __init__(
        self, cluster: Cluster, guests: dict[str, Guests], recorder: Recorder, args: Any
    ) -> None:
        self.cluster = cluster
        self.guests = guests
        self.recorder = recorder
        self.args = args
        self.refs: dict[str, Ref] = {}
        self.launched = 0
        self.running = False
        self.loops: list[Deferred[None]] = []

    def members(self) -> list[Incarnation]:
        """Whom a client may ask: every member's daemon (frozen or cut off as well)."""
        return self.cluster.live()

    async def populate(self) -> None:
        """The first ``--instances``, launched one after another through the first member."""
        rng = random.Random(f"{self.args.seed}-populate")
        first = next(iter(self.cluster.members.values())).current
        for _ in range(self.args.instances):
            await self.launch(rng, first)
        await self.refresh()

    def start(self) -> None:
        self.running = True
        for index in range(self.args.clients):
            rng = random.Random(f"{self.args.seed}-client-{index}")
            self.loops.append(Deferred.fromCoroutine(self._client(rng)))
        self.loops.append(Deferred.fromCoroutine(self._refreshing()))

    async def stop(self) -> None:
        """No new operation; once every client's last one ended."""
        self.running = False
        for loop in self.loops:
            await loop

    async def _refreshing(self) -> None:
        while self.running:
            await self.refresh()
            await sleep(REFRESH_SECONDS)

    async def refresh(self) -> None:
        """What a member that answers lists now."""
        for incarnation in self.members():
            if incarnation.frozen:
                continue
            try:
                listed = await within(
                    incarnation.client.get("/1.0/instances?recursion=1"), REFRESH_SECONDS * 5
                )
            except (CommandError, CancelledError, TimeoutError):
                continue
            self._update(listed)
            return

    def _update(self, listed: list[dict[str, Any]]) -> None:
        for shown in listed:
            key = self.recorder.keys.get(shown["name"])
            ref = self.refs.get(key) if key is not None else None
            if ref is None or ref.busy:
                continue
            ref.name, ref.uuid = shown["name"], shown["uuid"]
            ref.vm_state, ref.task_state = shown["vm_state"], shown["task_state"]
            ref.location = shown["location"]
            ref.memory, ref.cpus = shown["limits"]["memory_mib"], shown["limits"]["cpus"]

    async def _client(self, rng: random.Random) -> None:
        while self.running:
            await sleep(rng.uniform(0, self.args.think))
            members = self.members()
            if not members or not self.running:
                continue
            via = rng.choice(members)
            live = [r for r in self.refs.values() if not r.gone]
            if len(live) < self.args.instances and rng.random() < 0.5:
                await self.launch(rng, via)
                continue
            idle = [r for r in live if not r.busy and r.vm_state is not None]
            if idle:
                await self.act(rng, rng.choice(idle), via)

    async def launch(self, rng: random.Random, via: Incarnation) -> None:
        self.launched += 1
        name = f"c{self.launched}"
        ref = self.refs[name] = Ref(name, name, memory=rng.choice(MEMORY_CHOICES))
        self.recorder.keys[name] = name
        body = {"name": name, "config": {"limits.memory": str(ref.memory)}}
        target = rng.choice([None, *self.cluster.members])
        path = "/1.0/instances" + ("" if target is None else f"?target={target}")
        await self._operation(ref, "launch", via, "POST", path, body)

    async def act(self, rng: random.Random, ref: Ref, via: Incarnation) -> None:
        """One action on ``ref`` chosen by what it was last listed as."""
        choices = ALL_CHOICES if ref.task_state else WORKLOAD_CHOICES.get(ref.vm_state or "", ())
        if not choices:
            return
        kind = rng.choice(choices)
        path, state = instance_path(ref.name), instance_path(ref.name, "state")
        if kind in ("stop", "restart"):
            body = {"action": kind, "force": rng.random() < 0.5, "timeout": 1}
            await self._operation(ref, kind, via, "PUT", state, body)
        elif kind == "start":
            await self._operation(ref, kind, via, "PUT", state, {"action": "start"})
        elif kind == "resize":
            size = (rng.choice(MEMORY_CHOICES), rng.choice(CPU_CHOICES))
            body = {"memory": size[0], "cpus": size[1]}
            before = (ref.memory, ref.cpus)
            resize = instance_path(ref.name, "actions", "resize")
            if await self._operation(ref, kind, via, "POST", resize, body) == "ok":
                ref.resized = (size, before)
        elif kind == "resize-end":
            kind = rng.choice(("confirm-resize", "revert-resize"))
            params: dict[str, Any] = {}
            if ref.resized is not None:
                size = ref.resized[0 if kind == "confirm-resize" else 1]
                params = {"memory": size[0], "cpus": size[1]}
            ending = instance_path(ref.name, "actions", kind)
            await self._operation(ref, kind, via, "POST", ending, {}, params)
            ref.resized = None
        elif kind == "snapshot":
            ref.snapshots += 1
            snapshot = f"s{ref.snapshots}"
            body = {"name": snapshot, "stateful": False}
            snapshots = instance_path(ref.name, "snapshots")
            await self._operation(ref, kind, via, "POST", snapshots, body, {"snapshot": snapshot})
        elif kind == "rename":
            ref.renames += 1
            new_name = f"{ref.key}-r{ref.renames}"
            self.recorder.keys[new_name] = ref.key
            body = {"name": new_name}
            params = {"new_name": new_name}
            if await self._operation(ref, kind, via, "POST", path, body, params) == "ok":
                ref.name = new_name
        elif kind == "delete":
            if await self._operation(ref, kind, via, "DELETE", path) == "ok":
                ref.gone = True
        elif kind == "ready":
            await self.ready(ref)

    async def _operation(
        self,
        ref: Ref,
        kind: str,
        via: Incarnation,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, Any] | None = None,
    ) -> Outcome:
        """Send one request, wait for its operation, record what the client was told."""
        ref.busy = True
        invoked = time.time()
        outcome: Outcome = "ok"
        detail = ""
        try:
            answer = await within(via.client.request(method, path, body), REQUEST_TIMEOUT)
            if answer.get("type") == "async":
                done = await within(
                    via.client.wait_operation(answer["metadata"]), OPERATION_TIMEOUT
                )
                if done.get("status") != "Success":
                    outcome, detail = "failed", str(done.get("err", ""))[:200]
        except Exception as e:  # every way a request can end is an outcome to record
            outcome, detail = _outcome(e)
        finally:
            ref.busy = False
            ref.vm_state = None  # until the next listing says
        self.recorder.op(
            kind=kind,
            instance=ref.key,
            name=ref.name,
            via=via.label,
            invoked=invoked,
            completed=time.time(),
            outcome=outcome,
            detail=detail,
            params=params or {},
        )
        return outcome

    async def ready(self, ref: Ref) -> None:
        """The workload in the guest declares Ready to its agent (``vmready-agent notify``)."""
        member = self.cluster.members.get(ref.location or "")
        if member is None or ref.uuid is None:
            return
        guests = self.guests.get(member.current.data_dir)
        run_dir = run_dir_of(member.current.data_dir, ref.uuid)
        socket = guests.devlxd_socket(run_dir) if guests is not None else None
        if guests is None or socket is None or guests.agent_pid_for(run_dir) is None:
            return
        ref.busy = True
        invoked = time.time()
        outcome: Outcome = "ok"
        detail = ""
        try:
            await notify(socket, "Ready", READY_TIMEOUT)
        except ConnectError as e:  # its socket is not there (yet, or any more): nothing sent
            outcome, detail = "refused", str(e)[:200]
        except Exception as e:  # not acknowledged, whatever the reason
            outcome, detail = "unknown", str(e).splitlines()[0][:200] if str(e) else repr(e)
        finally:
            ref.busy = False
        self.recorder.op(
            kind="ready",
            instance=ref.key,
            name=ref.name,
            via=f"agent of {ref.name}",
            invoked=invoked,
            completed=time.time(),
            outcome=outcome,
            detail=detail,
        )


# -- the faults ---------------------------------------------------------------------------


@attrs.frozen
class Fault:
    """One fault of the schedule, drawn before the run from the seed."""

    kind: str
    member: str
    pause: float
    duration: float
    takeover: bool


def schedule(seed: int, count: int, members: Sequence[str], args: Any) -> list[Fault]:
    """The faults, their members, pauses and durations: the same for the same seed."""
    rng = random.Random(f"{seed}-faults")
    faults = []
    lease = args.lease_seconds
    for _ in range(count):
        kind = rng.choice(args.kinds)
        member = rng.choice(list(members))
        pause = rng.uniform(0.5, args.gap)
        if kind == "postgres":
            duration = rng.uniform(1.0, 6.0)
        elif kind == "kill":
            duration = rng.uniform(0.5, 3.0)
        elif kind == "freeze":
            duration = rng.uniform(1.2, 2.0) * lease
        else:
            duration = rng.uniform(1.2, 2.5) * lease
        takeover = kind == "freeze" and rng.random() < args.takeover_share
        faults.append(Fault(kind, member, pause, duration, takeover))
    return faults


class Faults:
    """Injects the faults of the schedule into the cluster, and heals them."""

    def __init__(
        self,
        cluster: Cluster,
        proxy: FaultProxy,
        guests: dict[str, Guests],
        recorder: Recorder,
        args: Any,
    ) -> None:
        self.cluster = cluster
        self.proxy = proxy
        self.guests = guests
        self.recorder = recorder
        self.args = args
        # (member, what): daemons that went on running after their member was taken over.
        self.lingering: list[tuple[str, str]] = []
        self.retired_dirs: list[str] = []

    async def inject(self, fault: Fault) -> str:
        """Run ``fault`` to its end; what happened, in a few words."""
        member = self.cluster.members[fault.member]
        if fault.kind == "postgres":
            await deferToThread(self.cluster.server.stop)
            await sleep(fault.duration)
            await deferToThread(self.cluster.server.start)
            return f"PostgreSQL stopped for {fault.duration:.1f}s"
        if fault.kind == "partition":
            self.proxy.partition(member.name)
            await sleep(fault.duration)
            self.proxy.heal(member.name)
            return f"{member.name} cut off for {fault.duration:.1f}s"
        if fault.kind == "kill":
            victim = member.current
            victim.daemon.kill9()
            victim.ended = time.time()
            await sleep(fault.duration)
            await self.start(member)
            return f"{victim.label} killed, {member.current.label} {fault.duration:.1f}s later"
        return await self.freeze(member, fault)

    async def start(self, member: Member, new_data_dir: bool = False) -> Incarnation:
        """A new daemon for ``member``, followed once it serves."""
        incarnation = self.cluster.spawn(member, new_data_dir)
        self.guests.setdefault(
            incarnation.data_dir,
            Guests(incarnation.data_dir, os.path.join(incarnation.data_dir, "agents")),
        )
        await self.cluster.serving(incarnation)
        await self.recorder.listen(incarnation)
        return incarnation

    async def freeze(self, member: Member, fault: Fault) -> str:
        frozen = member.current
        frozen.signal(signal.SIGSTOP)
        frozen.frozen = True
        if not fault.takeover:
            await sleep(fault.duration)
            self.thaw(frozen)
            return f"{frozen.label} frozen for {fault.duration:.1f}s"
        started = time.monotonic()
        while not self.cluster.lease_ran_out(member.name):
            if time.monotonic() - started > self.args.lease_seconds + STOP_GRACE:
                raise SystemExit(f"the lease of frozen {frozen.label} never ran out")
            await sleep(POLL_SECONDS)
        successor = await self.start(member, new_data_dir=True)
        await sleep(max(0.0, fault.duration - (time.monotonic() - started)))
        self.thaw(frozen)
        thawed = time.monotonic()
        bound = self.args.lease_seconds + STOP_GRACE
        while frozen.alive() and time.monotonic() - thawed < bound:
            await sleep(POLL_SECONDS)
        outcome = f"stopped {time.monotonic() - thawed:.1f}s after it woke"
        if frozen.alive():
            frozen.daemon.kill9()
            frozen.ended = time.time()
            self.lingering.append(
                (
                    member.name,
                    f"{frozen.label} still ran {bound:g}s after it woke, its member taken "
                    f"over by {successor.label}",
                )
            )
            outcome = f"still ran {bound:g}s after it woke: killed"
        self.retire(frozen.data_dir)
        return (
            f"{frozen.label} frozen for {time.monotonic() - started:.1f}s, taken over by "
            f"{successor.label}; {outcome}"
        )

    def thaw(self, incarnation: Incarnation) -> None:
        incarnation.signal(signal.SIGCONT)
        incarnation.frozen = False

    def retire(self, data_dir: str) -> None:
        """A replaced host is gone: its guests' agents and VMs with it."""
        guests = self.guests.pop(data_dir, None)
        if guests is not None:
            guests.stop()
        kill_vms(data_dir)
        self.retired_dirs.append(data_dir)

    async def heal_all(self) -> None:
        """Nothing cut off, nothing frozen, PostgreSQL up."""
        self.proxy.heal_all()
        for incarnation in self.cluster.every_incarnation():
            if incarnation.frozen:
                self.thaw(incarnation)
        if not self.cluster.server.running:
            await deferToThread(self.cluster.server.start)


# -- settling, and the history ------------------------------------------------------------


async def listing(incarnation: Incarnation) -> list[dict[str, Any]] | None:
    try:
        listed: list[dict[str, Any]] = await within(
            incarnation.client.get("/1.0/instances?recursion=1"), REQUEST_TIMEOUT
        )
    except (CommandError, CancelledError, TimeoutError):
        return None
    return listed


def store_rows(cluster: Cluster) -> dict[str, tuple[str, str, str | None, str, str]]:
    """uuid → what a member's listing must show of it, as the store holds it."""
    rows = cluster.query(
        "SELECT uuid, name, vm_state, task_state, power_state, member FROM instances"
    )
    return {str(r[0]): (r[1], r[2], r[3], r[4], r[5] or "") for r in rows}


def shown(listed: Sequence[dict[str, Any]]) -> dict[str, tuple[str, str, str | None, str, str]]:
    """uuid → what a member's listing shows of it."""
    return {
        i["uuid"]: (
            i["name"],
            i["vm_state"],
            i["task_state"],
            i["power_state"],
            "" if i["location"] == "none" else i["location"],
        )
        for i in listed
    }


async def settle(cluster: Cluster, bound: float) -> float:
    """Until every member holds its lease, no task is claimed and every member lists what the
    store holds (at most ``bound`` seconds); how long it took."""
    started = time.monotonic()
    while time.monotonic() - started < bound:
        try:
            online = cluster.online()
            rows = store_rows(cluster)
        except Exception:  # the store is still starting: not settled yet
            await sleep(POLL_SECONDS)
            continue
        settled = all(online.get(name) for name in cluster.members) and not any(
            row[2] is not None for row in rows.values()
        )
        for incarnation in cluster.live():
            listed = await listing(incarnation) if settled else None
            settled = listed is not None and shown(listed) == rows
        if settled:
            break
        await sleep(POLL_SECONDS)
    return time.monotonic() - started


def _event_time(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def member_spans(cluster: Cluster, recorder: Recorder) -> list[Span]:
    """What each daemon said it ran: its own ``instance-state`` events, by instance key."""
    spans = []
    for incarnation in cluster.every_incarnation():
        steps = []
        for event in recorder.events.get(incarnation.label, []):
            metadata = event.get("metadata") or {}
            context = metadata.get("context") or {}
            if event.get("location") != incarnation.member or context.get("resynced"):
                continue
            name = str(metadata.get("source", "")).removeprefix("/1.0/instances/")
            key = recorder.keys.get(name)
            action = metadata.get("action")
            if key is None or action not in ("instance-state", "instance-deleted"):
                continue
            task = context.get("task_state") if action == "instance-state" else None
            steps.append((_event_time(event), key, task))
        spans += spans_from_events(
            steps, incarnation.member, incarnation.label, incarnation.epoch, incarnation.ended
        )
    return spans


def build_history(
    cluster: Cluster,
    recorder: Recorder,
    faults: Faults,
    views: dict[str, list[dict[str, Any]]],
) -> History:
    """Everything recorded, with the store's rows and the VMs as they are now."""
    keys = recorder.keys
    created = cluster.query(
        "SELECT instance_uuid, instance FROM actions WHERE action = 'create'"
        " AND instance_uuid IS NOT NULL"
    )
    by_uuid = {str(uuid): keys[name] for uuid, name in created if name in keys}
    store_spans: list[Span] = []
    notes: list[Span] = []
    for uuid, action, started, finished in cluster.query(
        "SELECT instance_uuid, action, started_at, finished_at FROM actions ORDER BY id"
    ):
        key = by_uuid.get(str(uuid))
        if key is None:
            continue
        span = Span(
            key, str(action), float(started), None if finished is None else float(finished)
        )
        (store_spans if action in STORE_ACTIONS else notes).append(span)
    listed = next(iter(views.values()), [])
    limits = {i["uuid"]: i["limits"] for i in listed}
    snapshots: dict[str, set[str]] = {}
    for instance, name in cluster.query("SELECT instance, name FROM snapshots"):
        snapshots.setdefault(str(instance), set()).add(str(name))
    final = []
    for uuid, (name, vm_state, task_state, power, owner) in store_rows(cluster).items():
        size = limits.get(uuid, {"memory_mib": 0, "cpus": 0})
        final.append(
            FinalInstance(
                by_uuid.get(uuid, f"uuid:{uuid}"),
                name,
                owner,
                vm_state,
                task_state,
                power,
                int(size["memory_mib"]),
                int(size["cpus"]),
                frozenset(snapshots.get(name, set())),
            )
        )
    members = cluster.online()
    problems = []
    for member in cluster.members.values():
        mine = [i for i in listed if i["location"] == member.name]
        problems += vm_problems(member.current.data_dir, mine)
    for data_dir in faults.retired_dirs:
        problems += [
            f"VM pid {vm.pid} of a replaced daemon still runs ({run_dir})"
            for run_dir, vm in vm_processes(data_dir).items()
        ]
    return History(
        ops=recorder.ops,
        store_spans=store_spans,
        member_spans=member_spans(cluster, recorder),
        notes=notes,
        grants=[
            Grant(i.member, i.epoch, i.joined or i.spawned, i.label)
            for i in cluster.every_incarnation()
        ],
        final=final,
        members=members,
        views={
            label: {by_uuid.get(uuid, f"uuid:{uuid}"): row for uuid, row in shown(listed).items()}
            for label, listed in views.items()
        },
        problems=problems,
        lingering=faults.lingering,
    )


# -- the run ------------------------------------------------------------------------------


async def run(args: argparse.Namespace, root: str, out: list[str]) -> None:
    report(f"seed={args.seed}")
    names = [f"m{index + 1}" for index in range(args.members)]
    plan = schedule(args.seed, args.faults, names, args)
    try:
        server = postgres_server()
    except SkipTest as e:
        raise SystemExit(f"cluster_faults: {e}") from None
    database = server.create_database(migrated=True)
    proxy = FaultProxy(reactor)
    cluster = Cluster(
        root,
        server,
        database,
        names,
        args.lease_seconds,
        proxy,
        ("--power-sync-interval", "2"),
    )
    recorder = Recorder()
    guests: dict[str, Guests] = {}
    faults = Faults(cluster, proxy, guests, recorder, args)
    workload = Workload(cluster, guests, recorder, args)

    def sync_guests() -> None:
        for each in list(guests.values()):
            each.sync()

    syncing = LoopingCall(sync_guests)
    syncing.clock = reactor
    try:
        began = time.monotonic()
        await cluster.start()
        for incarnation in cluster.live():
            guests[incarnation.data_dir] = Guests(
                incarnation.data_dir, os.path.join(incarnation.data_dir, "agents")
            )
            await recorder.listen(incarnation)
        await known_to_all(cluster)
        syncing.start(GUEST_SYNC_SECONDS)
        report(f"members={args.members} serving after {time.monotonic() - began:.1f}s")
        await workload.populate()
        report(f"instances={args.instances} launched after {time.monotonic() - began:.1f}s")
        workload.start()
        kinds: Counter[str] = Counter()
        for index, fault in enumerate(plan, 1):
            await sleep(fault.pause)
            at = time.monotonic() - began
            what = await faults.inject(fault)
            kinds[fault.kind] += 1
            report(f"fault {index}/{len(plan)} at +{at:.1f}s: {fault.kind}: {what}")
        await faults.heal_all()
        await sleep(args.after)
        await workload.stop()
        settled = await settle(cluster, args.settle)
        views = {}
        for incarnation in cluster.live():
            listed = await listing(incarnation)
            if listed is not None:
                views[incarnation.label] = listed
        history = build_history(cluster, recorder, faults, views)
        verdict = check(history)
        outcomes = Counter(op.outcome for op in recorder.ops)
        report(
            f"settled in {settled:.1f}s; faults {dict(kinds)}; operations {dict(outcomes)}; "
            f"{len(history.store_spans)} actions in the store, "
            f"{len(history.member_spans)} told by the daemons"
        )
        show(verdict, args.shown)
        if args.history:
            write_history(args.history, history, plan, args.seed, recorder)
        out.append(f"faults={len(plan)} actions={len(recorder.ops)} " + verdict.summary())
    finally:
        if syncing.running:
            syncing.stop()
        recorder.close()
        await faults.heal_all()
        cluster.kill_all()
        for each in guests.values():
            each.stop()
        for member in cluster.members.values():
            for data_dir in {i.data_dir for i in member.incarnations}:
                kill_vms(data_dir)
        with contextlib.suppress(Exception):  # bounded: nothing is left to close it for
            await Deferred.fromCoroutine(proxy.close()).addTimeout(STOP_GRACE, reactor)
        with contextlib.suppress(Exception):
            server.drop_database(database)


async def known_to_all(cluster: Cluster, timeout: float = 60.0) -> None:
    """Until every member's daemon lists every member (a member just joined is refused as
    unknown by those that have not read it yet)."""
    deadline = time.monotonic() + timeout
    for incarnation in cluster.live():
        while True:
            listed = await incarnation.client.get("/1.0/cluster/members")
            if len(listed) == len(cluster.members):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"{incarnation.label} does not list every member: {listed}")
            await sleep(POLL_SECONDS)


def show(verdict: Verdict, most: int) -> None:
    """Each violation (at most ``most`` of each rule)."""
    shown_by_rule: Counter[str] = Counter()
    for violation in verdict.violations:
        shown_by_rule[violation.rule] += 1
        if shown_by_rule[violation.rule] <= most:
            report(f"  {violation.line()}")
    for rule, count in shown_by_rule.items():
        if count > most:
            report(f"  … and {count - most} more {rule}")


def write_history(
    path: str, history: History, plan: Sequence[Fault], seed: int, recorder: Recorder
) -> None:
    """Everything recorded, and every event each daemon sent on its own stream, as JSON."""
    document = {
        "seed": seed,
        "faults": [attrs.asdict(f) for f in plan],
        "history": attrs.asdict(history),
        "events": recorder.events,
    }
    with open(path, "w") as f:
        json.dump(document, f, indent=1, default=sorted)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the faults; print a line per fault, the violations, and the counts last."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--members", type=int, default=3, choices=(2, 3, 4, 5))
    parser.add_argument("--seed", type=int, default=None, help="default: chosen and printed")
    parser.add_argument("--instances", type=int, default=6, help="instances kept launched")
    parser.add_argument("--clients", type=int, default=3, help="clients acting at once")
    parser.add_argument("--think", type=float, default=0.3, help="most seconds between actions")
    parser.add_argument("--gap", type=float, default=4.0, help="most seconds between faults")
    parser.add_argument("--lease-seconds", type=float, default=3.0)
    parser.add_argument("--takeover-share", type=float, default=0.5)
    parser.add_argument(
        "--kinds",
        type=lambda text: tuple(text.split(",")),
        default=KINDS,
        help=f"the kinds of fault to draw from (default {','.join(KINDS)})",
    )
    parser.add_argument("--after", type=float, default=3.0, help="seconds of load after")
    parser.add_argument("--settle", type=float, default=90.0, help="bound for settling")
    parser.add_argument("--shown", type=int, default=10, help="violations shown per rule")
    parser.add_argument("--history", help="write the recorded history to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the data dirs")
    args = parser.parse_args(argv)
    if args.faults < 0:
        parser.error(f"--faults must be 0 or more, not {args.faults}")
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown or not args.kinds:
        parser.error(f"--kinds takes {','.join(KINDS)}, not {','.join(unknown) or 'nothing'}")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1_000_000)
    raise_file_limit()
    # Short: the VMs' guest sockets live under it and must stay below 107 bytes.
    root = tempfile.mkdtemp(prefix="vmcf-", dir="/tmp")
    out: list[str] = []

    def cleanup() -> None:
        if args.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)

    react(lambda: run(args, root, out), out, cleanup)


if __name__ == "__main__":
    main()
