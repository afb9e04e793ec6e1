"""Where the agent's virtio ports are: found by name, with udev's links or without udev.

In a real guest a port is a virtio character device.  With udev it is the
link ``/dev/virtio-ports/<name>``; without udev there is no link, only
``/dev/vportNpM``, whose name is in ``/sys/class/virtio-ports/vportNpM/name``.
``find_port`` tries each name in turn (the one the host wired first), the link
and then sysfs.  A fakeqemu guest exposes the same names as unix sockets in a
directory of its own (its sysfs is the host's, so it is never searched).

Nothing here needs more than ``os``: the agent finds its port this way before
it imports its event loop (``firstword``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from vmready.agent.records import Record

PORT_NAME = "com.canonical.lxd"
LEGACY_PORT_NAME = "org.linuxcontainers.lxd"
DEFAULT_VIRTIO_PORTS = "/dev/virtio-ports"
DEFAULT_SYSFS_PORTS = "/sys/class/virtio-ports"
DEFAULT_DEV = "/dev"
CONNECT_PORT_NAME = "vmready.connect"


class SerialPortMissing(Exception):
    """No serial port to open; the message says where the agent looked."""


def is_port_name(name: str) -> bool:
    """Whether ``name`` can name a port: a single path component."""
    return "/" not in name and name not in ("", ".", "..")


def port_names(wired: str | None) -> tuple[str, ...]:
    """The names to try, in order: the one the host wired first, then the known ones."""
    known = (PORT_NAME, LEGACY_PORT_NAME)
    if wired is None:
        return known
    return (wired, *(name for name in known if name != wired))


class FoundPort(Record):
    """A port to open: its path, its name, and whether sysfs named it (no udev link)."""

    __slots__ = ("name", "path", "sysfs")

    def __init__(self, path: str, name: str, sysfs: str | None = None) -> None:
        self.path = path
        self.name = name
        self.sysfs = sysfs

    def describe(self) -> str:
        """How the log names it: ``<path>``, ``<path> (legacy name)`` …"""
        notes = []
        if self.sysfs is not None:
            notes.append(f"{self.name}, found in {self.sysfs}")
        if self.name == LEGACY_PORT_NAME:
            notes.append("legacy name")
        return self.path + (f" ({'; '.join(notes)})" if notes else "")


def _names(names: Sequence[str]) -> str:
    if len(names) == 2:
        return f"neither {names[0]} nor {names[1]}"
    return "none of " + ", ".join(names)


def _sysfs_entry(sysfs: str, name: str) -> str | None:
    """The ``vportNpM`` whose ``name`` file says ``name``, if any."""
    try:
        entries = sorted(os.listdir(sysfs))
    except OSError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(sysfs, entry, "name"), encoding="utf-8") as f:
                if f.read().strip() == name:
                    return entry
        except (OSError, UnicodeDecodeError):
            continue
    return None


def find_port(
    names: Sequence[str],
    virtio_ports: str = DEFAULT_VIRTIO_PORTS,
    sysfs: str | None = DEFAULT_SYSFS_PORTS,
    dev: str = DEFAULT_DEV,
) -> FoundPort:
    """The first of ``names`` present: as a udev link, else named in sysfs (if given)."""
    for name in names:
        link = os.path.join(virtio_ports, name)
        if os.path.exists(link):
            return FoundPort(link, name)
        if sysfs is not None:
            entry = _sysfs_entry(sysfs, name)
            if entry is not None and os.path.exists(os.path.join(dev, entry)):
                return FoundPort(os.path.join(dev, entry), name, sysfs)
    where = virtio_ports if sysfs is None else f"{virtio_ports} or {sysfs}"
    raise SerialPortMissing(f"{_names(names)} in {where}")
