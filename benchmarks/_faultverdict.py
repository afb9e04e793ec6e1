"""What ``cluster_faults`` checks: the cluster settled, the history of what was recorded."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import attrs
from twisted.internet.defer import CancelledError, TimeoutError

from benchmarks._clusterworld import Cluster, Incarnation
from benchmarks._crashworld import vm_processes
from benchmarks._faultacts import log_acts
from benchmarks._faultschedule import Fault, Faults
from benchmarks._faultworkload import POLL_SECONDS, REQUEST_TIMEOUT, Recorder, within
from benchmarks._history import (
    FinalInstance,
    Grant,
    History,
    Span,
    Verdict,
    spans_from_events,
    with_acts,
)
from benchmarks._measure import report, sleep
from benchmarks.crash import vm_problems
from vmready.cli import CommandError
from vmready.domain import ACTIONS

# The store's action rows that are actions (a task, or a rename); the rest are its own notes.
STORE_ACTIONS = frozenset({*ACTIONS, "rename"})


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
    store_spans, notes = _store_spans(cluster, by_uuid)
    listed = next(iter(views.values()), [])
    acts = log_acts(cluster.every_incarnation(), keys)
    return History(
        ops=recorder.ops,
        store_spans=store_spans,
        member_spans=with_acts(member_spans(cluster, recorder), acts),
        notes=notes,
        grants=[
            Grant(i.member, i.epoch, i.joined or i.spawned, i.label)
            for i in cluster.every_incarnation()
        ],
        final=_final(cluster, by_uuid, listed),
        members=cluster.online(),
        views={
            label: {by_uuid.get(uuid, f"uuid:{uuid}"): row for uuid, row in shown(listed).items()}
            for label, listed in views.items()
        },
        problems=_vm_problems(cluster, faults, listed),
        lingering=faults.lingering,
        outlived=faults.outlived,
        acts=acts,
    )


def _store_spans(cluster: Cluster, by_uuid: dict[str, str]) -> tuple[list[Span], list[Span]]:
    """The store's action rows, by instance key: the actions, and the store's own notes.

    Each row says which member wrote it under which lease epoch (the fencing
    token): shown as its actor.
    """
    store_spans: list[Span] = []
    notes: list[Span] = []
    for uuid, action, started, finished, member, epoch in cluster.query(
        "SELECT instance_uuid, action, started_at, finished_at, member, epoch"
        " FROM actions ORDER BY id"
    ):
        key = by_uuid.get(str(uuid))
        if key is None:
            continue
        span = Span(
            key,
            str(action),
            float(started),
            None if finished is None else float(finished),
            member=str(member),
            actor=f"{member} (lease epoch {epoch})" if member else None,
        )
        (store_spans if action in STORE_ACTIONS else notes).append(span)
    return store_spans, notes


def _final(
    cluster: Cluster, by_uuid: dict[str, str], listed: Sequence[dict[str, Any]]
) -> list[FinalInstance]:
    """Each instance as the store holds it now (its size as a member lists it)."""
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
    return final


def _vm_problems(cluster: Cluster, faults: Faults, listed: Sequence[dict[str, Any]]) -> list[str]:
    """Each member's VMs against its instances; VMs of replaced daemons still running."""
    problems = []
    for member in cluster.members.values():
        mine = [i for i in listed if i["location"] == member.name]
        problems += vm_problems(member.current.data_dir, mine)
    for data_dir in faults.retired_dirs:
        problems += [
            f"VM pid {vm.pid} of a replaced daemon still runs ({run_dir})"
            for run_dir, vm in vm_processes(data_dir).items()
        ]
    return problems


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
