"""What a long action is doing, as one line: the renderer (sans I/O) and the terminal line.

``Progress`` takes the daemon's events about one instance and its operation
and says, on demand, what the line shows now (``web1: stopping (asking the
guest to shut down; forcing at 12:03:41, in 27 s)…``).  ``TerminalLine``
rewrites one line of a terminal in place.  ``ActionProgress`` (in
``vmready.cli.actionprogress``) joins them to the event stream and a timer.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from vmready.domain import TaskState

# One frame a tick: a modest rate, enough to show the command is alive.
SPINNER = "|/-\\"
TICK_SECONDS = 0.25

# What a command is doing, in the words of the line (``web1: stopping…``).
_COMMAND_WORDS = {
    "launch": "launching",
    "start": "starting",
    "stop": "stopping",
    "restart": "restarting",
    "freeze": "freezing",
    "unfreeze": "unfreezing",
    "rebuild": "rebuilding",
    "resize": "resizing",
    "confirm-resize": "confirming the resize",
    "revert-resize": "reverting the resize",
    "delete": "deleting",
}

# The step a task state stands for, where it says more than the command's word.
_STEP_WORDS = {
    TaskState.SPAWNING: "booting the VM",
    TaskState.POWERING_ON: "booting the VM",
    TaskState.POWERING_OFF: "powering off the VM",
    TaskState.REBOOTING: "powering off the VM",
    TaskState.REBUILDING: "booting a new VM",
    TaskState.RESIZE_QUEUED: "queued",
    TaskState.RESIZE_PREP: "preparing",
    TaskState.RESIZE_MIGRATING: "restarting the VM with the new size",
    TaskState.RESIZE_FINISH: "finishing",
}

# Commands whose VM boots again once the old one is off.
_BOOTS_AGAIN = frozenset({"restart", "resize", "revert-resize"})


def doing_words(command: str, snapshot: str | None = None) -> str:
    """What ``command`` is doing, for the progress line (``stopping``, ``taking snapshot s1``)."""
    if command == "snapshot":
        return f"taking snapshot {snapshot}"
    if command == "restore":
        return f"restoring snapshot {snapshot}"
    return _COMMAND_WORDS.get(command, command)


def is_terminal(stream: IO[str], environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``stream`` is a terminal a line can be rewritten on (not TERM=dumb)."""
    environ = os.environ if environ is None else environ
    isatty = getattr(stream, "isatty", None)
    try:
        tty = bool(isatty()) if isatty is not None else False
    except (OSError, ValueError):  # a closed stream
        return False
    return tty and environ.get("TERM") != "dumb"


def _unix_seconds(stamp: object) -> float | None:
    """An operation's RFC 3339 time (``force_at``) as Unix seconds; None if it is not one."""
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def _clock_time(seconds: float) -> str:
    """Unix seconds as the local wall-clock time, ``12:03:41``."""
    return time.strftime("%H:%M:%S", time.localtime(seconds))


class Progress:
    """The progress line of one action on one instance, from the daemon's events.

    Feed it every event (``event``) and the operation once it exists
    (``follow``); ``text(now)`` is what the line says at ``now`` (Unix
    seconds, the daemon's clock on the same host), ``frame(now, n)`` the same
    with the ``n``-th spinner frame.  Nothing here writes or waits.
    """

    def __init__(
        self,
        name: str,
        command: str,
        doing: str,
        ellipsis: str = "…",
        clock_time: Callable[[float], str] = _clock_time,
    ) -> None:
        self.name = name
        self.command = command
        self.doing = doing
        self.ellipsis = ellipsis
        self._clock_time = clock_time
        self._source = f"/1.0/instances/{name}"
        self.task: TaskState | None = None
        self.operation_id: str | None = None
        self.shutdown: dict[str, Any] | None = None
        # Operation metadata seen before the operation's id was known (events can be first).
        self._early: dict[str, dict[str, Any] | None] = {}

    def follow(self, operation: Mapping[str, Any]) -> None:
        """The action's operation, as the daemon created it."""
        self.operation_id = str(operation.get("id"))
        metadata = self._early.pop(self.operation_id, operation.get("metadata"))
        self._early.clear()
        self._operation_metadata(metadata)

    def event(self, event: Mapping[str, Any]) -> None:
        """One event from ``/1.0/events``; those about other instances are ignored."""
        metadata = event.get("metadata")
        if not isinstance(metadata, Mapping):
            return
        if event.get("type") == "lifecycle":
            if metadata.get("source") != self._source:
                return
            context = metadata.get("context")
            if metadata.get("action") == "instance-state" and isinstance(context, Mapping):
                task = context.get("task_state")
                known = isinstance(task, str) and task in TaskState._value2member_map_
                self.task = TaskState(str(task)) if known else None
        elif event.get("type") == "operation":
            resources = metadata.get("resources")
            instances = resources.get("instances") if isinstance(resources, Mapping) else None
            if not isinstance(instances, list) or self._source not in instances:
                return
            operation_id = str(metadata.get("id"))
            if self.operation_id is None:
                self._early[operation_id] = metadata.get("metadata")
            elif operation_id == self.operation_id:
                self._operation_metadata(metadata.get("metadata"))

    def _operation_metadata(self, metadata: Any) -> None:
        shutdown = metadata.get("shutdown") if isinstance(metadata, Mapping) else None
        self.shutdown = dict(shutdown) if isinstance(shutdown, Mapping) else None

    def step(self, now: float) -> str | None:
        """What the action is doing at ``now``, beyond the command's word (None: nothing more)."""
        shutdown = self.shutdown
        if shutdown is not None:
            timeout = shutdown.get("timeout")
            force_at = _unix_seconds(shutdown.get("force_at"))
            if "result" in shutdown:
                if self.command in _BOOTS_AGAIN:
                    return "booting the VM again"
            elif isinstance(timeout, int | float) and isinstance(force_at, int | float):
                left = math.ceil(force_at - now)
                if left > 0:
                    return (
                        "asking the guest to shut down; forcing at "
                        f"{self._clock_time(force_at)}, in {left} s"
                    )
                return f"forcing it off: the guest did not shut down within {timeout:g} s"
        return _STEP_WORDS.get(self.task) if self.task is not None else None

    def text(self, now: float) -> str:
        """The line without its spinner."""
        step = self.step(now)
        detail = f" ({step})" if step else ""
        return f"{self.name}: {self.doing}{detail}{self.ellipsis}"

    def frame(self, now: float, count: int) -> str:
        """The line with the ``count``-th spinner frame in front."""
        return f"{SPINNER[count % len(SPINNER)]} {self.text(now)}"


class TerminalLine:
    """One line of a terminal, rewritten in place: carriage return, the text, clear to the end.

    The text is cut to the terminal's width so it never wraps (a wrapped line
    cannot be rewritten).  Once the stream fails (the terminal went away) it
    writes nothing more.
    """

    CLEAR = "\r\x1b[K"

    def __init__(self, stream: IO[str], width: Callable[[], int] | None = None) -> None:
        self._stream = stream
        self._width = width if width is not None else self._terminal_width
        self.shown = ""
        self._broken = False

    def _terminal_width(self) -> int:
        try:
            columns = os.get_terminal_size(self._stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            return 80
        # A terminal whose size was never set (some ptys) says 0.
        return columns if columns > 0 else 80

    def show(self, text: str) -> None:
        """Replace the line with ``text``."""
        cut = text[: max(self._width() - 1, 1)]
        if cut != self.shown:
            self._write(self.CLEAR + cut)
            self.shown = cut

    def clear(self) -> None:
        """Empty the line, so that what is printed next starts on a clean one."""
        if self.shown:
            self._write(self.CLEAR)
            self.shown = ""

    def _write(self, text: str) -> None:
        if self._broken:
            return
        encoding = getattr(self._stream, "encoding", None) or "utf-8"
        try:
            self._stream.write(text.encode(encoding, "replace").decode(encoding))
            self._stream.flush()
        except (OSError, ValueError):
            self._broken = True


def ellipsis_for(stream: IO[str]) -> str:
    """``…`` where the stream can write it, else ``...``."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        "…".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return "..."
    return "…"
