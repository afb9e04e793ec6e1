"""``vmready config``, ``rename`` and ``operation``: the commands operators know from incus.

``config`` reads and changes an instance's keys through ``PATCH
/1.0/instances/<name>`` (the daemon checks them, as at launch), and shows the
daemon's options from ``GET /1.0`` (read-only: the daemon reads them when it
starts).  Which one a command line means is decided by its arguments, as incus
does: ``config get NAME KEY`` against ``config get KEY``.  ``operation`` lists,
shows and waits for the daemon's operations.  There is no ``operation
delete``: vmready's operations cannot be cancelled (``may_cancel`` is false).
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from vmready.cli import tables
from vmready.cli.client import Client, get_instance, instance_path
from vmready.cli.errors import EXIT_FAILED, EXIT_OK, CommandError, UsageError
from vmready.cli.output import Output, to_yaml
from vmready.cli.remotecommands import trust_command
from vmready.cli.verbs import by_verb

DAEMON_CONFIG_FILE = "/etc/vmready/vmready.yaml"

Command = Callable[[Client, Output, argparse.Namespace], Any]


def _yaml_or_data(output: Output, value: Any) -> None:
    """What ``show`` prints: YAML for people (as incus does), else the chosen format."""
    output.data(value, lambda data: to_yaml(data) if data else "{}\n")


def _daemon_refusal(keys: list[str]) -> CommandError:
    """Why a daemon option cannot be changed from here, and where it can."""
    listed = ", ".join(keys)
    return CommandError(
        f"Error: {listed}: the daemon's options are read when it starts and cannot be "
        f"changed while it runs: set {'it' if len(keys) == 1 else 'them'} in its config file "
        f"({DAEMON_CONFIG_FILE}, or the file named by twistd vmready --config or "
        "$VMREADY_CONFIG) or on twistd vmready's command line, then restart the daemon "
        "(running VMs keep running)",
        EXIT_FAILED,
    )


def _pair(item: str) -> tuple[str, str]:
    """``KEY=VALUE`` as (key, value); UsageError naming what is wrong."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise UsageError(f"expected KEY=VALUE, got {item!r}")
    return key, value


def parse_set(args: list[str]) -> tuple[str | None, dict[str, str]]:
    """``config set``'s arguments as (instance or None for the daemon, keys to set).

    incus' rule: a first argument holding ``=`` is a daemon key; two arguments
    without ``=`` are a daemon ``KEY VALUE``; otherwise the first is the
    instance, followed by ``KEY VALUE`` or ``KEY=VALUE``....
    """
    if "=" in args[0]:
        return None, dict(_pair(item) for item in args)
    if len(args) == 1:
        raise UsageError(f"config set needs KEY=VALUE or NAME KEY=VALUE, got only {args[0]!r}")
    if len(args) == 2 and "=" not in args[1]:
        return None, {args[0]: args[1]}
    name, rest = args[0], args[1:]
    if len(rest) == 2 and "=" not in rest[0]:
        return name, {rest[0]: rest[1]}
    return name, dict(_pair(item) for item in rest)


async def _daemon_config(client: Client) -> dict[str, Any]:
    server = await client.get("/1.0")
    if isinstance(server, dict) and server.get("auth") == "untrusted":
        # A remote shows an untrusted client the API only, as LXD's does.
        raise CommandError(
            "not authorized: the daemon does not trust this client's certificate "
            "(add the remote with a trust token: 'vmready config trust add NAME' on its host)",
            EXIT_FAILED,
        )
    config = server.get("config") if isinstance(server, dict) else None
    return dict(config) if isinstance(config, dict) else {}


async def _config_show(client: Client, output: Output, args: argparse.Namespace) -> int:
    if args.name is None:
        _yaml_or_data(output, await _daemon_config(client))
    else:
        config = (await get_instance(client, args.name)).get("config") or {}
        _yaml_or_data(output, dict(sorted(config.items())))
    return EXIT_OK


async def _config_get(client: Client, output: Output, args: argparse.Namespace) -> int:
    if len(args.args) > 2:
        raise UsageError(f"config get takes [NAME] KEY, got {len(args.args)} arguments")
    if len(args.args) == 1:
        config = await _daemon_config(client)
    else:
        config = (await get_instance(client, args.args[0])).get("config") or {}
    value = config.get(args.args[-1])
    # Like incus: a key that is not set prints an empty line and succeeds.
    output.data(value, lambda found: ("" if found is None else str(found)) + "\n")
    return EXIT_OK


async def _patch(client: Client, output: Output, name: str, changes: dict[str, str | None]) -> int:
    updated = (await client.request("PATCH", instance_path(name), {"config": changes}))["metadata"]
    if not output.is_table:
        output.result(updated)
    return EXIT_OK


async def _config_set(client: Client, output: Output, args: argparse.Namespace) -> int:
    name, changes = parse_set(args.args)
    if name is None:
        raise _daemon_refusal(list(changes))
    return await _patch(client, output, name, dict(changes))


async def _config_unset(client: Client, output: Output, args: argparse.Namespace) -> int:
    if len(args.args) == 1:
        raise _daemon_refusal(args.args)
    name, keys = args.args[0], args.args[1:]
    return await _patch(client, output, name, dict.fromkeys(keys))


# ``vmready config VERB``.
config_command = by_verb(
    "config_verb",
    {
        "show": _config_show,
        "get": _config_get,
        "set": _config_set,
        "unset": _config_unset,
        "trust": trust_command,
    },
)


def _operation_path(operation_id: str, *rest: str) -> str:
    return "/".join(
        ["/1.0/operations", quote(operation_id, safe="", errors="surrogateescape"), *rest]
    )


def _instant(value: Any) -> float:
    """An operation's RFC 3339 time as seconds, to sort by (0 when missing or unreadable)."""
    try:
        return datetime.datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        return 0.0


async def _operation_list(client: Client, output: Output, args: argparse.Namespace) -> int:
    grouped = await client.get("/1.0/operations?recursion=1")
    operations = sorted(
        (op for group in (grouped or {}).values() for op in group if isinstance(op, dict)),
        key=lambda op: (_instant(op.get("created_at")), str(op.get("id"))),
    )
    output.data(operations, tables.operations_table, tables.operation_rows)
    return EXIT_OK


async def _operation_show(client: Client, output: Output, args: argparse.Namespace) -> int:
    _yaml_or_data(output, await client.get(_operation_path(args.id)))
    return EXIT_OK


async def _operation_wait(client: Client, output: Output, args: argparse.Namespace) -> int:
    timeout = -1 if args.timeout is None else args.timeout
    operation = await client.get(_operation_path(args.id, f"wait?timeout={timeout:g}"))
    if operation.get("status") == "Running":
        raise CommandError(
            f"timed out after {args.timeout:g}s waiting for operation {args.id} "
            f"({operation.get('description')}: still running)",
            EXIT_FAILED,
        )
    if not output.is_table:
        output.result(operation)
    if operation.get("status_code") != 200:
        raise CommandError(f"Error: {operation.get('err') or operation.get('status')}")
    if output.is_table:
        output.line(f"{operation.get('description')}: {operation.get('status')}")
    return EXIT_OK


# ``vmready operation VERB``.
operation_command = by_verb(
    "operation_verb",
    {"list": _operation_list, "show": _operation_show, "wait": _operation_wait},
)
