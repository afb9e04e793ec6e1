"""The fallback transport's network: the guest's NIC brought up with its address, stdlib only.

Where the host has no vsock, a VM gets one virtio NIC on QEMU's restricted
user-mode network, whose only destination is the host's guest API
(``CONNECT tcp:10.0.2.100:8443``).  A minimal guest may have nobody to
configure that NIC, so before dialing a ``tcp:`` address the agent does it
itself: it finds the interface whose MAC is ``network_mac`` (in
``/sys/class/net/*/address``), gives it ``network_address`` (``10.0.2.15/24``)
unless it already has an address in that subnet, and sets it up.  That takes
four ioctls (``SIOCSIFADDR``, ``SIOCSIFNETMASK``, ``SIOCGIFFLAGS``,
``SIOCSIFFLAGS``) on an ``AF_INET`` datagram socket; the kernel adds the
subnet's route when the address is set on a link that is up.  Every failure is
a ``NetworkSetupError`` whose message is the dial's failure reason.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import re
import socket
import struct
from dataclasses import dataclass
from typing import Callable

from vmready.agent.logs import logger

DEFAULT_SYSFS_NET = "/sys/class/net"
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
SIOCGIFADDR = 0x8915
SIOCSIFADDR = 0x8916
SIOCGIFNETMASK = 0x891B
SIOCSIFNETMASK = 0x891C
IFF_UP = 0x1
_IFNAMSIZ = 16
_IFREQ_SIZE = 40  # struct ifreq on Linux: the name, then a 24-byte union
_MAC = re.compile(r"[0-9a-f]{2}(?::[0-9a-f]{2}){5}")

log = logger(__name__)

# fcntl.ioctl(fd, request, buffer) → the buffer as the kernel left it (tests pass a fake).
Ioctl = Callable[[int, int, bytes], bytes]


class NetworkSetupError(Exception):
    """The NIC could not be found or configured; the message says which and why."""


@dataclass(frozen=True)
class NetworkPlan:
    """The NIC to configure, by MAC, and the address (with prefix) to give it."""

    mac: str
    address: ipaddress.IPv4Interface

    def __str__(self) -> str:
        return f"{self.address.with_prefixlen} on the NIC {self.mac}"


def parse_network(mac: str, address: str) -> NetworkPlan:
    """``52:54:00:…`` and ``10.0.2.15/24`` → NetworkPlan; ValueError saying what is wrong."""
    normal = mac.strip().lower()
    if not _MAC.fullmatch(normal):
        raise ValueError(f"network_mac {mac!r} is not a MAC address like 52:54:00:12:34:56")
    if "/" not in address:
        raise ValueError(f"network_address {address!r} has no prefix length (like 10.0.2.15/24)")
    try:
        interface = ipaddress.IPv4Interface(address)
    except ValueError:
        raise ValueError(f"network_address {address!r} is not an IPv4 address/prefix") from None
    return NetworkPlan(normal, interface)


def find_interface(mac: str, sysfs: str = DEFAULT_SYSFS_NET) -> str:
    """The name of the interface whose MAC is ``mac``; NetworkSetupError if none is."""
    try:
        names = sorted(os.listdir(sysfs))
    except OSError as e:
        raise NetworkSetupError(
            f"cannot list network interfaces in {sysfs}: {e.strerror}"
        ) from None
    for name in names:
        try:
            with open(os.path.join(sysfs, name, "address")) as f:
                if f.read().strip().lower() == mac:
                    return name
        except OSError:
            continue  # an interface without an address file (or one going away)
    raise NetworkSetupError(f"no network interface has MAC {mac} (looked in {sysfs})")


def _ifreq(name: str, payload: bytes = b"") -> bytes:
    encoded = name.encode("ascii")
    if len(encoded) >= _IFNAMSIZ:
        raise NetworkSetupError(f"interface name {name!r} is too long")
    return (encoded.ljust(_IFNAMSIZ, b"\0") + payload).ljust(_IFREQ_SIZE, b"\0")


def _sockaddr_in(address: ipaddress.IPv4Address) -> bytes:
    # struct sockaddr_in: family (host order), port (0), address, 8 bytes of zero.
    return struct.pack("=HH4s8x", socket.AF_INET, 0, address.packed)


def _ipv4_of(ifreq: bytes) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(ifreq[_IFNAMSIZ + 4 : _IFNAMSIZ + 8])


def _current_address(fd: int, name: str, ioctl: Ioctl) -> ipaddress.IPv4Interface | None:
    """The interface's IPv4 address and netmask, or None if it has none."""
    try:
        address = _ipv4_of(ioctl(fd, SIOCGIFADDR, _ifreq(name)))
        netmask = _ipv4_of(ioctl(fd, SIOCGIFNETMASK, _ifreq(name)))
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            return None
        raise
    return ipaddress.IPv4Interface(f"{address}/{netmask}")


def bring_up(plan: NetworkPlan, sysfs: str = DEFAULT_SYSFS_NET, ioctl: Ioctl | None = None) -> str:
    """Give the NIC of ``plan`` its address (unless it has one in the subnet) and set it up.

    Returns the interface's name; NetworkSetupError saying why not.
    """
    name = find_interface(plan.mac, sysfs)
    call: Ioctl = ioctl if ioctl is not None else fcntl.ioctl
    where = f"{name} ({plan.mac})"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as control:
            fd = control.fileno()
            current = _current_address(fd, name, call)
            if current is None or current.network != plan.address.network:
                call(fd, SIOCSIFADDR, _ifreq(name, _sockaddr_in(plan.address.ip)))
                call(fd, SIOCSIFNETMASK, _ifreq(name, _sockaddr_in(plan.address.netmask)))
                log.info("network: gave %s the address %s", where, plan.address.with_prefixlen)
            (flags,) = struct.unpack_from("=h", call(fd, SIOCGIFFLAGS, _ifreq(name)), _IFNAMSIZ)
            if not flags & IFF_UP:
                call(fd, SIOCSIFFLAGS, _ifreq(name, struct.pack("=h", flags | IFF_UP)))
                log.info("network: set %s up", where)
    except OSError as e:
        raise NetworkSetupError(
            f"cannot configure the network interface {where}: {e.strerror or e}"
        ) from None
    return name
