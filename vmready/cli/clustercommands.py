"""``vmready cluster list|show``: the members of the daemon's cluster, as it sees them."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import quote

from vmready.cli import tables
from vmready.cli.client import Client
from vmready.cli.errors import EXIT_OK
from vmready.cli.output import Output, to_yaml

__all__ = ["cluster_command"]


async def _cluster_list(client: Client, output: Output, args: argparse.Namespace) -> int:
    members = await client.get("/1.0/cluster/members?recursion=1")
    output.data(members, tables.members_table, tables.member_rows)
    return EXIT_OK


async def _cluster_show(client: Client, output: Output, args: argparse.Namespace) -> int:
    member = await client.get(
        "/1.0/cluster/members/" + quote(args.member, safe="", errors="surrogateescape")
    )
    # YAML for people, as ``operation show`` and incus do; else the chosen format.
    output.data(member, lambda data: to_yaml(data))
    return EXIT_OK


async def cluster_command(client: Client, output: Output, args: argparse.Namespace) -> int:
    """``vmready cluster VERB``."""
    verb: Any = _cluster_list if args.cluster_verb == "list" else _cluster_show
    result: int = await verb(client, output, args)
    return result
