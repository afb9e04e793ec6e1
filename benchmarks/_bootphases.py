"""A real guest's boot, phase by phase, from the host's and the guest's own clocks (no I/O).

``real_guest.py`` stamps every line of the guest's console log with the host's
clock when it arrives, and every lifecycle event likewise.  Lines that carry
the guest's uptime (the kernel's ``[    1.234567]`` timestamps, the demo
initramfs's ``vmready-initramfs: [1.23] …``, the agent's ``vmready-agent:
boot: process [2.31] STARTED [2.87]``, its setup's ``vmready-agent-setup:
boot: setup [1.95] copied [2.20]``) are placed on the host's clock through
the kernel's start: each such line arrived no sooner than (kernel start +
its uptime), so the kernel started no later than the smallest (arrival -
uptime) of them, which is the estimate.  Lines without a guest time count from
their arrival.  QEMU's exec is the arrival of the daemon's own ``--- vmready:
starting … ---`` line, written just before it starts QEMU.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping, Sequence

import attrs

__all__ = [
    "MILESTONES",
    "ConsoleLine",
    "Milestone",
    "guest_times",
    "kernel_start",
    "medians",
    "phase_durations",
    "timeline",
]


@attrs.frozen
class ConsoleLine:
    """One console line and when it reached the host (its clock, seconds)."""

    arrived: float
    text: str


@attrs.frozen
class Milestone:
    """A moment of a boot: its short name (for ``phases=``) and what it is."""

    name: str
    what: str


# In the order a boot passes them; a phase is the time from the previous milestone present.
MILESTONES = (
    Milestone("exec", "the daemon starts QEMU (its console mark)"),
    Milestone("kernel", "the kernel's clock starts (after the firmware, early set-up)"),
    Milestone("init", "the initramfs's /init runs"),
    Milestone("root", "root file system mounted; the agent, then systemd, starts"),
    Milestone("setup", "the agent's setup copies the drive"),
    Milestone("agent", "the agent's interpreter starts"),
    Milestone("said", "the agent writes STARTED (guest)"),
    Milestone("started", "STARTED at the host (event)"),
    Milestone("connect", "the host's CONNECT read by the agent (guest)"),
    Milestone("connected", "CONNECTED at the host (event)"),
    Milestone("relay", "the workload's PATCH reaches the agent (guest)"),
    Milestone("ready", "Ready at the host (event)"),
    Milestone("woken", "a `vmready wait NAME status=ready` client exits"),
)

_UPTIME = r"\[\s*(\d+\.\d+)\]"
_KERNEL = re.compile(r"^" + _UPTIME + r" \S")
# The demo initramfs: its first line, its module loading (older images), the root mounted.
_INIT = re.compile(r"^vmready-initramfs: " + _UPTIME + r" (?:started|loading)")
_ROOT = re.compile(r"^vmready-initramfs: " + _UPTIME + r" mounted")
_AGENT = re.compile(r"vmready-agent(?:-setup)?: boot: (.*)$")
_AGENT_MOMENT = re.compile(r"(\w+) " + _UPTIME)
_AGENT_MILESTONES = {
    "setup": "setup",
    "process": "agent",
    "STARTED": "said",
    "CONNECT": "connect",
    "relay": "relay",
}
_EXEC_MARK = "--- vmready: starting "


def guest_times(lines: Iterable[ConsoleLine]) -> dict[str, float]:
    """Each milestone the console dates on the guest's uptime clock (the first of each)."""
    found: dict[str, float] = {}
    copied: float | None = None  # the setup's copy done: the first one counts
    for line in lines:
        text = line.text.strip()
        for pattern, milestone in ((_INIT, "init"), (_ROOT, "root")):
            match = pattern.search(text)
            if match:
                found.setdefault(milestone, float(match.group(1)))
        agent = _AGENT.search(text)
        if agent:
            for moment, value in _AGENT_MOMENT.findall(agent.group(1)):
                if moment in _AGENT_MILESTONES:
                    found.setdefault(_AGENT_MILESTONES[moment], float(value))
                if moment == "copied" and copied is None:
                    copied = float(value)
    # Started by the initramfs, one process runs the setup, then becomes the agent:
    # its interpreter starts when the copy is done, not when the process was made.
    if copied is not None and "agent" in found and found["agent"] < copied:
        found["agent"] = copied
    return found


def _uptimes(line: ConsoleLine) -> list[float]:
    """The guest times a line carries (a kernel timestamp, or those of the patterns above)."""
    text = line.text.strip()
    kernel = _KERNEL.match(text)
    if kernel:
        return [float(kernel.group(1))]
    times = [float(m.group(1)) for m in (_INIT.search(text), _ROOT.search(text)) if m]
    agent = _AGENT.search(text)
    if agent:
        # Only the last moment of an agent line: the line is written right after it.
        moments = _AGENT_MOMENT.findall(agent.group(1))
        times += [float(moments[-1][1])] if moments else []
    return times


def kernel_start(lines: Iterable[ConsoleLine]) -> float | None:
    """The host's time of guest uptime 0: the smallest (arrival - uptime) of the dated lines."""
    estimates = [line.arrived - up for line in lines for up in _uptimes(line)]
    return min(estimates, default=None)


def timeline(
    lines: Sequence[ConsoleLine], host: Mapping[str, float], since: float
) -> dict[str, float]:
    """Every milestone found, in seconds of the host's clock from ``since`` (the launch).

    ``host`` holds the host's own milestones (``started``, ``connected``,
    ``ready``, ``woken``) on the same clock.
    """
    found = {name: at - since for name, at in host.items()}
    marks = [i for i, line in enumerate(lines) if line.text.startswith(_EXEC_MARK)]
    if marks:
        # This boot's lines only: a restarted guest's last words come before its mark.
        lines = lines[marks[0] :]
        found["exec"] = lines[0].arrived - since
    zero = kernel_start(lines)
    if zero is not None:
        found["kernel"] = zero - since
        for name, up in guest_times(lines).items():
            found[name] = zero + up - since
    return found


def phase_durations(boot: Mapping[str, float]) -> dict[str, float]:
    """Each milestone's phase: its time minus the previous milestone's (the first: from launch)."""
    durations: dict[str, float] = {}
    previous = 0.0
    for milestone in MILESTONES:
        if milestone.name in boot:
            durations[milestone.name] = boot[milestone.name] - previous
            previous = boot[milestone.name]
    return durations


def medians(boots: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The median of each key over the boots that have it."""
    keys = [m.name for m in MILESTONES if any(m.name in boot for boot in boots)]
    return {k: statistics.median(boot[k] for boot in boots if k in boot) for k in keys}
