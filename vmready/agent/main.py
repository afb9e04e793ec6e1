"""``vmready-agent``: run the agent in the foreground, or ``notify`` it of the workload's state.

Exit status: 0 after a normal stop (SIGTERM, SIGINT); 1 when the agent cannot
start or gives up (its serial port is gone), or when ``notify`` was refused;
2 for a usage error.  Every failure is one line on stderr, and so is every log
message (``vmready-agent: …``; a systemd unit puts them in the journal).
"""

from __future__ import annotations

import sys

from vmready.agent.options import (
    DEFAULT_CONFIG_DRIVE,
    DEFAULT_HEARTBEAT,
    DEFAULT_RETRIES,
    ConfigError,
    OptionParser,
    UsageError,
    parse_count,
    parse_seconds,
    split_transport,
)

# The rest is imported where it is used.  The agent says its first STARTED
# (``firstword``) before it imports asyncio, ssl, logging and its own modules,
# which take seconds under emulation; ``vmready-agent notify``, a second
# interpreter started while the guest boots, needs none of them.  typing is
# only for mypy here.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Sequence
    from typing import Any, NoReturn

    from vmready.agent.firstword import FirstWord
    from vmready.agent.service import Agent

PROGRAM = "vmready-agent"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
USAGE = (
    "vmready-agent [options]\n"
    "       vmready-agent notify ready|started [--socket PATH] [--timeout SECONDS]"
)
DESCRIPTION = (
    "The in-guest vmready agent: reports STARTED/CONNECTED/STOPPED on the virtio serial "
    "port, dials the host when it writes CONNECT, and serves the guest API (devlxd) on a "
    "unix socket.  Settings come from the config drive's agent.json; an option given here "
    "wins.  'vmready-agent notify ready' declares the workload Ready."
)


def _say(message: str) -> None:
    print(f"{PROGRAM}: {message}", file=sys.stderr)


def _usage(command: str, synopsis: str) -> None:
    print(f"Usage: {command} {synopsis}  (see {command} --help)", file=sys.stderr)


def _parser() -> OptionParser:
    parser = OptionParser(PROGRAM, DESCRIPTION, usage=USAGE)
    add = parser.add_argument
    add(
        "--config-drive",
        "-c",
        default=DEFAULT_CONFIG_DRIVE,
        help="directory with agent.crt, agent.key, server.crt and optional agent.json "
        f"(default {DEFAULT_CONFIG_DRIVE})",
    )
    add("--serial", help="the serial port to use (device or unix socket); default: found")
    add(
        "--virtio-ports",
        help="where to find com.canonical.lxd or org.linuxcontainers.lxd "
        "(default /dev/virtio-ports, then /sys/class/virtio-ports)",
    )
    add("--transport", help="how to reach the host: vsock (default) or hvsock:PATH")
    add("--socket", "-s", help="the guest API socket to serve (default /dev/lxd/sock)")
    add(
        "--state-dir",
        help="where to remember Ready for this boot; a tmpfs (default /run/vmready-agent)",
    )
    add("--heartbeat", default=str(DEFAULT_HEARTBEAT), help="seconds between status lines")
    add("--retries", default=str(DEFAULT_RETRIES), help="retries of a failing dial before waiting")
    add(
        "--record",
        help="record the agent's side of the session (serial lines, requests to the host) "
        "to this transcript file, for vmready replay",
    )
    return parser


def parse_options(args: Sequence[str]) -> dict[str, Any]:
    """The command line as ``load_config`` options (command-line names); UsageError."""
    parsed = _parser().parse_args(list(args))
    try:
        heartbeat = parse_seconds(parsed.heartbeat, "heartbeat")
        retries = parse_count(parsed.retries, "retries")
        if parsed.transport is not None:
            split_transport(parsed.transport)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return {
        "config-drive": parsed.config_drive,
        "serial": parsed.serial,
        "virtio-ports": parsed.virtio_ports,
        "transport": parsed.transport,
        "socket": parsed.socket,
        "state-dir": parsed.state_dir,
        "heartbeat": heartbeat,
        "retries": retries,
        "record": parsed.record,
    }


def _loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's own complaints (a task that failed unobserved …), as one log line."""
    from vmready.agent.logs import logger

    error = context.get("exception")
    detail = f": {type(error).__name__}: {error}" if error is not None else ""
    logger("vmready.agent").error("%s%s", context.get("message", "asyncio error"), detail)


def run_notify(args: Sequence[str]) -> int:
    """``vmready-agent notify ready|started [--socket PATH]``; the exit status."""
    from vmready.agent.notify import SYNOPSIS, NotifyFailed, notify, parse_notify

    try:
        request = parse_notify(args)
    except UsageError as e:
        _say(str(e))
        _usage(f"{PROGRAM} notify", SYNOPSIS)
        return EXIT_USAGE
    try:
        kept = notify(request.socket, request.state, request.timeout)
    except NotifyFailed as e:
        _say(str(e))
        return EXIT_FAILED
    if kept is not None:
        _say(kept)  # accepted: the agent delivers it when the link returns
    return EXIT_OK


async def _serve(agent: Agent) -> int:
    import asyncio
    import signal

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_loop_error)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, agent.request_stop)
    return await agent.run()


def _failed(first_word: FirstWord | None, message: str) -> int:
    """The agent cannot run: STOPPED where it said STARTED already, and one line."""
    if first_word is not None:
        first_word.stop()
    _say(message)
    return EXIT_FAILED


def run_agent(args: Sequence[str]) -> int:
    """Run the agent until it is stopped; its exit status."""
    try:
        options = parse_options(args)
    except UsageError as e:
        _say(str(e))
        _usage(PROGRAM, "[options]")
        return EXIT_USAGE
    from vmready.agent.firstword import say_started

    # Before the imports below, which take seconds under emulation.  Not when recording
    # (--record): the recorder, made after them, could not date this STARTED truly,
    # and its replay answers each STARTED as recorded, in time.
    first_word = None if options["record"] else say_started(options)
    from vmready.agent.logs import configure_logging

    configure_logging()
    try:
        from vmready.agent.config import load_config
        from vmready.agent.service import build_agent

        agent = build_agent(load_config(options), first_word)
    except ConfigError as e:
        return _failed(first_word, str(e))
    import asyncio

    try:
        return asyncio.run(_serve(agent))
    except KeyboardInterrupt:  # before the loop took over SIGINT: a normal stop
        return EXIT_OK
    except Exception as e:  # startup failed before anything ran: one line, not a traceback
        return _failed(first_word, f"cannot start: {type(e).__name__}: {e}")
    finally:
        if first_word is not None and not first_word.handed_over:
            first_word.stop()  # the loop ended before the serial keeper adopted it


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``vmready-agent`` console script (and the zipapp's entry point)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["notify"]:
        sys.exit(run_notify(args[1:]))
    sys.exit(run_agent(args))


if __name__ == "__main__":
    main()
