"""``vmready-agent``: run the agent in the foreground, or ``notify`` it of the workload's state.

Exit status: 0 after a normal stop (SIGTERM, SIGINT); 1 when the agent cannot
start or gives up (its serial port is gone), or when ``notify`` was refused;
2 for a usage error.  Every failure is one line on stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from twisted.internet.defer import Deferred
from twisted.internet.error import CannotListenError
from twisted.internet.task import react
from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)
from twisted.python import usage

from vmready.agent.config import ConfigError, load_config
from vmready.agent.notify import SYNOPSIS, NotifyFailed, UsageError, notify, parse_notify
from vmready.agent.service import build_agent
from vmready.agent.tap import Options

__all__ = ["main", "run_agent", "run_notify"]

PROGRAM = "vmready-agent"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
_CHATTY_FACTORIES = (
    "twisted.web.client._HTTP11ClientFactory",
    "twisted.internet.endpoints.OneShotFactory",
)


class CommandOptions(Options):
    """The options of the ``vmready-agent`` command itself (its usage names both forms)."""

    synopsis = (
        "Usage: vmready-agent [options]\n"
        "       vmready-agent notify ready|started [--socket PATH] [--timeout SECONDS]"
    )


def _say(message: str) -> None:
    print(f"{PROGRAM}: {message}", file=sys.stderr)


def _usage(command: str, synopsis: str) -> None:
    print(f"Usage: {command} {synopsis}  (see {command} --help)", file=sys.stderr)


def _parse(options: Options, args: Sequence[str], command: str) -> bool:
    """Parse ``args`` into ``options``; False (after saying why) on a usage error."""
    try:
        options.parseOptions(list(args))
    except usage.UsageError as e:
        _say(f"{e}")
        _usage(command, "[options]")
        return False
    return True


def run_notify(args: Sequence[str]) -> NoReturn:
    """``vmready-agent notify ready|started [--socket PATH]``."""
    try:
        request = parse_notify(args)
    except UsageError as e:
        _say(str(e))
        _usage(f"{PROGRAM} notify", SYNOPSIS)
        sys.exit(EXIT_USAGE)

    async def send(reactor: Any) -> None:
        try:
            await notify(reactor, request.socket, request.state, request.timeout)
        except NotifyFailed as e:
            _say(str(e))
            raise SystemExit(EXIT_FAILED) from None

    react(lambda reactor: Deferred.fromCoroutine(send(reactor)))


def run_agent(args: Sequence[str]) -> int:
    """Run the agent until it is stopped; its exit status."""
    options = CommandOptions()
    if not _parse(options, args, PROGRAM):
        return EXIT_USAGE
    from twisted.internet import reactor

    try:
        config = load_config(options)
        service = build_agent(reactor, config)
    except ConfigError as e:
        _say(str(e))
        return EXIT_FAILED
    levels = LogLevelFilterPredicate(defaultLogLevel=LogLevel.info)
    for chatty in _CHATTY_FACTORIES:  # "Starting factory" for every connection to the host
        levels.setLogLevelForNamespace(chatty, LogLevel.warn)
    globalLogBeginner.beginLoggingTo(
        [FilteringLogObserver(textFileLogObserver(sys.stderr), [levels])],
        redirectStandardIO=False,
    )

    def fatal(reason: str) -> None:
        reactor.stop()

    service.on_fatal = fatal
    try:
        service.startService()
    except CannotListenError as e:
        _say(f"cannot serve the guest API on {config.socket}: {e.socketError}")
        return EXIT_FAILED
    except Exception as e:  # startup failed before anything ran: one line, not a traceback
        _say(f"cannot start: {e}")
        return EXIT_FAILED
    reactor.addSystemEventTrigger("before", "shutdown", service.stopService)
    reactor.run()
    return service.exit_code


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``vmready-agent`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["notify"]:
        run_notify(args[1:])
    sys.exit(run_agent(args))


if __name__ == "__main__":
    main()
