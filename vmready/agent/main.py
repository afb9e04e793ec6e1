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

    from vmready.agent.argparsing import OptionParser
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
    from vmready.agent.argparsing import OptionParser

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


# The options as ``--name value`` pairs, by their names and the short forms: what
# the loader and the demo guest's initramfs write (``--config-drive DIR``).
_PAIRS = {
    "--config-drive": "config-drive",
    "-c": "config-drive",
    "--serial": "serial",
    "--virtio-ports": "virtio-ports",
    "--transport": "transport",
    "--socket": "socket",
    "-s": "socket",
    "--state-dir": "state-dir",
    "--heartbeat": "heartbeat",
    "--retries": "retries",
    "--record": "record",
}
_DEFAULTS: dict[str, Any] = {
    **{name: None for name in _PAIRS.values()},
    "config-drive": DEFAULT_CONFIG_DRIVE,
    "heartbeat": str(DEFAULT_HEARTBEAT),
    "retries": str(DEFAULT_RETRIES),
}


def _plain_pairs(args: Sequence[str]) -> dict[str, Any] | None:
    """``args`` as options when they are only ``--name value`` pairs, each name once and no
    value that starts with ``-``; None for anything else (argparse decides: help, errors,
    ``--name=value``, abbreviations).  argparse (with ``re`` and ``enum``) costs 0.3 s
    under emulation, before the agent's first STARTED."""
    if len(args) % 2:
        return None
    options = dict(_DEFAULTS)
    seen = set()
    for flag, value in zip(args[::2], args[1::2]):
        name = _PAIRS.get(flag)
        if name is None or name in seen or value.startswith("-"):
            return None
        seen.add(name)
        options[name] = value
    return options


def _argparse_options(args: Sequence[str]) -> dict[str, Any]:
    parsed = _parser().parse_args(list(args))
    return {name: getattr(parsed, name.replace("-", "_")) for name in _DEFAULTS}


def parse_options(args: Sequence[str]) -> dict[str, Any]:
    """The command line as ``load_config`` options (command-line names); UsageError."""
    options = _plain_pairs(args)
    if options is None:
        options = _argparse_options(args)
    try:
        options["heartbeat"] = parse_seconds(options["heartbeat"], "heartbeat")
        options["retries"] = parse_count(options["retries"], "retries")
        if options["transport"] is not None:
            split_transport(options["transport"])
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return options


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
