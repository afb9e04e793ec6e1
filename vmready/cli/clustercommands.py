"""``vmready cluster list|show|remove``: the members of the daemon's cluster, as it sees them."""

from __future__ import annotations

import argparse
from urllib.parse import quote

from vmready.cli import tables
from vmready.cli.client import Client
from vmready.cli.errors import EXIT_OK
from vmready.cli.output import Output, to_yaml
from vmready.cli.verbs import by_verb


async def _cluster_list(client: Client, output: Output, args: argparse.Namespace) -> int:
    members = await client.get("/1.0/cluster/members?recursion=1")
    output.data(members, tables.members_table, tables.member_rows)
    return EXIT_OK


async def _cluster_show(client: Client, output: Output, args: argparse.Namespace) -> int:
    member = await client.get("/1.0/cluster/members/" + _quoted(args.member))
    # YAML for people, as ``operation show`` and incus do; else the chosen format.
    output.data(member, lambda data: to_yaml(data))
    return EXIT_OK


async def _cluster_remove(client: Client, output: Output, args: argparse.Namespace) -> int:
    removed = (await client.request("DELETE", "/1.0/cluster/members/" + _quoted(args.member)))[
        "metadata"
    ]
    output.data(
        removed, lambda item: f"Removed cluster member {item['server_name']} ({item['address']})\n"
    )
    return EXIT_OK


def _quoted(name: str) -> str:
    return quote(name, safe="", errors="surrogateescape")


# ``vmready cluster VERB``.
cluster_command = by_verb(
    "cluster_verb", {"list": _cluster_list, "show": _cluster_show, "remove": _cluster_remove}
)
