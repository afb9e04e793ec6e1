"""Which daemon a command talks to: ``REMOTE:NAME``, ``REMOTE:``, or the default remote.

As with ``incus``: an instance argument may start with ``REMOTE:``
(``vmready info prod:web``), a command without one takes ``REMOTE:`` as its
optional argument (``vmready list prod:``), and otherwise the default remote
(``vmready remote switch``) is used.  ``local`` is the built-in remote, this
host's unix socket; ``--socket`` names that socket and so means ``local``.
Instance names never hold a colon, so the first colon always ends a remote.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping

from vmready.cli.client import Client
from vmready.cli.errors import EXIT_FAILED, CommandError, UsageError
from vmready.cli.remotetls import PinnedRemote
from vmready.cli.userconfig import LOCAL, Remotes, client_identity, config_dir, load_remotes
from vmready.domain import SOCKET_VARIABLE, IVMReadyReactor, default_socket

# The optional positional of commands that name no instance (list, monitor).
REMOTE_ARGUMENT = "remote"
# ``openssl x509 -fingerprint``'s form (config trust remove takes it): not REMOTE:NAME.
_COLON_FINGERPRINT = re.compile(r"([0-9A-Fa-f]{2}:){31}[0-9A-Fa-f]{2}")


def split_remote(text: str) -> tuple[str | None, str]:
    """``REMOTE:REST`` as (REMOTE, REST); text without a colon as (None, text)."""
    remote, colon, rest = text.partition(":")
    if not colon:
        return None, text
    if not remote:
        raise UsageError(f"{text!r}: a remote name goes before the colon (REMOTE:{rest})")
    return remote, rest


def choose_remote(args: argparse.Namespace, remotes: Remotes) -> str:
    """The remote ``args`` name (its ``REMOTE:`` prefix removed from them), else the default."""
    named: str | None = None
    if getattr(args, "name", None) is not None and not _COLON_FINGERPRINT.fullmatch(args.name):
        named, args.name = split_remote(args.name)
        if not args.name:
            raise UsageError(f"{named}: names no instance (expected {named}:NAME)")
    given = getattr(args, REMOTE_ARGUMENT, None)
    if given is not None:
        named, rest = split_remote(given)
        if named is None or rest:
            raise UsageError(f"expected REMOTE: (a remote name and a colon), got {given!r}")
        setattr(args, REMOTE_ARGUMENT, None)
    if named is not None:
        if named != LOCAL and named not in remotes.remotes:
            known = ", ".join([LOCAL, *sorted(remotes.remotes)])
            raise CommandError(f"unknown remote {named!r} (remotes: {known})", EXIT_FAILED)
        if named != LOCAL and args.socket:
            raise UsageError(f"--socket names the local daemon's socket, not remote {named}")
        return named
    if args.socket:
        return LOCAL
    return remotes.default


def local_socket(given: str | None, environ: Mapping[str, str]) -> str:
    """The local daemon's socket: ``--socket``, else ``$VMREADY_SOCKET``, else the default."""
    return given or environ.get(SOCKET_VARIABLE) or default_socket()


def client_for(
    reactor: IVMReadyReactor, args: argparse.Namespace, environ: Mapping[str, str]
) -> Client:
    """The Client of the daemon this command line names."""
    directory = config_dir(environ)
    remotes = load_remotes(directory)
    name = choose_remote(args, remotes)
    if name == LOCAL:
        return Client(reactor, local_socket(args.socket, environ))
    remote = remotes.remotes[name]
    tls = PinnedRemote(
        reactor, remote.host, remote.port, client_identity(directory), remote.fingerprint
    )
    return Client.remote(reactor, name, remote.url, tls)
