"""The steps on VMs each daemon's own log tells of (``Act``), for the double-master rule.

A daemon's events say which task it announced; its log says what it did to a
VM's process from the host: started it, pressed its power button, forced or
killed it.  A daemon frozen with a task open that does none of these after
waking did not act; one that does, did (``benchmarks._history``).

twistd's text log stamps each line to the second: an act is taken to be at
the *end* of its second, so that a doubt counts against the daemon.  What a
daemon only *saw* (its VM's process number once it runs, its monitor closing
as the VM exited) is no act: a VM that a step before a takeover left running
after it is caught where it runs (``Faults``: the VMs alive once the lease
ran out, and the host fence's kills after it, ``fence_kills``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import datetime

from benchmarks._clusterworld import Incarnation
from benchmarks._history import Act

__all__ = ["FENCE_LOG", "acts_in_log", "fence_kills", "log_acts"]

_LINE = re.compile(r"^(?P<time>\S+) \[vmready\.hypervisor\.[^\]]*\] (?P<message>.*)$")
_NAME = r"(?P<name>[^\s:()]+)"
# What the hypervisor's log says when it does something to a VM, the VM's name in it.
_ACTS = tuple(
    re.compile(pattern)
    for pattern in (
        rf"^starting VM {_NAME}: ",
        rf"^killing (?:half-started )?VM {_NAME} \(process ",
        rf"^pressed the ACPI power button of {_NAME}",
        rf"^VM {_NAME} did not power off within .*; forcing it",
        rf"^QEMU refused (?:quit|system_powerdown) for {_NAME}: ",
    )
)


def acts_in_log(
    lines: Iterable[str], keys: Mapping[str, str], member: str, actor: str, epoch: int | None
) -> list[Act]:
    """The acts in the log ``lines`` of daemon ``actor`` (member ``member``'s, under
    ``epoch``), on the instances ``keys`` names (name → the harness' key)."""
    found = []
    for line in lines:
        matched = _LINE.match(line.rstrip("\n"))
        if matched is None:
            continue
        message = matched["message"]
        for pattern in _ACTS:
            act = pattern.match(message)
            if act is None or act["name"] not in keys:
                continue
            at = datetime.strptime(matched["time"], "%Y-%m-%dT%H:%M:%S%z").timestamp() + 1.0
            found.append(Act(keys[act["name"]], at, message[:120], member, actor, epoch))
            break
    return found


def log_acts(incarnations: Iterable[Incarnation], keys: Mapping[str, str]) -> list[Act]:
    """The acts in the logs of ``incarnations`` (a log not there tells of none)."""
    found = []
    for incarnation in incarnations:
        try:
            with open(incarnation.daemon.log_path, encoding="utf-8", errors="replace") as log:
                found += acts_in_log(
                    log, keys, incarnation.member, incarnation.label, incarnation.epoch
                )
        except FileNotFoundError:
            continue
    return found


FENCE_LOG = "fence.log"
# The host fence's own log (``vmready.fence``): a line per VM it killed, to the millisecond.
_FENCE_KILL = re.compile(
    r"^(?P<time>\S+) \[vmready\.fence\] member \S+: "
    r"killed VM (?P<vm>\S+) \(process (?P<pid>\d+)\)$"
)


def fence_kills(log_path: str) -> list[tuple[float, str, int]]:
    """(when, run dir name, pid) of each VM the host fence logging to ``log_path`` killed."""
    found = []
    try:
        with open(log_path, encoding="utf-8", errors="replace") as log:
            for line in log:
                matched = _FENCE_KILL.match(line.rstrip("\n"))
                if matched is not None:
                    at = datetime.strptime(matched["time"], "%Y-%m-%dT%H:%M:%S.%f%z")
                    found.append((at.timestamp(), matched["vm"], int(matched["pid"])))
    except FileNotFoundError:
        return []
    return found
