"""``python -m vmready.fence``: the host fence's process.

It reads ``hold <until>`` and ``lost`` lines from its standard input (the
daemon's pipe; end of file: the daemon is gone) and kills the VMs under its
run root when ``rule`` says so, writing one line per kill and per change to
its log file.  It runs in a session of its own, so that nothing signalling
the daemon's process group reaches it, and it relieves the fence a daemon
of the same run root started before (``relieve``): a restarted daemon takes
over its predecessor's VMs, and their fence, before the old lease ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

from vmready.fence.rule import FenceRule
from vmready.fence.victims import kill_vms

PIDFILE_NAME = "fence.pid"
MAX_LINE_BYTES = 256


class FenceLog:
    """The fence's log file: one line each, with the wall-clock time and the member."""

    def __init__(self, path: str, member: str) -> None:
        self.path = path
        self.member = member

    def say(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())
        fraction = f"{time.time() % 1:.3f}"[1:]
        zone = time.strftime("%z", time.localtime())
        line = f"{stamp}{fraction}{zone} [vmready.fence] member {self.member}: {text}\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)


def _is_fence_of(pid: int, run_root: str) -> bool:
    """Whether ``pid`` is a live fence of ``run_root`` (a stale pidfile's pid may be reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"vmready.fence" in argv and os.fsencode(run_root) in argv


def relieve(run_root: str, log: FenceLog) -> None:
    """Tell the fence of ``run_root`` before this one to end, and take its place."""
    pidfile = os.path.join(run_root, PIDFILE_NAME)
    try:
        with open(pidfile) as f:
            previous = int(f.read().strip())
    except (OSError, ValueError):
        previous = None
    if previous is not None and previous != os.getpid() and _is_fence_of(previous, run_root):
        # One that ended meanwhile has nothing to be relieved of.
        with contextlib.suppress(ProcessLookupError):
            os.kill(previous, signal.SIGTERM)
            log.say(f"relieved the previous fence (process {previous})")
    os.makedirs(run_root, exist_ok=True)
    temporary = f"{pidfile}.{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(temporary, pidfile)


class LineReader:
    """The daemon's lines, from a descriptor read without blocking beyond ``select``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""
        self.closed = False

    def read(self, timeout: float) -> list[bytes]:
        """The whole lines that arrived within ``timeout`` seconds (``closed`` at its end)."""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            return []
        chunk = os.read(self.fd, 4096)
        if not chunk:
            self.closed = True
            return [self.buffer] if self.buffer else []
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        if len(self.buffer) > MAX_LINE_BYTES:
            lines.append(self.buffer)
            self.buffer = b""
        return lines


def _number(word: bytes) -> float | None:
    try:
        return float(word)
    except ValueError:
        return None


def obey(rule: FenceRule, line: bytes, log: FenceLog) -> None:
    """Apply one line of the daemon to ``rule``; anything else is logged and ignored."""
    words = line.strip().split()
    if words == [b"lost"]:
        rule.lose()
        log.say("the lease is lost: killing its VMs")
        return
    until = _number(words[1]) if len(words) == 2 and words[0] == b"hold" else None
    if until is not None:
        rule.hold(until)
        return
    log.say(f"ignored a line it cannot read: {line[:80]!r}")


def run(
    rule: FenceRule,
    reader: LineReader,
    run_root: str,
    log: FenceLog,
    now: Callable[[], float] = time.monotonic,
) -> None:
    """Kill when the rule says so, until the daemon is gone and the last kill is done."""
    was_armed = False
    while True:
        moment = now()
        armed = rule.armed(moment)
        if armed:
            if not was_armed and not rule.lost:
                late = moment - rule.until
                log.say(f"its lease was not confirmed in time ({late:.2f}s past): killing its VMs")
            for vm in kill_vms(run_root, _reason(rule, log.member)):
                log.say(f"killed VM {os.path.basename(vm.run_dir)} (process {vm.pid})")
            if rule.finished(moment):
                log.say("its daemon is gone and its VMs with it: the fence ends")
                return
        elif was_armed:
            log.say("its lease was confirmed again: its VMs may run")
        was_armed = armed
        wait = rule.wait(moment)
        if reader.closed:
            time.sleep(wait)
            continue
        for line in reader.read(wait):
            obey(rule, line, log)
        if reader.closed:
            rule.close()
            left = rule.until - now()
            if not rule.armed(now()):
                log.say(f"its daemon is gone: its VMs may run {left:.2f}s more, unless relieved")


def _reason(rule: FenceRule, member: str) -> str:
    """Why the VMs die, for their run directories (and so their instances' errors)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    why = (
        "its lease was lost to another daemon"
        if rule.lost
        else "its lease was not confirmed in time (the daemon frozen, killed or cut off from "
        "the store)"
    )
    return f"killed by the host fence of member {member} at {stamp}: {why}"


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vmready.fence")
    parser.add_argument("--run-root", required=True)
    parser.add_argument("--member", required=True)
    parser.add_argument("--until", type=float, required=True)
    parser.add_argument("--log", required=True)
    return parser.parse_args(argv)


def _relieved(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    arguments = _arguments(sys.argv[1:] if argv is None else argv)
    # Its own session: what signals the daemon's process group does not reach it (it is
    # never a group leader already when a daemon starts it; if it is, it stays so).
    with contextlib.suppress(PermissionError):
        os.setsid()
    log = FenceLog(arguments.log, arguments.member)
    signal.signal(signal.SIGTERM, _relieved)
    run_root = os.path.abspath(arguments.run_root)
    try:
        relieve(run_root, log)
        log.say(f"fencing the VMs under {run_root} (process {os.getpid()})")
        run(FenceRule(arguments.until), LineReader(sys.stdin.fileno()), run_root, log)
    except SystemExit:
        log.say("relieved: another fence (or the operator) took over")
    return 0
