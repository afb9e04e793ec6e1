"""The checker of a cluster's recorded history: lost, stuck, inconsistent, double master.

``benchmarks/cluster_faults.py`` records what its clients asked and were told
(``ClientOp``), what the store and the members say ran (``Span``: one action on
one instance, from its start to its end), which daemon held each member's
lease from when (``Grant``), and the state everything settled in
(``FinalInstance``, the members' own listings, the VMs).  ``check`` reads all
of it and says what is wrong, by four rules:

- **lost**: an operation a client was told succeeded left a fact (the
  instance exists, or is gone; runs, or is stopped; has its new name; its
  confirmed size; its snapshot) that the final state does not show, and
  nothing later explains: no later operation on that attribute that ran (ok
  or failed), no operation whose outcome the client never learnt that the
  store shows started after it, no action of the daemon's own (a VM that
  exited, a power sync, a recovery) on it afterwards.
- **stuck**: an instance still in a task once everything settled, or an
  action whose end the store never recorded.
- **inconsistent**: an instance whose member is none, unknown or not online;
  a member whose own listing disagrees with the store; a VM that does not
  match its instance (``problems`` found by the harness, e.g. a running
  instance without a VM, a VM of no instance, a VM of another size).
- **double master**: two actions on one instance that overlap in time (the
  store's compare-and-swap on the task allows one at a time: an overlap is
  two daemons acting on it at once; an action whose end was never recorded is
  judged by the stuck rule, not here), or an action by a daemon under a lease
  epoch that another daemon had taken over before the action started, or a
  step on a VM (``Act``: its own log says it started, killed, stopped or
  forced it) by a daemon whose member another daemon had taken over by then,
  or a daemon that went on running after another took its member over.
  Counted once per instance (or member).  A task a daemon announced and never
  closed because it ended first (frozen, then stopped when it learnt of the
  takeover) is judged up to the last moment it showed itself acting on that
  instance (its own events, its acts), not up to its end: being frozen with a
  task open is not acting, doing something after waking is.

The checker is plain functions over plain records: it is tested on synthetic
histories (``tests/benchmarks/test_history.py``), one per violation.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs

__all__ = [
    "ATTRIBUTES",
    "RULES",
    "Act",
    "ClientOp",
    "FinalInstance",
    "Grant",
    "History",
    "Outcome",
    "Span",
    "Verdict",
    "Violation",
    "check",
    "history_from_json",
    "spans_from_events",
    "with_acts",
]

Outcome = Literal["ok", "refused", "failed", "unknown"]
RULES = ("lost", "stuck", "inconsistent", "double_master")

# Which attribute of an instance each operation of a client can change.
ATTRIBUTES: Mapping[str, frozenset[str]] = {
    "launch": frozenset({"exists", "power"}),
    "delete": frozenset({"exists"}),
    "start": frozenset({"power"}),
    "stop": frozenset({"power"}),
    "restart": frozenset({"power"}),
    "rename": frozenset({"name"}),
    "resize": frozenset({"limits"}),
    "confirm-resize": frozenset({"limits"}),
    "revert-resize": frozenset({"limits"}),
    "snapshot": frozenset({"snapshots"}),
    "ready": frozenset(),
}
# The actions the store records for each operation ("launch" is the store's "create").
STORE_ACTION = {"launch": "create"}
# What the daemon's own actions (not a client's) can change: a VM that exited or panicked,
# a power sync that found it otherwise, a recovery at start, a retry under TCG.
SYSTEM_ATTRIBUTES: Mapping[str, frozenset[str]] = {
    "vm-exited": frozenset({"power"}),
    "guest-panicked": frozenset({"power"}),
    "power-sync": frozenset({"power"}),
    "recover": frozenset({"power", "limits"}),
    "accelerator": frozenset({"power"}),
}
RUNNING_STATES = frozenset({"active", "resized"})


@attrs.frozen
class ClientOp:
    """One operation a client sent, and what it was told.

    ``instance`` is the harness' key of the instance (the name it was
    launched with: names are never used twice), ``name`` the name the
    request used.  ``outcome``: ``ok`` (done, or the operation succeeded),
    ``refused`` (a 4xx before anything ran), ``failed`` (its operation
    failed: it ran, and may have changed something), ``unknown`` (no answer,
    or one that says the request may have been carried out).  ``params``:
    what it set (``new_name``, ``snapshot``, ``memory`` and ``cpus`` a
    confirmed or reverted resize leaves).
    """

    id: int
    kind: str
    instance: str
    name: str
    via: str
    invoked: float
    completed: float
    outcome: Outcome
    detail: str = ""
    params: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Span:
    """One action on one instance from its start to its end (None: never recorded).

    ``actor`` (which daemon ran it) and ``epoch`` (the lease epoch of its
    member it ran under) when whoever recorded it knows them.
    """

    instance: str
    action: str
    started: float
    finished: float | None
    member: str = ""
    actor: str | None = None
    epoch: int | None = None
    # A task its daemon never closed because the daemon ended first: the last moment the
    # daemon showed itself acting on the instance (its events, its acts). None: ``finished``.
    acted_until: float | None = None

    @property
    def end(self) -> float:
        """Until when it ran, as far as anyone acted (an unfinished span runs on forever)."""
        if self.acted_until is not None:
            return self.acted_until
        return math.inf if self.finished is None else self.finished

    def overlaps(self, other: Span) -> bool:
        """Whether the two ran at one moment."""
        return self.started < other.end and other.started < self.end


@attrs.frozen
class Act:
    """A step on an instance's VM that a daemon's own log says it took, at ``at``."""

    instance: str
    at: float
    what: str
    member: str
    actor: str
    epoch: int | None


@attrs.frozen
class Grant:
    """Member ``member``'s lease taken by the daemon ``actor`` at ``at``: epoch ``epoch``."""

    member: str
    epoch: int
    at: float
    actor: str = ""


@attrs.frozen
class FinalInstance:
    """An instance as the store holds it once everything settled."""

    instance: str
    name: str
    member: str
    vm_state: str
    task_state: str | None
    power_state: str
    memory_mib: int
    cpus: int
    snapshots: frozenset[str] = frozenset()

    @property
    def runs(self) -> bool:
        return self.vm_state in RUNNING_STATES and self.power_state == "running"

    @property
    def stopped(self) -> bool:
        return self.vm_state == "stopped"

    def shown(self) -> tuple[str, str, str | None, str, str]:
        """What a member's listing must agree on."""
        return (self.name, self.vm_state, self.task_state, self.power_state, self.member)


@attrs.frozen
class History:
    """Everything the harness recorded.

    ``store_spans``: the actions the store recorded (the client's and the
    daemons' own: ``notes`` are the latter's, kept apart as explanations);
    ``member_spans``: what each daemon itself said it ran (its own events);
    the overlap rule is applied to each list alone, since both may tell of
    one action.  ``views``: each member's own listing, instance → ``shown()``.
    ``members``: each member and whether it held its lease at the end.
    ``problems``: what the harness found wrong with the VMs; ``lingering``:
    (member, what happened) for each daemon that went on running after
    another took its member over; ``outlived``: (member, what) for each VM
    still running when another daemon took its member over (the lease it was
    started under had run out: the instance had two masters, whatever its old
    daemon did); ``acts``: the steps on VMs the daemons' logs tell of.
    """

    ops: Sequence[ClientOp] = ()
    store_spans: Sequence[Span] = ()
    member_spans: Sequence[Span] = ()
    notes: Sequence[Span] = ()
    grants: Sequence[Grant] = ()
    final: Sequence[FinalInstance] = ()
    members: Mapping[str, bool] = attrs.field(factory=dict)
    views: Mapping[str, Mapping[str, tuple[str, str, str | None, str, str]]] = attrs.field(
        factory=dict
    )
    problems: Sequence[str] = ()
    lingering: Sequence[tuple[str, str]] = ()
    acts: Sequence[Act] = ()
    outlived: Sequence[tuple[str, str]] = ()


@attrs.frozen
class Violation:
    """One thing wrong: its rule, what it is about, why."""

    rule: str
    subject: str
    detail: str

    def line(self) -> str:
        return f"{self.rule}: {self.subject}: {self.detail}"


@attrs.frozen
class Verdict:
    """What ``check`` found."""

    violations: Sequence[Violation]

    def count(self, rule: str) -> int:
        """How many of ``rule``; double masters once per instance."""
        found = [v for v in self.violations if v.rule == rule]
        if rule == "double_master":
            return len({v.subject for v in found})
        return len(found)

    def summary(self) -> str:
        """``lost=… stuck=… inconsistent=… double_master=…``."""
        return " ".join(f"{rule}={self.count(rule)}" for rule in RULES)


def check(history: History) -> Verdict:
    """Every violation in ``history``, rule by rule."""
    return Verdict(
        [
            *lost(history),
            *stuck(history),
            *inconsistent(history),
            *double_masters(history),
        ]
    )


# -- lost -------------------------------------------------------------------------


def _expected(op: ClientOp, final: FinalInstance | None) -> Iterable[tuple[str, str, bool]]:
    """(attribute, what it should be, whether the final state shows it) for an ok ``op``."""
    kind, params = op.kind, op.params
    exists = final is not None
    if kind == "launch":
        yield "exists", "exists", exists
    elif kind == "delete":
        yield "exists", "gone", not exists
    if final is None:
        return  # gone: nothing else of it can be seen (its existence is judged above)
    if kind in ("launch", "start", "restart"):
        yield "power", "running", final.runs
    elif kind == "stop":
        yield "power", "stopped", final.stopped
    elif kind == "rename":
        yield "name", f"called {params['new_name']}", final.name == params["new_name"]
    elif kind in ("confirm-resize", "revert-resize") and "memory" in params:
        size = (int(params["memory"]), int(params["cpus"]))
        yield "limits", f"{size[0]} MiB/{size[1]} cpus", (final.memory_mib, final.cpus) == size
    elif kind == "snapshot":
        yield (
            "snapshots",
            f"has snapshot {params['snapshot']}",
            params["snapshot"] in (final.snapshots),
        )


def _explained(
    op: ClientOp, attribute: str, ops: Sequence[ClientOp], history: History
) -> str | None:
    """What explains that ``op``'s fact on ``attribute`` is not in the final state, or None."""
    for later in ops:
        if later is op or attribute not in ATTRIBUTES.get(later.kind, frozenset()):
            continue
        if later.outcome in ("ok", "failed") and later.invoked > op.invoked:
            return f"a later {later.kind} (op {later.id}, {later.outcome})"
        if later.outcome == "unknown":
            action = STORE_ACTION.get(later.kind, later.kind)
            ran = [
                s
                for s in history.store_spans
                if s.instance == op.instance and s.action == action and s.started > op.completed
            ]
            if ran:
                return f"{later.kind} op {later.id} (outcome unknown) ran after it"
    for note in history.notes:
        if (
            note.instance == op.instance
            and note.started > op.completed
            and attribute in SYSTEM_ATTRIBUTES.get(note.action, frozenset())
        ):
            return f"the daemon's own {note.action} after it"
    return None


def lost(history: History) -> list[Violation]:
    """Facts clients were told of that the final state lacks, unexplained."""
    final = {f.instance: f for f in history.final}
    by_instance: dict[str, list[ClientOp]] = defaultdict(list)
    for op in history.ops:
        by_instance[op.instance].append(op)
    found = []
    for instance, ops in by_instance.items():
        ops.sort(key=lambda o: o.invoked)
        for op in ops:
            if op.outcome != "ok":
                continue
            for attribute, expected, shown in _expected(op, final.get(instance)):
                if shown or _explained(op, attribute, ops, history) is not None:
                    continue
                found.append(
                    Violation(
                        "lost",
                        instance,
                        f"{op.kind} (op {op.id} via {op.via}) was acknowledged, so it should "
                        f"be {expected}; it is not, and nothing later explains it",
                    )
                )
    return found


# -- stuck --------------------------------------------------------------------------


def stuck(history: History) -> list[Violation]:
    """Tasks left claimed and actions never ended, once everything settled."""
    found = [
        Violation("stuck", f.instance, f"still in task {f.task_state}")
        for f in history.final
        if f.task_state is not None
    ]
    found += [
        Violation("stuck", s.instance, f"its {s.action} started at {s.started:.3f} never ended")
        for s in history.store_spans
        if s.finished is None
    ]
    return found


# -- inconsistent ---------------------------------------------------------------------


def inconsistent(history: History) -> list[Violation]:
    """Owners that are none, unknown or offline; members that disagree; VMs that do not match."""
    found = []
    store = {f.instance: f.shown() for f in history.final}
    for f in history.final:
        if not f.member:
            found.append(Violation("inconsistent", f.instance, "no member owns it"))
        elif f.member not in history.members:
            found.append(
                Violation("inconsistent", f.instance, f"its member {f.member} is no member")
            )
        elif not history.members[f.member]:
            found.append(
                Violation("inconsistent", f.instance, f"its member {f.member} is not online")
            )
    for member, view in sorted(history.views.items()):
        for instance in sorted(store.keys() | view.keys()):
            seen, truth = view.get(instance), store.get(instance)
            if seen != truth:
                found.append(
                    Violation(
                        "inconsistent",
                        instance,
                        f"member {member} shows {seen}, the store holds {truth}",
                    )
                )
    found += [Violation("inconsistent", "vm", problem) for problem in history.problems]
    return found


# -- double master ----------------------------------------------------------------------


def double_masters(history: History) -> list[Violation]:
    """Overlapping actions on one instance, and actions under a lease taken over."""
    found = []
    for source, spans in (("store", history.store_spans), ("members", history.member_spans)):
        by_instance: dict[str, list[Span]] = defaultdict(list)
        for span in spans:
            by_instance[span.instance].append(span)
        for instance, mine in sorted(by_instance.items()):
            ended = sorted((s for s in mine if s.finished is not None), key=_start)
            for first, second in itertools.combinations(ended, 2):
                if first.overlaps(second):
                    found.append(
                        Violation(
                            "double_master",
                            instance,
                            f"{_described(first)} and {_described(second)} overlap "
                            f"(as the {source} recorded them)",
                        )
                    )
    grants: dict[str, list[Grant]] = defaultdict(list)
    for grant in history.grants:
        grants[grant.member].append(grant)
    late = [
        (span.instance, span.member, span.epoch, span.started, f"{_described(span)} ran")
        for span in [*history.store_spans, *history.member_spans]
    ]
    late += [
        (act.instance, act.member, act.epoch, act.at, f"{act.actor} acted on its VM ({act.what})")
        for act in history.acts
    ]
    for instance, member, epoch, at, what in late:
        taken = _taken_over(grants.get(member, []), epoch, at)
        if taken is not None:
            by = f", by {taken.actor}" if taken.actor else ""
            found.append(
                Violation(
                    "double_master",
                    instance,
                    f"{what} at {at:.3f} under epoch {epoch} of member {member}, taken over "
                    f"at {taken.at:.3f} (epoch {taken.epoch}{by})",
                )
            )
    found += [Violation("double_master", member, what) for member, what in history.lingering]
    found += [Violation("double_master", member, what) for member, what in history.outlived]
    return found


def _taken_over(grants: Sequence[Grant], epoch: int | None, at: float) -> Grant | None:
    """The first grant of a newer epoch than ``epoch`` made by ``at``, or None."""
    if epoch is None:
        return None
    newer = [g for g in grants if g.epoch > epoch and g.at <= at]
    return min(newer, key=lambda g: g.at) if newer else None


def _start(span: Span) -> float:
    return span.started


def _described(span: Span) -> str:
    end = "never ended" if span.finished is None else f"to {span.finished:.3f}"
    if span.acted_until is not None:
        end += f", last seen acting at {span.acted_until:.3f}"
    who = f" by {span.actor}" if span.actor else ""
    return f"{span.action}{who} ({span.started:.3f} {end})"


# -- spans from a member's own events -----------------------------------------------------


def spans_from_events(
    events: Iterable[tuple[float, str, str | None]],
    member: str,
    actor: str,
    epoch: int | None,
    until: float | None = None,
) -> list[Span]:
    """The tasks a daemon ran, from its own events in order: (time, instance, task_state),
    task_state None once the instance shows no task (or is gone).

    A task runs from the first event naming it to the next event without one;
    one still running when the daemon ended (``until``: it was killed, or
    stopped) ran until then, and the daemon was last seen acting on it at its
    last event on it (``acted_until``); one still running in a daemon that
    lives on never ended.
    """
    running: dict[str, tuple[str, float]] = {}
    last: dict[str, float] = {}
    spans = []
    for at, instance, task in events:
        if task is not None:
            running.setdefault(instance, (task, at))
            last[instance] = at
            continue
        begun = running.pop(instance, None)
        if begun is not None:
            spans.append(Span(instance, begun[0], begun[1], at, member, actor, epoch))
    spans += [
        Span(
            instance,
            task,
            at,
            until,
            member,
            actor,
            epoch,
            acted_until=None if until is None else last[instance],
        )
        for instance, (task, at) in running.items()
    ]
    return spans


def with_acts(spans: Iterable[Span], acts: Sequence[Act]) -> list[Span]:
    """``spans`` whose daemon was last seen acting (``acted_until``) later, by an act of its
    own on the instance while the span ran."""
    extended = []
    for span in spans:
        if span.acted_until is not None:
            end = math.inf if span.finished is None else span.finished
            times = [
                act.at
                for act in acts
                if act.actor == span.actor
                and act.instance == span.instance
                and span.started <= act.at <= end
            ]
            span = attrs.evolve(span, acted_until=max([span.acted_until, *times]))
        extended.append(span)
    return extended


# -- a history written as JSON, read back ---------------------------------------------------


def history_from_json(document: Mapping[str, Any]) -> History:
    """The ``History`` that ``attrs.asdict`` gave ``document`` (tuples and sets as lists), as
    ``benchmarks/cluster_faults.py --history`` writes it: checked again, it gives the same
    verdict."""

    def row(values: Sequence[Any]) -> tuple[str, str, str | None, str, str]:
        name, vm_state, task_state, power_state, member = values
        return (name, vm_state, task_state, power_state, member)

    return History(
        ops=[ClientOp(**op) for op in document["ops"]],
        store_spans=[Span(**span) for span in document["store_spans"]],
        member_spans=[Span(**span) for span in document["member_spans"]],
        notes=[Span(**span) for span in document["notes"]],
        grants=[Grant(**grant) for grant in document["grants"]],
        final=[
            FinalInstance(**{**final, "snapshots": frozenset(final["snapshots"])})
            for final in document["final"]
        ],
        members=dict(document["members"]),
        views={
            member: {instance: row(values) for instance, values in view.items()}
            for member, view in document["views"].items()
        },
        problems=list(document["problems"]),
        lingering=[(member, what) for member, what in document["lingering"]],
        acts=[Act(**act) for act in document.get("acts", [])],
        outlived=[(member, what) for member, what in document.get("outlived", [])],
    )
