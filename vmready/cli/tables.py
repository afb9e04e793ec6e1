"""The table format: instances, one instance, snapshots, actions, and events as lines."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from vmready.domain import READY_KEY


def aligned_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned on the widest cell, two spaces apart."""
    widths = [len(header) for header in headers]
    for row in rows:
        widths = [max(width, len(cell)) for width, cell in zip(widths, row, strict=True)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [list(headers), *rows]
    ]
    return "\n".join(lines) + "\n"


def _time(value: Any) -> str:
    """An API timestamp (RFC 3339 text or Unix seconds) for a table."""
    if value is None or value == "":
        return "-"
    if isinstance(value, int | float):
        stamp = datetime.datetime.fromtimestamp(value, tz=datetime.UTC)
        return stamp.strftime("%Y-%m-%d %H:%M:%S")
    return str(value).replace("T", " ").removesuffix("Z").split(".")[0]


def _dash(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _is_block(value: Any) -> bool:
    return isinstance(value, dict | list | tuple) and len(value) > 0


class Column(NamedTuple):
    """One column ``vmready list`` can show: its letter, its name, its header, its cell."""

    letter: str
    name: str
    header: str
    cell: Callable[[dict[str, Any]], str | None]  # None: nothing to show ("-", or empty in CSV)


def _status(instance: dict[str, Any]) -> str:
    # A daemon from before operator_status: its LXD status is the nearest word.
    return str(instance.get("operator_status") or instance["status"]).upper()


def _field(key: str) -> Callable[[dict[str, Any]], str | None]:
    def cell(instance: dict[str, Any]) -> str | None:
        value = instance.get(key)
        return None if value is None or value == "" else str(value)

    return cell


def _ready(instance: dict[str, Any]) -> str | None:
    ready = instance.get("ready")
    if ready is None:  # the instance object has no ``ready``: the ready key says it
        ready = (instance.get("config") or {}).get(READY_KEY) == "true"
    return "yes" if ready else "no"


LIST_COLUMNS = (
    Column("n", "name", "NAME", lambda i: str(i["name"])),
    Column("s", "status", "STATUS", _status),
    Column("m", "memory", "MEMORY", lambda i: f"{i['limits']['memory_mib']}MiB"),
    Column("c", "cpus", "CPUS", lambda i: str(i["limits"]["cpus"])),
    Column("r", "ready", "READY", _ready),
    Column("a", "agent", "AGENT", lambda i: _field("status")(i.get("agent") or {})),
    Column("l", "lxd_status", "LXD", lambda i: str(i["status"]).upper()),
    Column("d", "display_status", "DISPLAY", _field("display_status")),
    Column("v", "vm_state", "VM", _field("vm_state")),
    Column("t", "task_state", "TASK", _field("task_state")),
    Column("p", "power_state", "POWER", _field("power_state")),
    Column("u", "uuid", "UUID", _field("uuid")),
    Column("e", "error", "ERROR", _field("error")),
    # LXD's letter; "none" on a single host.
    Column("L", "location", "LOCATION", _field("location")),
)
DEFAULT_COLUMNS = "nsmc"
# The default columns when an instance runs on a cluster member: where, too.
CLUSTER_DEFAULT_COLUMNS = "nsmcL"
_BY_LETTER = {column.letter: column for column in LIST_COLUMNS}
_BY_NAME = {column.name: column for column in LIST_COLUMNS}


def _known() -> str:
    return ", ".join(f"{column.letter} {column.name}" for column in LIST_COLUMNS)


def parse_columns(text: str) -> tuple[Column, ...]:
    """``list --columns``: letters (``nsmc``), or names with commas (``name,status``).

    A value with a comma, or that is one column's name, is read as names, so
    ``-c name`` is the NAME column, not n, a, m and e.  ValueError names what
    is unknown.
    """
    if "," in text or text in _BY_NAME:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in _BY_NAME]
        if unknown:
            raise ValueError(f"unknown column {unknown[0]!r} (columns: {_known()})")
        columns = tuple(_BY_NAME[name] for name in names)
    else:
        unknown = [letter for letter in text if letter not in _BY_LETTER]
        if unknown:
            raise ValueError(
                f"unknown column letter {unknown[0]!r} in {text!r} (columns: {_known()})"
            )
        columns = tuple(_BY_LETTER[letter] for letter in text)
    if not columns:
        raise ValueError(f"no columns given (columns: {_known()})")
    return columns


def instance_rows(
    instances: list[dict[str, Any]], columns: Sequence[Column]
) -> tuple[list[str], list[list[str | None]]]:
    """The headers and the cells of ``vmready list`` (None: nothing to show)."""
    headers = [column.header for column in columns]
    return headers, [[column.cell(instance) for column in columns] for instance in instances]


def default_columns(instances: list[dict[str, Any]]) -> tuple[Column, ...]:
    """NAME STATUS MEMORY CPUS, and LOCATION when an instance runs on a cluster member."""
    clustered = any(instance.get("location") not in (None, "", "none") for instance in instances)
    return parse_columns(CLUSTER_DEFAULT_COLUMNS if clustered else DEFAULT_COLUMNS)


def instances_table(
    instances: list[dict[str, Any]], columns: Sequence[Column] | None = None
) -> str:
    """``vmready list``: one line an instance, the chosen columns (NAME STATUS MEMORY CPUS)."""
    headers, rows = instance_rows(instances, columns or default_columns(instances))
    return aligned_table(headers, [[_dash(cell) for cell in row] for row in rows])


def _layout_line(layout: Any) -> str:
    if not isinstance(layout, dict):
        return "- (never started)"
    return f"{layout.get('name')} ({layout.get('description')})"


def _boot_lines(boot: Any) -> list[str]:
    """The boot source, accelerator and transport lines of ``vmready info``."""
    if not isinstance(boot, dict):
        return []
    accel = boot.get("accel") or {}
    current = accel.get("current")
    running = f"{current} ({accel.get('reason')})" if current else "- (never started)"
    lines = [
        f"Boot source: {_dash(boot.get('source'))}",
        f"Accelerator: {running}; requested {_dash(accel.get('requested'))}",
    ]
    if boot.get("transport"):
        lines.append(f"Guest API transport: {boot['transport']}")
    return lines


def _console_lines(instance: dict[str, Any]) -> list[str]:
    """Where the guest's serial console is logged, and the command that prints it."""
    path = (instance.get("console") or {}).get("log")
    if not path:
        return []
    return [f"Console log: {path} (vmready console {instance['name']} --show-log prints it)"]


# Wide enough for the longest agent status (CONNECTED), so the reasons line up.
_STATUS_WIDTH = 9


def _agent_link_lines(agent: Any) -> list[str]:
    """The agent link's recent changes, newest last (none from a daemon that keeps none)."""
    if not isinstance(agent, dict) or not isinstance(agent.get("history"), list):
        return []
    history = agent["history"]
    if not history:
        return ["Agent link history: (no change since the daemon started)"]
    lines = ["Agent link history:"]
    for change in history:
        line = f"  {_time(change.get('at'))}  {str(change.get('status', '-')).upper()}"
        if change.get("reason"):
            line = f"{line.ljust(23 + _STATUS_WIDTH)}  {change['reason']}"
        lines.append(line)
    return lines


def _location_lines(instance: dict[str, Any]) -> list[str]:
    """The cluster member running it (nothing on a single host)."""
    location = instance.get("location")
    return [] if location in (None, "", "none") else [f"Location: {location}"]


def info_table(instance: dict[str, Any]) -> str:
    lines = [
        f"Name: {instance['name']}",
        f"UUID: {instance['uuid']}",
        f"Type: {instance.get('type', 'virtual-machine')}",
        f"Status: {_status(instance)}",
        *_location_lines(instance),
        f"LXD status: {str(instance['status']).upper()}",
        f"Display status: {instance.get('display_status', '-')}",
        f"VM state: {_dash(instance.get('vm_state'))}",
        f"Task state: {_dash(instance.get('task_state'))}",
        f"Power state: {_dash(instance.get('power_state'))}",
        f"Agent: {_dash((instance.get('agent') or {}).get('status'))}",
        f"Serial layout: {_layout_line(instance.get('serial_layout'))}",
        *_boot_lines(instance.get("boot")),
        *_console_lines(instance),
        f"Memory: {instance['limits']['memory_mib']}MiB",
        f"CPUs: {instance['limits']['cpus']}",
        f"Created: {_time(instance.get('created_at'))}",
        f"Updated: {_time(instance.get('updated_at'))}",
    ]
    if instance.get("error"):
        lines.append(f"Error: {instance['error']}")
    config = instance.get("config") or {}
    lines.append("Config:" if config else "Config: (none)")
    lines.extend(f"  {key}: {config[key]}" for key in sorted(config))
    devices = instance.get("devices") or {}
    if devices:
        lines.append("Devices:")
        for name in sorted(devices):
            settings = ", ".join(f"{k}={v}" for k, v in sorted(devices[name].items()))
            lines.append(f"  {name}: {settings}")
    lines.extend(_agent_link_lines(instance.get("agent")))
    lines.extend(_fault_line(fault) for fault in instance.get("faults") or [])
    return "\n".join(lines) + "\n"


# How ``vmready info`` words each kind of fault still standing (none: nothing is wrong).
_FAULT_LINES = {
    "error": "Last error: {message} (at {since})",
    "monitor": "Monitor: lost since {since}: {message}",
    "agent": "Agent link: lost since {since}: {message}",
    "agent-missing": "Agent: none since {since}: {message}",
    "certificate": "Certificates: failing since {since}: {message}",
    "snapshot": "Last snapshot failure: {message} (at {since})",
    "store": "Store: writes failing since {since}: {message}",
    "host": "Host: {message}",
}


def _fault_line(fault: dict[str, Any]) -> str:
    text = _FAULT_LINES.get(fault.get("kind", ""), "{kind}: {message} (since {since})")
    return text.format(
        kind=fault.get("kind"), message=fault.get("message", ""), since=_time(fault.get("since"))
    )


def snapshots_table(snapshots: list[dict[str, Any]]) -> str:
    rows = [
        [
            str(snapshot["name"]),
            "yes" if snapshot.get("stateful") else "no",
            _dash(snapshot.get("serial_layout")),
            _time(snapshot.get("created_at")),
        ]
        for snapshot in snapshots
    ]
    return aligned_table(["NAME", "STATEFUL", "LAYOUT", "CREATED"], rows)


def actions_table(actions: list[dict[str, Any]]) -> str:
    rows: list[list[str]] = []
    for action in actions:
        rows.append(
            [
                str(action["action"]),
                _dash(action.get("result") or "running"),
                _time(action.get("started_at")),
                _time(action.get("finished_at")),
                _dash(action.get("error")),
            ]
        )
        for step in action.get("steps") or []:
            rows.append(
                [
                    f"  {step['name']}",
                    _dash(step.get("result") or "running"),
                    _time(step.get("started_at")),
                    _time(step.get("finished_at")),
                    _dash(step.get("error")),
                ]
            )
    return aligned_table(["ACTION", "RESULT", "STARTED", "FINISHED", "ERROR"], rows)


def event_line(event: dict[str, Any]) -> str:
    """One event as a readable line (on a cluster, ending with the member it happened on)."""
    stamp = _time(event.get("timestamp"))
    kind = str(event.get("type", "?"))
    metadata = event.get("metadata") or {}
    where = f" location={event['location']}" if event.get("location") else ""
    if kind == "lifecycle":
        name = str(metadata.get("source", "")).removeprefix("/1.0/instances/")
        context = metadata.get("context") or {}
        details = " ".join(
            f"{key}={_dash(value)}"
            for key, value in context.items()
            if not _is_block(value) and not (key == "error" and not value)
        )
        return f"{stamp} {kind} {metadata.get('action', '?')} {name} {details}".rstrip() + where
    if kind == "operation":
        error = f": {metadata['err']}" if metadata.get("err") else ""
        return (
            f"{stamp} {kind} {metadata.get('description', '?')} "
            f"{metadata.get('status', '?')}{error}{where}"
        )
    return f"{stamp} {kind} {json.dumps(metadata)}{where}"


OPERATION_HEADERS = ("ID", "DESCRIPTION", "STATUS", "CREATED", "INSTANCE")


def _operation_instance(operation: dict[str, Any]) -> str:
    """The instance an operation is about, by name (its first instance resource)."""
    resources = (operation.get("resources") or {}).get("instances") or []
    return str(resources[0]).rsplit("/", 1)[-1] if resources else ""


def operation_rows(operations: list[dict[str, Any]]) -> tuple[Sequence[str], list[list[str]]]:
    """``operation list``'s columns, for the table and CSV formats."""
    return OPERATION_HEADERS, [
        [
            str(operation.get("id", "")),
            str(operation.get("description", "")),
            str(operation.get("status", "")).upper(),
            _time(operation.get("created_at")),
            _operation_instance(operation),
        ]
        for operation in operations
    ]


def operations_table(operations: list[dict[str, Any]]) -> str:
    """``vmready operation list``: one operation a line, oldest first."""
    if not operations:
        return "No operations\n"
    headers, rows = operation_rows(operations)
    return aligned_table(headers, rows)


MEMBER_HEADERS = ("NAME", "ADDRESS", "STATE", "INSTANCES")


def member_rows(members: list[dict[str, Any]]) -> tuple[Sequence[str], list[list[str]]]:
    """``cluster list``'s columns, for the table and CSV formats."""
    return MEMBER_HEADERS, [
        [
            str(member.get("server_name", "")),
            str(member.get("address", "")),
            str(member.get("status", "")).upper(),
            str(member.get("instances", 0)),
        ]
        for member in members
    ]


def members_table(members: list[dict[str, Any]]) -> str:
    """``vmready cluster list``: one member a line, by name."""
    headers, rows = member_rows(members)
    return aligned_table(headers, rows)
