"""The faults of ``cluster_faults``: their schedule, drawn from the seed, and their injection."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Sequence
from typing import Any

import attrs
from twisted.internet.threads import deferToThread

from benchmarks._clusterworld import Cluster, Incarnation, Member
from benchmarks._crashworld import Guests, kill_vms, vm_processes
from benchmarks._faultacts import FENCE_LOG, fence_kills
from benchmarks._faultproxy import FaultProxy
from benchmarks._faultworkload import POLL_SECONDS, Recorder
from benchmarks._measure import sleep
from vmready.fence import VMProcess

KINDS = ("postgres", "kill", "freeze", "partition")
STOP_GRACE = 30.0


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
        # (member, what): VMs still running when another daemon took their member over.
        self.outlived: list[tuple[str, str]] = []
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
        ran_out = time.time()
        alive = vm_processes(frozen.data_dir)
        self.outlived += [
            (
                member.name,
                f"VM {os.path.basename(run_dir)} (process {vm.pid}) of frozen {frozen.label} "
                "still ran once its lease had run out, as its name was taken over",
            )
            for run_dir, vm in sorted(alive.items())
        ]
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
        self.outlived += self.killed_after(member.name, frozen, ran_out, alive)
        self.retire(frozen.data_dir)
        return (
            f"{frozen.label} frozen for {time.monotonic() - started:.1f}s, taken over by "
            f"{successor.label}; {outcome}"
        )

    def killed_after(
        self, member: str, frozen: Incarnation, ran_out: float, alive: dict[str, VMProcess]
    ) -> list[tuple[str, str]]:
        """The VMs of ``frozen`` its host fence killed after its lease ran out (at ``ran_out``):
        started by it after the takeover, or alive then (those are counted already)."""
        counted = {vm.pid for vm in alive.values()}
        return [
            (
                member,
                f"VM {name} (process {pid}) of {frozen.label} ran after its lease had run out: "
                f"its host fence killed it at {at:.3f}",
            )
            for at, name, pid in fence_kills(os.path.join(frozen.data_dir, FENCE_LOG))
            if at > ran_out and pid not in counted
        ]

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
