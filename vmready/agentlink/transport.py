"""How a VM's agent reaches the guest API: the three transports, and which a VM gets.

``vsock`` where the host has ``/dev/vhost-vsock`` (``CONNECT 2:<port>``);
``forward``, a user-mode network with one forward from the guest's
``10.0.2.100:8443`` to the guest API, where it has not (``CONNECT
tcp:10.0.2.100:8443``); ``hvsock`` for fakeqemu guests, host processes on unix
sockets ``<path>_<port>``.  A VM keeps its transport (``volatile.guest.transport``)
until it restarts, so only an agent from this vmready's config drive is ever
sent the ``tcp:`` form.  docs/protocol.md ("The two forms of CONNECT") says why.
"""

from __future__ import annotations

import random
from collections.abc import Collection

from vmready.hypervisor import FORWARD_GUEST_ADDRESS, FORWARD_GUEST_PORT, device_problem
from vmready.protocols import format_connect, format_tcp_connect

__all__ = [
    "CID_KEY",
    "FORWARD_GUEST_NETWORK_ADDRESS",
    "HOST_CID",
    "TRANSPORTS",
    "TRANSPORT_KEY",
    "TransportError",
    "allocate_cid",
    "choose_transport",
    "connect_line",
    "forward_mac",
    "vhost_vsock_problem",
]

TRANSPORT_KEY = "volatile.guest.transport"
CID_KEY = "volatile.vsock.cid"
TRANSPORTS = ("vsock", "forward", "hvsock")
HOST_CID = 2
# The address the agent gives the forward's NIC (the forward itself is 10.0.2.100).
FORWARD_GUEST_NETWORK_ADDRESS = "10.0.2.15/24"
# CIDs 0-2 are reserved (hypervisor, local, host); 2**32 - 1 is VMADDR_CID_ANY.
_FIRST_CID = 3
_LAST_CID = 2**32 - 2


class TransportError(ValueError):
    """The requested transport cannot work with this hypervisor or host."""


def vhost_vsock_problem(device: str = "/dev/vhost-vsock") -> str | None:
    """Why VMs cannot get vhost-vsock here (the device does not open), or None."""
    return device_problem(device)


def choose_transport(hypervisor: str, requested: str, vhost_problem: str | None) -> str:
    """The transport new VMs get: ``requested``, or for ``auto`` the best this host has."""
    if requested not in ("auto", *TRANSPORTS):
        raise TransportError(
            f"unknown guest transport {requested!r}: expected auto, {', '.join(TRANSPORTS)}"
        )
    if hypervisor == "fakeqemu":
        if requested == "vsock":
            raise TransportError(
                "fakeqemu guests are host processes without a vsock device: use hvsock "
                "(the default) or forward"
            )
        return "hvsock" if requested == "auto" else requested
    if requested == "hvsock":
        raise TransportError("real QEMU has no hybrid vsock device: use vsock or forward")
    if requested == "vsock" and vhost_problem is not None:
        raise TransportError(f"the vsock transport needs vhost-vsock, and {vhost_problem}")
    if requested == "auto":
        return "forward" if vhost_problem is not None else "vsock"
    return requested


def connect_line(transport: str, port: int) -> bytes:
    """The CONNECT line a VM started with ``transport`` is sent (``port``: the vsock port)."""
    if transport == "forward":
        return format_tcp_connect(FORWARD_GUEST_ADDRESS, FORWARD_GUEST_PORT)
    return format_connect(HOST_CID, port)


def forward_mac(instance_uuid: str) -> str:
    """The forward NIC's MAC: QEMU's locally administered prefix and 24 bits of the uuid."""
    digits = instance_uuid.replace("-", "")[-6:].lower().rjust(6, "0")
    return "52:54:00:" + ":".join(digits[i : i + 2] for i in range(0, 6, 2))


def allocate_cid(used: Collection[int], rng: random.Random | None = None) -> int:
    """A vsock CID no other instance holds, drawn at random from the whole range."""
    chooser = rng or random.SystemRandom()
    while True:
        cid = chooser.randint(_FIRST_CID, _LAST_CID)
        if cid not in used:
            return cid
