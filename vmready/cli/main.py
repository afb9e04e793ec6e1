"""``vmready``: the operator's command line, a client of the daemon's API on its unix socket.

Every command is one or a few requests to the operator API; actions wait for
their operation by default.  Exit status: 0 success, 1 an error, 2 a usage
error, 3 (``wait`` only) the instance was deleted or went to Error, 128 + the
signal's number when interrupted (130 for SIGINT, 143 for SIGTERM); the
parser's epilogs say the same to the operator.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import IO, NoReturn

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from vmready.cli.client import Client
from vmready.cli.commands import COMMANDS, cmd_replay
from vmready.cli.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, CommandError, UsageError
from vmready.cli.output import Output
from vmready.cli.parser import build_parser, with_snapshot_verb
from vmready.cli.remotecommands import cmd_remote
from vmready.cli.suggest import command_names, unknown_command, with_instance_suggestion
from vmready.cli.targets import client_for
from vmready.domain import IVMReadyReactor, default_reactor


async def run(
    reactor: IVMReadyReactor,
    argv: Sequence[str],
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Run one ``vmready`` command line; returns the exit status.

    ``environ`` (default: the process's) locates the config dir of remotes.
    """
    environ = os.environ if environ is None else environ
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    parser = build_parser()
    output = Output(out, err, "table")
    client: Client | None = None
    name: str | None = None
    try:
        unknown = unknown_command(argv, command_names(parser))
        if unknown is not None:
            raise CommandError(unknown, EXIT_USAGE)
        args = parser.parse_args(with_snapshot_verb(list(argv)))
        output.format = args.format
        if args.command == "replay":
            return await cmd_replay(reactor, output, args)
        if args.command == "remote":
            return await cmd_remote(reactor, output, args, environ)
        client = client_for(reactor, args, environ)
        name = getattr(args, "name", None)
        result: int = await COMMANDS[args.command](client, output, args)
        return result
    except UsageError as e:
        output.usage(e.usage)
        output.error(f"error: {e}")
        return EXIT_USAGE
    except CommandError as e:
        message = e.message
        if client is not None:
            message = await with_instance_suggestion(client, name, message)
        output.error(message)
        return e.exit_code
    except SystemExit as e:
        # argparse's --help
        return e.code if isinstance(e.code, int) else EXIT_USAGE


class _ConsoleRun:
    """One command line run in the reactor, ended by its result or by SIGINT/SIGTERM.

    A signal cancels the command, so its event stream and requests close as it
    unwinds and it reports nothing, then stops the reactor: exit 128 + signal.
    The reactor is stopped once, by whichever comes first.
    """

    def __init__(self, reactor: IVMReadyReactor, argv: Sequence[str]) -> None:
        self._reactor = reactor
        self._argv = argv
        self._command: Deferred[int] | None = None
        self._stopping = False
        self.exit_code: int | None = None
        self.failure: Failure | None = None

    def start(self) -> None:
        """Take over SIGINT and SIGTERM from the reactor's handlers, then run the command."""
        self._reactor.addSystemEventTrigger("before", "shutdown", self._shutting_down)
        for signum in (signal.SIGINT, signal.SIGTERM):
            # An ignored SIGINT (a background job of a non-interactive shell) stays ignored.
            if signal.getsignal(signum) != signal.SIG_IGN:
                signal.signal(signum, self._signalled)
        self._command = Deferred.fromCoroutine(run(self._reactor, self._argv))
        self._command.addBoth(self._finished)

    def _signalled(self, signum: int, frame: FrameType | None) -> None:
        # Runs between any two bytecodes: hand over to the reactor, as Twisted's handlers do.
        self._reactor.callFromThread(self.interrupt, 128 + signum)

    def interrupt(self, exit_code: int) -> None:
        """End with ``exit_code`` unless the command already ended: cancel it, stop the reactor."""
        if self.exit_code is None:
            self.exit_code = exit_code
            if self._command is not None:
                self._command.cancel()
        self._stop()

    def _finished(self, result: int | Failure) -> None:
        if self.exit_code is None:
            if isinstance(result, Failure):
                self.failure = result
                self.exit_code = EXIT_FAILED
            else:
                self.exit_code = result
        # Else interrupted: how the cancelled command ended (CancelledError) is no news.
        self._stop()

    def _shutting_down(self) -> None:
        # The reactor stops, maybe not by us: nothing may call stop() again.
        self._stopping = True
        self.interrupt(EXIT_INTERRUPTED)

    def _stop(self) -> None:
        if not self._stopping:
            self._stopping = True
            self._reactor.stop()


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``vmready`` console script."""
    reactor = default_reactor()

    console = _ConsoleRun(reactor, sys.argv[1:] if argv is None else argv)
    reactor.callWhenRunning(console.start)
    try:
        reactor.run()
    except KeyboardInterrupt:
        # Ctrl-C before ``start`` took SIGINT over.
        sys.exit(EXIT_INTERRUPTED)
    if console.failure is not None:
        sys.stderr.write(f"vmready: internal error: {console.failure.getErrorMessage()}\n")
        console.failure.printTraceback(sys.stderr)
        sys.exit(EXIT_FAILED)
    sys.exit(EXIT_INTERRUPTED if console.exit_code is None else console.exit_code)


if __name__ == "__main__":
    main()
