"""The command line of remote use: ``remote ...``, ``config trust ...``, and ``REMOTE:``.

``parser.build_parser`` calls ``add_remote_commands`` once its own commands
exist: it adds the ``remote`` command, the ``trust`` verb of ``config``, and the optional
``REMOTE:`` argument of the commands that name no instance.
"""

from __future__ import annotations

from vmready.cli.targets import REMOTE_ARGUMENT
from vmready.cli.verbs import Verbs

# Commands that take an optional REMOTE: because they name no instance.
REMOTE_ONLY_COMMANDS = ("list", "monitor")
_REMOTE_HELP = "the remote to ask, as REMOTE: (default: the default remote)"


def add_remote_commands(commands: Verbs, config_verbs: Verbs, cluster_verbs: Verbs) -> None:
    """Add ``remote`` to ``commands``, ``trust`` to ``config_verbs`` and the optional
    ``REMOTE:`` to the commands that name no instance (build_parser's)."""
    for parser in (*(commands[name] for name in REMOTE_ONLY_COMMANDS), cluster_verbs["list"]):
        parser.add_argument(REMOTE_ARGUMENT, nargs="?", metavar="REMOTE:", help=_REMOTE_HELP)
    _add_remote(commands)
    _add_trust(config_verbs)


def _add_remote(commands: Verbs) -> None:
    verbs = commands.group(
        "remote",
        "manage the remote daemons this CLI reaches (add, list, remove, switch)",
        description=(
            "Remote daemons, reached over their remote API (mutual TLS). 'local' is the "
            "built-in remote: this host's daemon on its unix socket. A command goes to "
            "REMOTE:NAME's remote, or REMOTE: for commands without an instance, or else "
            "to the default remote."
        ),
        dest="remote_verb",
    )
    add = verbs.add("add", "add a remote: pin its certificate and have this client trusted")
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
    verbs.add("list", "list the remotes (NAME URL FINGERPRINT DEFAULT)")
    verbs.add("remove", "forget a remote").add_argument("remote_name", metavar="NAME")
    verbs.add("switch", "make a remote the default").add_argument("remote_name", metavar="NAME")
    verbs.add("get-default", "print the default remote's name")


def _add_trust(config_verbs: Verbs) -> None:
    verbs = config_verbs.group(
        "trust",
        "the client certificates the daemon's remote API trusts",
        description=(
            "The client certificates the daemon's remote API (--https-address) trusts. "
            "'add NAME' issues a one-time trust token for a new client."
        ),
        dest="trust_verb",
    )
    verbs.add(
        "add", "issue a one-time trust token (valid 24 h) for a client to be trusted as NAME"
    ).add_argument("name", metavar="[REMOTE:]NAME")
    verbs.add("list", "list the trusted client certificates").add_argument(
        REMOTE_ARGUMENT, nargs="?", metavar="REMOTE:", help=_REMOTE_HELP
    )
    verbs.add("remove", "stop trusting a certificate (its open connections close)").add_argument(
        "name", metavar="[REMOTE:]NAME|FINGERPRINT"
    )
