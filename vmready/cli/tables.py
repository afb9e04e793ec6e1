"""The table format: instances, one instance, snapshots, actions, and events as lines."""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["actions_table", "event_line", "info_table", "instances_table", "snapshots_table"]


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
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


def instances_table(instances: list[dict[str, Any]]) -> str:
    rows = [
        [
            str(instance["name"]),
            str(instance["status"]).upper(),
            _dash(instance.get("display_status")),
            _dash(instance.get("task_state")),
            _dash(instance.get("power_state")),
            f"{instance['limits']['memory_mib']}MiB",
            str(instance["limits"]["cpus"]),
        ]
        for instance in instances
    ]
    return _table(["NAME", "STATUS", "DISPLAY", "TASK", "POWER", "MEMORY", "CPUS"], rows)


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


def info_table(instance: dict[str, Any]) -> str:
    lines = [
        f"Name: {instance['name']}",
        f"UUID: {instance['uuid']}",
        f"Type: {instance.get('type', 'virtual-machine')}",
        f"Status: {str(instance['status']).upper()}",
        f"Display status: {instance.get('display_status', '-')}",
        f"VM state: {_dash(instance.get('vm_state'))}",
        f"Task state: {_dash(instance.get('task_state'))}",
        f"Power state: {_dash(instance.get('power_state'))}",
        f"Agent: {_dash((instance.get('agent') or {}).get('status'))}",
        f"Serial layout: {_layout_line(instance.get('serial_layout'))}",
        *_boot_lines(instance.get("boot")),
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
    lines.extend(_fault_line(fault) for fault in instance.get("faults") or [])
    return "\n".join(lines) + "\n"


# How ``vmready info`` words each kind of fault still standing (none: nothing is wrong).
_FAULT_LINES = {
    "error": "Last error: {message} (at {since})",
    "monitor": "Monitor: lost since {since}: {message}",
    "agent": "Agent link: lost since {since}: {message}",
    "certificate": "Certificates: failing since {since}: {message}",
    "snapshot": "Last snapshot failure: {message} (at {since})",
    "store": "Store: writes failing since {since}: {message}",
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
    return _table(["NAME", "STATEFUL", "LAYOUT", "CREATED"], rows)


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
    return _table(["ACTION", "RESULT", "STARTED", "FINISHED", "ERROR"], rows)


def event_line(event: dict[str, Any]) -> str:
    """One event as a readable line."""
    stamp = _time(event.get("timestamp"))
    kind = str(event.get("type", "?"))
    metadata = event.get("metadata") or {}
    if kind == "lifecycle":
        name = str(metadata.get("source", "")).removeprefix("/1.0/instances/")
        context = metadata.get("context") or {}
        details = " ".join(
            f"{key}={_dash(value)}"
            for key, value in context.items()
            if not _is_block(value) and not (key == "error" and not value)
        )
        return f"{stamp} {kind} {metadata.get('action', '?')} {name} {details}".rstrip()
    if kind == "operation":
        error = f": {metadata['err']}" if metadata.get("err") else ""
        return (
            f"{stamp} {kind} {metadata.get('description', '?')} "
            f"{metadata.get('status', '?')}{error}"
        )
    return f"{stamp} {kind} {json.dumps(metadata)}"
