"""vsock addresses: AF_VSOCK ``(cid, port)``, hybrid vsock ``(path, port)``, their checks."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.interfaces import IAddress
from zope.interface import implementer

AF_VSOCK: int = getattr(socket, "AF_VSOCK", 40)
VMADDR_CID_ANY: int = getattr(socket, "VMADDR_CID_ANY", 0xFFFFFFFF)
VMADDR_CID_LOCAL: int = getattr(socket, "VMADDR_CID_LOCAL", 1)
VMADDR_CID_HOST = 2
VMADDR_PORT_ANY: int = getattr(socket, "VMADDR_PORT_ANY", 0xFFFFFFFF)

U32_MAX = 2**32 - 1


@implementer(IAddress)
@attrs.frozen
class VSockAddress:
    """An AF_VSOCK address: a context id (the machine) and a port."""

    cid: int
    port: int


@implementer(IAddress)
@attrs.frozen
class HybridVSockAddress:
    """A hybrid vsock port: vsock port ``port`` of the device backed by ``path``."""

    path: str
    port: int

    @property
    def socket_path(self) -> str:
        """The unix socket the VMM connects to when the guest dials this port."""
        return f"{self.path}_{self.port}"


def u32(what: str) -> Callable[[object, attrs.Attribute[int], int], None]:
    """An attrs validator for a 32-bit unsigned vsock number, named ``what`` in errors."""

    def validate(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
        if not 0 <= value <= U32_MAX:
            raise ValueError(f"{what} must be from 0 to {U32_MAX}, got {value}")

    return validate


def positive(what: str) -> Callable[[object, attrs.Attribute[Any], float], None]:
    """An attrs validator for a number that must be above zero."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
        if not value > 0:
            raise ValueError(f"{what} must be greater than 0, got {value}")

    return validate
