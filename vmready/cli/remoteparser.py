"""The command line of remote use: ``remote ...``, ``config trust ...``, and ``REMOTE:``.

``parser.build_parser`` calls ``add_remote_commands`` once its own commands
exist: it adds the ``remote`` command, the ``trust`` verb of ``config``, and the optional
``REMOTE:`` argument of the commands that name no instance.
"""

from __future__ import annotations

import argparse
from typing import Any

from vmready.cli.targets import REMOTE_ARGUMENT

__all__ = ["REMOTE_ONLY_COMMANDS", "add_remote_commands"]

# Commands that take an optional REMOTE: because they name no instance.
REMOTE_ONLY_COMMANDS = ("list", "monitor")
_REMOTE_HELP = "the remote to ask, as REMOTE: (default: the default remote)"


def _subcommands(parser: argparse.ArgumentParser) -> Any:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    raise LookupError(f"{parser.prog} has no subcommands")


def add_remote_commands(commands: Any, common: argparse.ArgumentParser, config_verbs: Any) -> None:
    """Add ``remote`` to ``commands`` and ``trust`` to ``config_verbs`` (build_parser's)."""
    for name in REMOTE_ONLY_COMMANDS:
        commands.choices[name].add_argument(
            REMOTE_ARGUMENT, nargs="?", metavar="REMOTE:", help=_REMOTE_HELP
        )
    cluster_verbs = _subcommands(commands.choices["cluster"])
    cluster_verbs.choices["list"].add_argument(
        REMOTE_ARGUMENT, nargs="?", metavar="REMOTE:", help=_REMOTE_HELP
    )

    remote = commands.add_parser(
        "remote",
        help="manage the remote daemons this CLI reaches (add, list, remove, switch)",
        description=(
            "Remote daemons, reached over their remote API (mutual TLS). 'local' is the "
            "built-in remote: this host's daemon on its unix socket. A command goes to "
            "REMOTE:NAME's remote, or REMOTE: for commands without an instance, or else "
            "to the default remote."
        ),
    )
    verbs = remote.add_subparsers(dest="remote_verb", metavar="VERB", required=True)

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = verbs.add_parser(
            name, help=help, description=help, parents=[common]
        )
        return parser

    add = verb("add", "add a remote: pin its certificate and have this client trusted")
    add.add_argument("remote_name", metavar="NAME")
    add.add_argument(
        "url",
        metavar="URL",
        nargs="?",
        help="https://HOST[:PORT] (port 8443 if omitted; default: the token's first address)",
    )
    add.add_argument(
        "--token",
        help="a trust token from 'vmready config trust add' (pins the server by its "
        "fingerprint and makes the daemon trust this client)",
    )
    add.add_argument(
        "--accept-certificate",
        action="store_true",
        help="without a token: pin whatever certificate the server presents",
    )
    add.add_argument(
        "--fingerprint",
        metavar="SHA256",
        help="without a token: pin the server's certificate if it has this fingerprint",
    )
    verb("list", "list the remotes (NAME URL FINGERPRINT DEFAULT)")
    verb("remove", "forget a remote").add_argument("remote_name", metavar="NAME")
    verb("switch", "make a remote the default").add_argument("remote_name", metavar="NAME")
    verb("get-default", "print the default remote's name")

    trust = config_verbs.add_parser(
        "trust",
        help="the client certificates the daemon's remote API trusts",
        description=(
            "The client certificates the daemon's remote API (--https-address) trusts. "
            "'add NAME' issues a one-time trust token for a new client."
        ),
    )
    actions = trust.add_subparsers(dest="trust_verb", metavar="VERB", required=True)

    def trust_verb(name: str, help: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = actions.add_parser(
            name, help=help, description=help, parents=[common]
        )
        return parser

    trust_verb(
        "add", "issue a one-time trust token (valid 24 h) for a client to be trusted as NAME"
    ).add_argument("name", metavar="[REMOTE:]NAME")
    trust_verb("list", "list the trusted client certificates").add_argument(
        REMOTE_ARGUMENT, nargs="?", metavar="REMOTE:", help=_REMOTE_HELP
    )
    trust_verb("remove", "stop trusting a certificate (its open connections close)").add_argument(
        "name", metavar="[REMOTE:]NAME|FINGERPRINT"
    )
