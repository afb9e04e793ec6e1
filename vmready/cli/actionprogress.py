"""A long action's progress line on the terminal, fed by the daemon's events and a timer.

Quiet unless stderr is a terminal, the format is ``table`` and the command
waits: programs and logs get the result only.
"""

from __future__ import annotations

import argparse
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall

from vmready.cli.client import APIError, Client, LineStream
from vmready.cli.output import Output
from vmready.cli.progress import (
    TICK_SECONDS,
    Progress,
    TerminalLine,
    doing_words,
    ellipsis_for,
    is_terminal,
)


class ActionProgress:
    """Shows ``Progress`` on a ``TerminalLine``, a frame every ``TICK_SECONDS``.

    ``subscribe`` before the action's request (so no event is missed),
    ``follow`` once its operation exists (the line appears then), ``pause``
    before printing anything, ``close`` at the end.
    """

    def __init__(self, progress: Progress, line: TerminalLine, clock: IReactorTime) -> None:
        self.progress = progress
        self.line = line
        self._clock = clock
        self._frames = 0
        self._loop = LoopingCall(self._tick)
        self._loop.clock = clock
        self._stream: LineStream | None = None

    @classmethod
    def for_action(
        cls, client: Client, output: Output, args: argparse.Namespace, name: str
    ) -> ActionProgress | None:
        """The progress line of this command, or None where it stays quiet."""
        if not output.is_table or getattr(args, "no_wait", False) or not is_terminal(output.err):
            return None
        command = args.command
        if command == "snapshot" and getattr(args, "snapshot_verb", None) == "restore":
            command = "restore"
        doing = doing_words(command, getattr(args, "snapshot", None))
        progress = Progress(name, command, doing, ellipsis_for(output.err))
        return cls(progress, TerminalLine(output.err), client.reactor)

    async def subscribe(self, client: Client) -> None:
        """Follow the daemon's events; without them (refused) the line shows the command only."""
        try:
            self._stream = await client.events(["lifecycle", "operation"], self._event)
        except APIError:
            self._stream = None

    def _event(self, event: dict[str, Any]) -> None:
        self.progress.event(event)
        if self._loop.running:
            self._tick()

    def follow(self, operation: dict[str, Any]) -> None:
        """The operation exists: show the line from now on."""
        self.progress.follow(operation)
        self._start()

    def waiting(self, doing: str) -> None:
        """A new phase after the operation (``launch --wait``: until the workload is Ready)."""
        self.progress.doing = doing
        self.progress.task = None
        self.progress.shutdown = None
        self._start()

    def _start(self) -> None:
        if not self._loop.running:
            self._loop.start(TICK_SECONDS, now=True)

    def _tick(self) -> None:
        self.line.show(self.progress.frame(self._clock.seconds(), self._frames))
        self._frames += 1

    def pause(self) -> None:
        """Stop drawing and clear the line, so that what is printed next starts clean."""
        if self._loop.running:
            self._loop.stop()
        self.line.clear()

    def close(self) -> None:
        """Clear the line and stop following the events."""
        self.pause()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
