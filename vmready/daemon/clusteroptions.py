"""``--store``, ``--member-name``, ``--member-address``, ``--lease-seconds``, ``--fence``: where
the store is, who this daemon is among the members sharing it, and whether its VMs are fenced.

A SQLite file (the default, ``<data-dir>/vmready.sqlite``) is one host's
store, as always.  A ``postgresql://`` (or ``postgres://``) URL names a store
several daemons share: each is then a *cluster member*, with a name (the host
name unless told), a lease it renews in the store every third of
``--lease-seconds``, and the address other members dial to forward a request
to it: its mutual-TLS API, so a member needs ``--https-address``.  That
address defaults to ``--https-address`` when it names a host; one that
listens on every interface does not say which of them the others reach, so
``--member-address`` must.

Everything here is checked before the daemon starts: ``--lease-seconds`` as
it is parsed (``CLUSTER_OPTIONS``), the rest together (``cluster_settings``),
what is wrong being a ``ValueError`` in one line, which ``tap`` turns into
its usage error.
"""

from __future__ import annotations

import os
import re
import socket
import urllib.parse

import attrs

from vmready.daemon.httpsaddress import HTTPSAddress
from vmready.daemon.optionvalues import choice, seconds
from vmready.lifecycle import DEFAULT_LEASE_SECONDS
from vmready.store import display_location, is_postgres_location

# A renewal every third of the lease: below a second the store is asked more than it tells.
MIN_LEASE_SECONDS = 1.0
MAX_LEASE_SECONDS = 3600.0
FENCES = ("none", "vms")
# As host names are (RFC 1123 labels, dots), with underscores: it is a row's key, not DNS.
_MEMBER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")

# ``twistd vmready``'s options for a cluster member (``tap.Options.optParameters`` rows).
CLUSTER_OPTIONS = [
    [
        "store",
        None,
        None,
        "Where the store is: a SQLite file (default: <data-dir>/vmready.sqlite) or a "
        "postgresql://USER@HOST/DATABASE URL (libpq's, ?host=/run/postgresql for a unix "
        "socket), which makes this daemon a cluster member sharing it with the others "
        "(needs --https-address).",
    ],
    [
        "member-name",
        None,
        None,
        "This daemon's name as a cluster member (default: the host name).",
    ],
    [
        "member-address",
        None,
        None,
        "HOST:PORT the other cluster members dial to reach this one's mutual-TLS API "
        "(default: --https-address, when it names a host).",
    ],
    seconds(
        "lease-seconds",
        DEFAULT_LEASE_SECONDS,
        "Seconds a cluster member's lease lasts (1 to 3600), renewed every third of it: a "
        "member that stops renewing is shown unreachable once it runs out.",
        (
            lambda lease: MIN_LEASE_SECONDS <= lease <= MAX_LEASE_SECONDS,
            f"{MIN_LEASE_SECONDS:g} to {MAX_LEASE_SECONDS:g} seconds",
        ),
    ),
    choice(
        "fence",
        "none",
        "none (default) or vms: a cluster member's host fence, a process of its own that "
        "kills every VM of the member once its lease may have run out (frozen, cut off from "
        "the store, killed and not back in time), so that no VM runs on after another daemon "
        "could take its name over; the price: a store out of reach longer than a lease kills "
        "the member's VMs.",
        FENCES,
    ),
]


@attrs.frozen
class ClusterSettings:
    """Who this daemon is as a cluster member."""

    name: str
    # host:port the other members dial; None: --https-address's host and the port it binds.
    address: str | None
    lease_seconds: float
    # Whether a host fence kills the member's VMs once its lease may have run out.
    fence_vms: bool = False


def store_location(given: str | None, data_dir: str) -> str:
    """The store ``--store`` names: a PostgreSQL URL as given, a file path made absolute,
    or the data dir's SQLite file; ValueError for anything else."""
    if not given:
        return os.path.join(data_dir, "vmready.sqlite")
    if "://" in given:
        if not is_postgres_location(given):
            scheme = given.partition("://")[0]
            raise ValueError(
                f"--store {display_location(given)}: a {scheme}:// URL is no store vmready "
                "knows: give a SQLite file path or a postgresql:// URL"
            )
        try:
            parsed = urllib.parse.urlsplit(given)
            parsed.port  # noqa: B018 - it checks the port
        except ValueError as e:
            raise ValueError(f"--store {display_location(given)}: not a usable URL: {e}") from None
        return given
    return os.path.abspath(given)


def cluster_settings(
    location: str,
    member_name: str | None,
    member_address: str | None,
    https_address: str | None,
    lease_seconds: float,
    fence: str = "none",
) -> ClusterSettings | None:
    """Who this daemon is among the members of a PostgreSQL store; None for a single host.

    ValueError saying what is wrong, in one line.
    """
    if not is_postgres_location(location):
        given: list[tuple[str, str | None]] = [
            ("member-name", member_name),
            ("member-address", member_address),
        ]
        if fence != "none":
            given.append(("fence", fence))
        for option, value in given:
            if value is not None:
                raise ValueError(
                    f"--{option} is for a cluster member: its store is a PostgreSQL URL "
                    "(--store postgresql://…)"
                )
        return None
    if https_address is None:
        raise ValueError(
            "a cluster member (--store postgresql://…) needs --https-address: the other "
            "members forward requests to its mutual-TLS API"
        )
    name = member_name if member_name is not None else socket.gethostname()
    if not _MEMBER_NAME.fullmatch(name):
        told = (
            "--member-name"
            if member_name is not None
            else "the host name, --member-name's default,"
        )
        raise ValueError(
            f"{told} {name!r} is not a member name: 1-63 letters, digits, dots, hyphens "
            "and underscores, starting with a letter or a digit"
        )
    address = (
        _member_address(member_address)
        if member_address is not None
        else _address_from_https(https_address)
    )
    return ClusterSettings(name, address, lease_seconds, fence == "vms")


def _member_address(text: str) -> str:
    """``--member-address``: a host the other members can dial, and a port."""
    try:
        address = HTTPSAddress.parse(text)
    except ValueError as e:
        raise ValueError(f"--member-address {e}") from None
    if address.wildcard:
        raise ValueError(
            f"--member-address {text!r}: name the host or address the other members dial, "
            "not every interface"
        )
    if address.port == 0:
        raise ValueError(f"--member-address {text!r}: name the port the other members dial")
    return _host_port(address.host, address.port)


def _address_from_https(https_address: str) -> str | None:
    """The member address ``--https-address`` gives (None: its port is chosen at bind time)."""
    address = HTTPSAddress.parse(https_address)
    if address.wildcard:
        raise ValueError(
            f"--https-address {https_address} listens on every interface: give "
            "--member-address HOST:PORT, the address the other members dial"
        )
    if address.port == 0:
        return None
    return _host_port(address.host, address.port)


def _host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bound_member_address(https_address: str, port: int) -> str:
    """The member address of ``--https-address`` once it listens on ``port``."""
    return _host_port(HTTPSAddress.parse(https_address).host, port)
