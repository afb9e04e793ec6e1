"""``vmready remote ...`` (this CLI's remotes) and ``vmready config trust ...`` (a daemon's).

``remote add`` pins the server's certificate by fingerprint (the trust
token's, or the one the server shows once the operator accepted or matched
it: never silently) and, with a token, has the daemon trust this client's
certificate.  ``config trust`` talks to a daemon like any other command, so
it works against a remote too (``vmready config trust list prod:``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import attrs

from vmready.cli.client import APIError, Client
from vmready.cli.errors import EXIT_FAILED, EXIT_OK, CommandError, UsageError
from vmready.cli.output import Output
from vmready.cli.remotetls import PinnedRemote, probe_server_certificate
from vmready.cli.tables import aligned_table
from vmready.cli.targets import local_socket
from vmready.cli.userconfig import (
    LOCAL,
    Remote,
    Remotes,
    client_identity,
    config_dir,
    load_remotes,
    parse_remote_url,
    save_remotes,
    validate_remote_name,
)
from vmready.cli.verbs import by_verb
from vmready.domain import IVMReadyReactor
from vmready.trust import (
    CertificatePair,
    TokenError,
    TrustToken,
    fingerprint,
    normalize_fingerprint,
)

SHORT_FINGERPRINT = 12


# -- remote ---------------------------------------------------------------


async def cmd_remote(
    reactor: IVMReadyReactor, output: Output, args: argparse.Namespace, environ: Mapping[str, str]
) -> int:
    """``vmready remote VERB``."""
    directory = config_dir(environ)
    remotes = load_remotes(directory)
    verb = args.remote_verb
    if verb == "add":
        return await _remote_add(reactor, output, args, directory, remotes)
    if verb == "list":
        return _remote_list(output, remotes, local_socket(args.socket, environ))
    if verb == "get-default":
        output.line(remotes.default)
        return EXIT_OK
    name = args.remote_name
    if verb == "switch":
        if name != LOCAL and name not in remotes.remotes:
            raise CommandError(f"unknown remote {name!r}", EXIT_FAILED)
        save_remotes(directory, attrs.evolve(remotes, default=name))
        output.line(f"Default remote: {name}")
        return EXIT_OK
    # remove
    if name == LOCAL:
        raise CommandError("the local remote is built in: it cannot be removed", EXIT_FAILED)
    if name not in remotes.remotes:
        raise CommandError(f"unknown remote {name!r}", EXIT_FAILED)
    if remotes.default == name:
        raise CommandError(
            f"{name} is the default remote: switch to another first (vmready remote switch "
            f"{LOCAL})",
            EXIT_FAILED,
        )
    rest = {key: value for key, value in remotes.remotes.items() if key != name}
    save_remotes(directory, attrs.evolve(remotes, remotes=rest))
    output.line(f"Remote {name} removed")
    return EXIT_OK


def _remote_list(output: Output, remotes: Remotes, socket: str) -> int:
    rows: list[dict[str, Any]] = [
        {
            "name": LOCAL,
            "url": f"unix://{socket}",
            "fingerprint": "",
            "default": remotes.default == LOCAL,
        }
    ]
    for name, remote in sorted(remotes.remotes.items()):
        rows.append(
            {
                "name": name,
                "url": remote.url,
                "fingerprint": remote.fingerprint,
                "default": remotes.default == name,
            }
        )

    def table(items: list[dict[str, Any]]) -> str:
        return aligned_table(
            ("NAME", "URL", "FINGERPRINT", "DEFAULT"),
            [
                (
                    item["name"],
                    item["url"],
                    item["fingerprint"][:SHORT_FINGERPRINT] or "-",
                    "yes" if item["default"] else "-",
                )
                for item in items
            ],
        )

    output.data(rows, table)
    return EXIT_OK


async def _remote_add(
    reactor: IVMReadyReactor,
    output: Output,
    args: argparse.Namespace,
    directory: str,
    remotes: Remotes,
) -> int:
    name = validate_remote_name(args.remote_name)
    if name in remotes.remotes:
        raise CommandError(
            f"remote {name} exists already (vmready remote remove {name} first)", EXIT_FAILED
        )
    token = _token(args)
    url = _remote_url(args, token)
    identity = client_identity(directory)
    if token is not None:
        pinned = token.fingerprint
    else:
        pinned = await _accepted_fingerprint(reactor, output, args, name, url, identity)
    remote = Remote(url, pinned)
    tls = PinnedRemote(reactor, remote.host, remote.port, identity, pinned)
    client = Client.remote(reactor, name, url, tls)
    await _be_trusted(client, output, name, url, identity, args.token if token else None)
    save_remotes(directory, attrs.evolve(remotes, remotes={**remotes.remotes, name: remote}))
    output.line(f"Remote {name} added: {url}")
    return EXIT_OK


def _token(args: argparse.Namespace) -> TrustToken | None:
    """``--token``, which pins the certificate itself, decoded (None: not given)."""
    if args.token is None:
        return None
    if args.accept_certificate or args.fingerprint:
        raise UsageError(
            "--token pins the server's certificate itself: "
            "no --accept-certificate or --fingerprint with it"
        )
    try:
        return TrustToken.decode(args.token)
    except TokenError as e:
        raise UsageError(f"invalid --token: {e}") from None


def _remote_url(args: argparse.Namespace, token: TrustToken | None) -> str:
    """The URL given, else the token's first address."""
    if args.url is not None:
        return parse_remote_url(args.url)
    if token is not None and token.addresses:
        return parse_remote_url(f"https://{token.addresses[0]}")
    raise UsageError("remote add needs a URL (https://HOST[:PORT]) or a --token naming one")


async def _accepted_fingerprint(
    reactor: IVMReadyReactor,
    output: Output,
    args: argparse.Namespace,
    name: str,
    url: str,
    identity: CertificatePair,
) -> str:
    """Without a token: the server's certificate, shown, and pinned only once the operator
    matched it (``--fingerprint``) or accepted it (``--accept-certificate``)."""
    expected = None
    if args.fingerprint is not None:
        try:
            expected = normalize_fingerprint(args.fingerprint)
        except TokenError as e:
            raise UsageError(f"--fingerprint: {e}") from None
    place = Remote(url, "0" * 64)
    shown = fingerprint(
        await probe_server_certificate(reactor, place.host, place.port, identity, url)
    )
    output.line(f"Certificate fingerprint: {shown}")
    if expected is not None and expected != shown:
        raise CommandError(
            f"not adding {name}: the certificate of {url} has fingerprint {shown}, not "
            f"{expected} (the one you expected): is something between you and the daemon?",
            EXIT_FAILED,
        )
    if expected is None and not args.accept_certificate:
        raise CommandError(
            f"not adding {name}: check the fingerprint above against the daemon's (on its "
            "host: openssl x509 -in <data-dir>/server.crt -noout -fingerprint -sha256), then "
            "run again with --fingerprint SHA256 or --accept-certificate; or use a trust "
            "token (--token)",
            EXIT_FAILED,
        )
    return shown


async def _be_trusted(
    client: Client,
    output: Output,
    name: str,
    url: str,
    identity: CertificatePair,
    token: str | None,
) -> None:
    """Have the daemon trust this client with the token, or check that it does already."""
    try:
        if token is not None:
            entry = (await client.request("POST", "/1.0/certificates", {"trust_token": token}))[
                "metadata"
            ]
            output.line(f"Client certificate trusted by {url} as {entry.get('name')}")
        else:
            # An untrusted client reads GET /1.0 too, as LXD's: its "auth" says.
            server = await client.get("/1.0")
            if not isinstance(server, dict) or server.get("auth") != "trusted":
                raise CommandError(
                    f"not adding {name}: {url} does not trust this client's certificate "
                    f"({identity.fingerprint}): on the daemon's host, issue a token with "
                    "'vmready config trust add NAME' and add the remote with --token TOKEN",
                    EXIT_FAILED,
                )
    except APIError as e:
        raise CommandError(f"not adding {name}: {e.error}", EXIT_FAILED) from None


# -- config trust ---------------------------------------------------------


def _trust_table(entries: list[dict[str, Any]]) -> str:
    return aligned_table(
        ("NAME", "FINGERPRINT", "ADDED"),
        [
            (
                str(entry.get("name")),
                str(entry.get("fingerprint"))[:SHORT_FINGERPRINT],
                str(entry.get("added_at")),
            )
            for entry in entries
        ],
    )


async def _trust_add(client: Client, output: Output, args: argparse.Namespace) -> int:
    issued = (
        await client.request("POST", "/1.0/certificates", {"name": args.name, "token": True})
    )["metadata"]

    def table(item: dict[str, Any]) -> str:
        return (
            f"Client {item['client_name']} certificate add token "
            f"(valid until {item['expires_at']}):\n{item['token']}\n"
        )

    output.data(issued, table)
    return EXIT_OK


async def _trust_list(client: Client, output: Output, args: argparse.Namespace) -> int:
    output.data(await client.get("/1.0/certificates?recursion=1"), _trust_table)
    return EXIT_OK


async def _trust_remove(client: Client, output: Output, args: argparse.Namespace) -> int:
    wanted = args.name
    entries: list[dict[str, Any]] = await client.get("/1.0/certificates?recursion=1")
    matches = [entry for entry in entries if entry.get("name") == wanted]
    if not matches:
        key = wanted.replace(":", "").lower()
        matches = [entry for entry in entries if str(entry.get("fingerprint")).startswith(key)]
        if len(key) < 6 or not key.isalnum():
            matches = [entry for entry in matches if entry.get("fingerprint") == key]
    if not matches:
        raise CommandError(f"no trusted certificate is named {wanted} or has that fingerprint")
    if len(matches) > 1:
        raise CommandError(
            f"{wanted} is the start of {len(matches)} fingerprints: give more of it"
        )
    target = str(matches[0]["fingerprint"])
    removed = (await client.request("DELETE", f"/1.0/certificates/{quote(target, safe='')}"))[
        "metadata"
    ]
    output.data(removed, lambda item: f"Removed {item['name']} ({item['fingerprint']})\n")
    return EXIT_OK


# ``vmready config trust VERB``.
trust_command = by_verb(
    "trust_verb", {"add": _trust_add, "list": _trust_list, "remove": _trust_remove}
)


# Commands that talk to a daemon (any remote), dispatched like cli.commands.COMMANDS.
