"""A benchmark's child processes: each is the benchmark script itself in a ``--role``.

The parent ``call``s a command on a child (a JSON line on its stdin) and gets
its answer (a JSON line on its stdout); the child ``serve_control``s its
commands, each a coroutine.  ``Children`` knows every process a benchmark
started, so that nothing outlives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from twisted.internet import stdio
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)
from twisted.protocols.basic import LineReceiver
from twisted.python.failure import Failure

from benchmarks._measure import reactor, sleep
from fakeqemu._hostclient import HostClient, HostUnreachable

# The programs a benchmark starts, beside the Python running it.
BIN_DIRECTORY = os.path.dirname(os.path.abspath(sys.executable))
TWISTD = os.path.join(BIN_DIRECTORY, "twistd")
FAKEQEMU_HOST = os.path.join(BIN_DIRECTORY, "fakeqemu-host")
START_TIMEOUT = 120.0
CALL_TIMEOUT = 300.0
STOP_TIMEOUT = 60.0
POLL_SECONDS = 0.05
CHATTY_FACTORIES = (
    "twisted.web.client._HTTP11ClientFactory",
    "twisted.internet.endpoints.OneShotFactory",
)

Handler = Callable[..., Coroutine[Any, Any, Any]]


def host_answering(control: str) -> bool:
    """Whether a fakeqemu-host answers on its control socket ``control`` now."""
    try:
        with HostClient(control) as client:
            client.call("list")
    except HostUnreachable:
        return False
    return True


async def host_answers(control: str, running: Callable[[], bool], log: str) -> None:
    """Once the fakeqemu-host on ``control`` answers; exits saying where its ``log`` is if
    it stops ``running`` or takes longer than START_TIMEOUT."""
    deadline = time.monotonic() + START_TIMEOUT
    while not host_answering(control):
        if not running() or time.monotonic() > deadline:
            raise SystemExit(f"fakeqemu-host did not start; see {log}")
        await sleep(POLL_SECONDS)


class ChildError(Exception):
    """A child process answered a command with an error, or went away."""


class ControlChannel(LineReceiver):
    """The child's end: runs each command's handler, answers with its result or error."""

    delimiter = b"\n"
    MAX_LENGTH = 64 * 1024 * 1024

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers

    def lineReceived(self, line: bytes) -> None:
        message = json.loads(line)
        ident = message["id"]
        handler = self.handlers.get(message["cmd"])
        if handler is None:
            self._answer({"id": ident, "error": f"unknown command {message['cmd']!r}"})
            return
        running = Deferred.fromCoroutine(handler(**message.get("args", {})))
        running.addCallbacks(
            lambda result: self._answer({"id": ident, "result": result}),
            lambda failure: self._answer(
                {"id": ident, "error": f"{failure.type.__name__}: {failure.getErrorMessage()}"}
            ),
        )

    def _answer(self, message: dict[str, Any]) -> None:
        assert self.transport is not None
        self.transport.write(json.dumps(message).encode("utf-8") + b"\n")

    def connectionLost(self, reason: Failure | None = None) -> None:
        # The benchmark went away (or closed our stdin): stop, cleanly.
        if reactor.running:
            reactor.stop()


class Child(ProcessProtocol):
    """The parent's end of one child process: ``call`` a command, ``terminate`` it."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.ended: Deferred[None] = Deferred()
        self.exit_code: int | None = None
        self._buffer = b""
        self._pending: dict[int, Deferred[Any]] = {}
        self._next = 0

    @property
    def pid(self) -> int:
        """The child's process id."""
        assert self.transport is not None and self.transport.pid is not None
        return int(self.transport.pid)

    @property
    def running(self) -> bool:
        """The child has not exited yet."""
        return not self.ended.called

    def outReceived(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            waiter = self._pending.pop(message["id"], None)
            if waiter is None:
                continue
            if "error" in message:
                waiter.errback(ChildError(f"{self.label}: {message['error']}"))
            else:
                waiter.callback(message["result"])

    def processEnded(self, reason: Failure) -> None:
        if isinstance(reason.value, ProcessDone | ProcessTerminated):
            self.exit_code = reason.value.exitCode
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            waiter.errback(ChildError(f"{self.label} exited ({reason.getErrorMessage()})"))
        self.ended.callback(None)

    def call(self, command: str, timeout: float = CALL_TIMEOUT, **args: Any) -> Deferred[Any]:
        """Send ``command``; fires with the child's answer."""
        if not self.running or self.transport is None:
            raise ChildError(f"{self.label} is not running")
        self._next += 1
        waiter: Deferred[Any] = Deferred()
        self._pending[self._next] = waiter
        line = json.dumps({"id": self._next, "cmd": command, "args": args}).encode("utf-8")
        self.transport.write(line + b"\n")
        return waiter.addTimeout(timeout, reactor)

    async def terminate(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; returns once it exited."""
        if not self.running:
            return
        assert self.transport is not None
        self.transport.signalProcess("TERM")
        deadline = time.monotonic() + timeout
        while self.running:
            if time.monotonic() > deadline:
                self.transport.signalProcess("KILL")
                break
            await sleep(POLL_SECONDS)
        await self.ended


class Children:
    """Every process this benchmark started, so that nothing outlives it."""

    def __init__(self, directory: str, script: str) -> None:
        """``script`` is the benchmark that runs as its own children (``--role …``)."""
        self.directory = directory
        self.script = script
        self.started: list[Child] = []

    def spawn(
        self,
        label: str,
        argv: Sequence[str],
        log_name: str,
        environment: dict[str, str] | None = None,
        control: bool = True,
    ) -> Child:
        """Start ``argv``; stderr (and stdout, without ``control``) to ``log_name``."""
        child = Child(label)
        with open(os.path.join(self.directory, log_name), "ab") as log:
            fds: dict[int, int | str] = {0: "w", 1: "r" if control else log.fileno()}
            fds[2] = log.fileno()
            reactor.spawnProcess(
                child,
                argv[0],
                list(argv),
                env=dict(os.environ) if environment is None else environment,
                childFDs=fds,
            )
        self.started.append(child)
        return child

    def spawn_role(
        self, label: str, role: str, *extra: str, env: dict[str, str] | None = None
    ) -> Child:
        """This script as a child in ``role``."""
        argv = [sys.executable, self.script, "--role", role, *extra]
        return self.spawn(label, argv, f"{label}.log", env)

    def kill_left_over(self) -> None:
        """Last resort once the reactor is gone: SIGKILL every child still running."""
        for child in self.started:
            if child.running and child.transport is not None and child.transport.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(child.transport.pid), signal.SIGKILL)


def serve_control(handlers: dict[str, Handler]) -> None:
    """Answer the parent's commands on stdin/stdout."""
    stdio.StandardIO(ControlChannel(handlers), reactor=reactor)


def log_to(path: str, level: LogLevel) -> None:
    """Log this child at ``level`` and above to ``path`` (as twistd or the agent would)."""
    levels = LogLevelFilterPredicate(defaultLogLevel=level)
    for chatty in CHATTY_FACTORIES:
        levels.setLogLevelForNamespace(chatty, LogLevel.warn)
    log = open(path, "a")  # noqa: SIM115 - open for the life of the process
    globalLogBeginner.beginLoggingTo(
        [FilteringLogObserver(textFileLogObserver(log), [levels])], redirectStandardIO=False
    )
