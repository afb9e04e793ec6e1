"""``-netdev user`` (QEMU's libslirp network), its ``guestfwd`` rules, and ``virtio-net-pci``.

QEMU creates netdevs after the accelerator, in command-line order; a NIC finds
its netdev when the devices are realized.  Every text here was measured on
QEMU 7.2 with libslirp 4.7; where a rule follows QEMU's or libslirp's source
instead (an address that no test can reach), the docstring says so.

fakeqemu models only what a restricted network with ``guestfwd=…-cmd:`` rules
gives a guest: each rule becomes a unix socket in the guest directory, and a
connection to it runs the command (see ``fakeqemu._guestfwd``).
"""

from __future__ import annotations

import ipaddress
import re
import socket

import attrs

from fakeqemu._qemuopts import CommandLineError, parse_bool, program_name

# NetClientDriver values of QEMU 7.2 other than user: valid, not modelled.
_OTHER_NETDEV_TYPES = frozenset(
    {
        "none",
        "tap",
        "l2tpv3",
        "socket",
        "stream",
        "dgram",
        "vde",
        "bridge",
        "hubport",
        "netmap",
        "vhost-user",
        "vhost-vdpa",
    }
)
# NetdevUserOptions members fakeqemu models.
_MODELLED_USER_KEYS = ("id", "type", "restrict", "ipv4", "ipv6", "net", "ip", "guestfwd")
# The other members QEMU 7.2 knows.
_UNMODELLED_USER_KEYS = frozenset(
    {
        "hostname",
        "host",
        "tftp",
        "bootfile",
        "dhcpstart",
        "dns",
        "dnssearch",
        "domainname",
        "ipv6-prefix",
        "ipv6-prefixlen",
        "ipv6-host",
        "ipv6-dns",
        "smb",
        "smbserver",
        "hostfwd",
        "tftp-server-name",
    }
)
_MAC = re.compile(r"[0-9A-Fa-f]{2}([:-][0-9A-Fa-f]{2}){5}")
_STRTOL_PORT = re.compile(r"\s*[+-]?\d+")
# Chardev shorthands a non-cmd guestfwd may name (qemu_chr_new): valid, not modelled.
_CHARDEV_SHORTHANDS = ("tcp:", "unix:", "udp:", "file:", "pipe:", "telnet:", "mon:", "/dev/")


@attrs.frozen
class GuestForwardSpec:
    """``guestfwd=tcp:ADDRESS:PORT-cmd:COMMAND``: a guest connection runs COMMAND."""

    address: str
    port: int
    command: str

    @property
    def socket_name(self) -> str:
        """The name of the unix socket standing for this address in ``<guest dir>/tcp/``."""
        return f"{self.address}:{self.port}"


@attrs.frozen
class NetdevSpec:
    """``-netdev user,id=ID,…``: a user-mode network and its forwarding rules."""

    id: str
    network: str
    restrict: bool
    forwards: tuple[GuestForwardSpec, ...]


@attrs.frozen
class NicSpec:
    """``-device virtio-net-pci``: a NIC, its network client name and its netdev."""

    name: str
    netdev: str | None
    mac: str | None


def create_user_netdev(value: str, options: list[tuple[str, str]]) -> NetdevSpec:
    """Create a ``-netdev`` as QEMU does after the accelerator; only ``user`` is modelled."""
    opts = dict(options)
    if "id" not in opts:
        raise CommandLineError("Parameter 'id' is missing")
    netdev_type = opts.get("type")
    if netdev_type is None:
        raise CommandLineError("Parameter 'type' is missing")
    if netdev_type in _OTHER_NETDEV_TYPES:
        raise CommandLineError(f"fakeqemu does not emulate the '{netdev_type}' netdev")
    if netdev_type != "user":
        raise CommandLineError(f"Parameter 'type' does not accept value '{netdev_type}'")
    # The options visitor reads the members in schema order, then refuses leftovers.
    restrict = parse_bool("restrict", opts["restrict"]) if "restrict" in opts else False
    ipv4 = parse_bool("ipv4", opts["ipv4"]) if "ipv4" in opts else True
    if "ipv6" in opts:
        parse_bool("ipv6", opts["ipv6"])
    for key, _ in options:
        if key in _UNMODELLED_USER_KEYS:
            raise CommandLineError(f"fakeqemu does not emulate the user netdev's '{key}'")
        if key not in _MODELLED_USER_KEYS:
            raise CommandLineError(f"Invalid parameter '{key}'")
    if not ipv4:
        raise CommandLineError("fakeqemu emulates only IPv4 user networks")
    network = _parse_network(opts.get("net", opts.get("ip")))
    forwards = tuple(
        _guest_forward(value, rule, network) for key, rule in options if key == "guestfwd"
    )
    return NetdevSpec(opts["id"], str(network), restrict, forwards)


def _inet_aton(text: str) -> ipaddress.IPv4Address | None:
    """inet_aton(3), which also takes the short forms (``10.2`` is 10.0.0.2)."""
    try:
        return ipaddress.IPv4Address(socket.inet_aton(text))
    except OSError:
        return None


def _parse_network(text: str | None) -> ipaddress.IPv4Network:
    """``net=ADDR[/MASK]`` as QEMU's net_slirp_init reads it; 10.0.2.0/24 by default."""
    if text is None:
        return ipaddress.IPv4Network("10.0.2.0/24")
    address_text, slash, mask_text = text.partition("/")
    address = _inet_aton(address_text)
    if address is None:
        raise CommandLineError("Failed to parse netmask")
    if not slash:
        prefix = _classful_prefix(int(address))
    elif re.fullmatch(r"\s*[+-]?\d+", mask_text):
        prefix = int(mask_text)
        if not 4 <= prefix <= 32:
            raise CommandLineError("Invalid netmask provided (must be in range 4-32)")
    else:
        mask = _inet_aton(mask_text)
        if mask is None:
            raise CommandLineError(f"Failed to parse netmask '{mask_text}'")
        prefix = bin(int(mask)).count("1")
    return ipaddress.IPv4Network((int(address), prefix), strict=False)


def _classful_prefix(address: int) -> int:
    """The mask QEMU 7.2 assumes for ``net=ADDR`` without one (net/slirp.c)."""
    if not address & 0x80000000:
        return 8
    if address & 0xFFF00000 == 0xAC100000:
        return 12
    if address & 0xC0000000 == 0x80000000:
        return 16
    if address & 0xFFFF0000 == 0xC0A80000:
        return 16
    if address & 0xFFFF0000 == 0xC6120000:
        return 15
    if address & 0xE0000000 == 0xE0000000:
        return 24
    return 28


def _host_part(network: ipaddress.IPv4Network, offset: int) -> ipaddress.IPv4Address:
    """``net | (offset & ~mask)``: how libslirp places its host, DNS and default addresses."""
    host_bits = offset & ~int(network.netmask) & 0xFFFFFFFF
    return ipaddress.IPv4Address(int(network.network_address) | host_bits)


def _guest_forward(value: str, rule: str, network: ipaddress.IPv4Network) -> GuestForwardSpec:
    """One ``guestfwd`` rule, checked as QEMU's slirp_guestfwd and libslirp's add_exec do."""
    syntax = CommandLineError(f"Invalid guest forwarding rule '{rule}'")
    protocol, sep, rest = rule.partition(":")
    if not sep or protocol not in ("tcp", ""):
        raise syntax
    address_text, sep, rest = rest.partition(":")
    if not sep:
        raise syntax
    address = _inet_aton(address_text) if address_text else None
    if address_text and address is None:
        raise syntax
    port_text, sep, target = rest.partition("-")
    if not sep or not _STRTOL_PORT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
        raise syntax
    port = int(port_text)
    if not target.startswith("cmd:"):
        if target.startswith(_CHARDEV_SHORTHANDS) or target.startswith("chardev:"):
            raise CommandLineError("fakeqemu forwards guest connections only to 'cmd:' commands")
        raise CommandLineError(
            f"'{target}' is not a valid char driver\n"
            f"{program_name()}: -netdev {value}: "
            f"Could not open guest forwarding device 'guestfwd.tcp.{port}'"
        )
    # libslirp's slirp_add_exec: an empty address is the network's .4; the address
    # must be inside the network and be neither the host's (.2) nor the DNS's (.3).
    if address is None:
        address = _host_part(network, 0x0204)
    if address not in network or address in (
        _host_part(network, 0x0202),
        _host_part(network, 0x0203),
    ):
        raise CommandLineError(f"Conflicting/invalid host:port in guest forwarding rule '{rule}'")
    return GuestForwardSpec(str(address), port, target[len("cmd:") :])


def realize_nic(
    opts: list[tuple[str, str]],
    name: str,
    netdevs: dict[str, NetdevSpec],
    used: set[str],
) -> NicSpec:
    """Realize ``virtio-net-pci``: properties are set in command-line order, as QEMU does."""
    netdev: str | None = None
    mac: str | None = None
    for key, value in opts:
        if key == "netdev":
            if value not in netdevs:
                raise CommandLineError(
                    f"Property 'virtio-net-device.netdev' can't find value '{value}'"
                )
            if value in used:
                raise CommandLineError(
                    f"Property 'virtio-net-device.netdev' can't take value '{value}', it's in use"
                )
            netdev = value
        elif key == "mac":
            if not _MAC.fullmatch(value):
                raise CommandLineError(
                    f"Property 'virtio-net-device.mac' doesn't take value '{value}'"
                )
            mac = value.replace("-", ":").lower()
    if netdev is not None:
        used.add(netdev)
    return NicSpec(name, netdev, mac)
