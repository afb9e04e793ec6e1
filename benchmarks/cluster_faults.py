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
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence

from twisted.internet.defer import Deferred
from twisted.internet.task import LoopingCall
from twisted.trial.unittest import SkipTest

from benchmarks._clusterworld import Cluster
from benchmarks._crashworld import Guests, kill_vms
from benchmarks._faultproxy import FaultProxy
from benchmarks._faultschedule import KINDS, STOP_GRACE, Fault, Faults, schedule
from benchmarks._faultverdict import build_history, listing, settle, show, write_history
from benchmarks._faultworkload import POLL_SECONDS, Recorder, Workload
from benchmarks._history import Verdict, check
from benchmarks._measure import react, reactor, report, sleep
from tests.postgres import postgres_server
from vmready.domain import raise_file_limit

GUEST_SYNC_SECONDS = 0.5


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
    options = ("--power-sync-interval", "2", "--fence", args.fence)
    cluster = Cluster(root, server, database, names, args.lease_seconds, proxy, options)
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
        await start(cluster, recorder, guests)
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
        verdict = await conclude(cluster, recorder, faults, plan, kinds, args)
        out.append(f"faults={len(plan)} actions={len(recorder.ops)} " + verdict.summary())
    finally:
        if syncing.running:
            syncing.stop()
        await tear_down(cluster, recorder, guests, faults, proxy)
        with contextlib.suppress(Exception):
            server.drop_database(database)


async def start(cluster: Cluster, recorder: Recorder, guests: dict[str, Guests]) -> None:
    """The members started, their guests' agents and event streams followed, each knowing all."""
    await cluster.start()
    for incarnation in cluster.live():
        guests[incarnation.data_dir] = Guests(
            incarnation.data_dir, os.path.join(incarnation.data_dir, "agents")
        )
        await recorder.listen(incarnation)
    await known_to_all(cluster)


async def conclude(
    cluster: Cluster,
    recorder: Recorder,
    faults: Faults,
    plan: Sequence[Fault],
    kinds: Counter[str],
    args: argparse.Namespace,
) -> Verdict:
    """Once the cluster settled: the history checked, its violations shown (and written)."""
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
    return verdict


async def tear_down(
    cluster: Cluster,
    recorder: Recorder,
    guests: dict[str, Guests],
    faults: Faults,
    proxy: FaultProxy,
) -> None:
    """Everything healed, then killed: daemons, agents, VMs, the proxy."""
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
        "--fence",
        choices=("vms", "none"),
        default="vms",
        help="the members' --fence (default vms: each member's host fence kills its VMs "
        "once its lease may have run out)",
    )
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
