"""Reading a transcript's records as the guest's inputs to a replay.

Which recorded QMP events are the guest's own power actions, which CONNECT
lines the agent read, when the agent saw its host go, which requests never
reached the host: questions about the records alone, no core involved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

from vmready.protocols import data_from_fields, parse_connect
from vmready.protocols.transcriptreader import Entry


def guest_power_action(entry: Entry) -> str | None:
    """The guest's own power action a recorded ``qmp-event`` shows, as fakeqemu's control word.

    ``SHUTDOWN`` with ``"guest": true`` is the guest powering off, ``RESET`` with
    ``"guest": true`` the guest rebooting, ``GUEST_PANICKED`` a kernel panic (its
    own ``SHUTDOWN``, reason ``guest-panic``, is part of the panic).  Every other
    event is the VM's answer to the host's own actions: not an input.
    """
    if entry.kind != "qmp-event":
        return None
    event = entry.fields.get("event")
    data = entry.fields.get("data")
    data = data if isinstance(data, dict) else {}
    if event == "GUEST_PANICKED":
        return "panic"
    if data.get("guest") is not True:
        return None
    if event == "SHUTDOWN" and data.get("reason") != "guest-panic":
        return "poweroff"
    if event == "RESET":
        return "reboot"
    return None


def connect_ports(data: bytes) -> list[int]:
    """The ports of the CONNECT lines in ``data``."""
    ports = []
    for line in data.decode("utf-8", "replace").splitlines():
        with contextlib.suppress(ValueError):
            ports.append(parse_connect(line)[1])
    return ports


def first_agent_port(entries: Iterable[Entry]) -> int:
    """Agent side: the port of the first CONNECT the agent read (0: none)."""
    for entry in entries:
        if entry.kind == "serial-in":
            for port in connect_ports(data_from_fields(entry.fields)):
                return port
    return 0


def host_lost(records: Sequence[Entry], entry: Entry, port: int) -> bool:
    """Agent side: whether the agent's ``serial-out`` at ``entry`` shows its host is gone.

    ``records`` are in the order replayed; ``port`` the replayed daemon's.  The
    agent writes ``STARTED`` again, after ``CONNECTED``, once its held
    ``/1.0/events`` stream ended: the daemon went away when the next CONNECT the
    agent read names another port (a new daemon), or when none follows at all.
    """
    written = data_from_fields(entry.fields).splitlines()
    if b"STARTED" not in written or not _connected_before(records, entry):
        return False
    for later in records:
        if later.t < entry.t or later.kind != "serial-in":
            continue
        ports = connect_ports(data_from_fields(later.fields))
        if ports:
            return ports[0] != port
    return True


def _connected_before(records: Sequence[Entry], entry: Entry) -> bool:
    """Whether the agent's last STARTED/CONNECTED line before ``entry`` was CONNECTED."""
    last = b""
    for earlier in records:
        if earlier is entry:
            break
        if earlier.kind == "serial-out":
            for line in data_from_fields(earlier.fields).splitlines():
                if line in (b"STARTED", b"CONNECTED"):
                    last = line
    return last == b"CONNECTED"


def failed_in_recording(entries: Iterable[Entry], entry: Entry) -> bool:
    """An agent request that never reached the host (its answer is status 0): skip it."""
    for other in entries:
        if other.kind == "host-response" and other.fields.get("id") == entry.fields["id"]:
            return int(other.fields["status"]) == 0
    return False
