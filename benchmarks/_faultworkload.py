"""The clients of ``cluster_faults``: what they do through random members, what they hear."""

from __future__ import annotations

import errno
import os
import random
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import attrs
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.error import ConnectError

from benchmarks._clusterworld import Cluster, Incarnation
from benchmarks._crashworld import Guests, run_dir_of
from benchmarks._fleet import notify
from benchmarks._history import (
    ClientOp,
    Outcome,
)
from benchmarks._measure import reactor, report, sleep
from benchmarks.crash import CPU_CHOICES, MEMORY_CHOICES
from vmready.cli import APIError, CommandError, DaemonUnreachable, LineStream, instance_path

# Actions clients send, by the instance's vm_state (an instance mid-task gets any: a 409).
WORKLOAD_CHOICES = {
    "active": ("stop", "restart", "resize", "snapshot", "delete", "ready", "ready"),
    "stopped": ("start", "start", "resize", "snapshot", "rename", "delete"),
    "resized": ("resize-end", "resize-end", "delete", "ready"),
    "paused": ("stop", "delete"),
    "error": ("start", "delete"),
}
ALL_CHOICES = tuple(sorted({k for kinds in WORKLOAD_CHOICES.values() for k in kinds}))
REQUEST_TIMEOUT = 45.0
OPERATION_TIMEOUT = 90.0
READY_TIMEOUT = 5.0
REFRESH_SECONDS = 1.0
POLL_SECONDS = 0.2
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
        # Launched as `lxc launch` does: created and started (LXD's create alone rests stopped).
        body = {"name": name, "config": {"limits.memory": str(ref.memory)}, "start": True}
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
