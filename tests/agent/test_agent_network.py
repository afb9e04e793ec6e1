"""Tests for vmready.agent.network: the fallback transport's NIC, found by MAC and brought up.

The interfaces are a fake ``/sys/class/net`` in a temp dir and the ioctls a
fake kernel that records each call, so nothing here touches this machine's
network.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import shutil
import socket
import struct
import tempfile

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from vmready.agent.network import (
    IFF_UP,
    SIOCGIFADDR,
    SIOCGIFFLAGS,
    SIOCGIFNETMASK,
    SIOCSIFADDR,
    SIOCSIFFLAGS,
    SIOCSIFNETMASK,
    NetworkSetupError,
    bring_up,
    find_interface,
    parse_network,
)

MAC = "52:54:00:76:6d:01"
PLAN = parse_network(MAC, "10.0.2.15/24")
NAMES = {
    SIOCGIFADDR: "SIOCGIFADDR",
    SIOCGIFNETMASK: "SIOCGIFNETMASK",
    SIOCSIFADDR: "SIOCSIFADDR",
    SIOCSIFNETMASK: "SIOCSIFNETMASK",
    SIOCGIFFLAGS: "SIOCGIFFLAGS",
    SIOCSIFFLAGS: "SIOCSIFFLAGS",
}


def sockaddr(address: str) -> bytes:
    return struct.pack("=HH4s8x", socket.AF_INET, 0, ipaddress.IPv4Address(address).packed)


class FakeKernel:
    """The ioctls an interface answers: its address, netmask and flags; each call recorded."""

    def __init__(
        self, address: str | None = None, netmask: str = "255.255.255.0", flags: int = 0
    ) -> None:
        self.address = address
        self.netmask = netmask
        self.flags = flags
        self.calls: list[tuple[str, str]] = []
        self.refuse: int | None = None

    def ioctl(self, fd: int, request: int, buffer: bytes) -> bytes:
        name = buffer[:16].rstrip(b"\0").decode()
        self.calls.append((NAMES[request], name))
        if request == self.refuse:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        payload = buffer[16:]
        if request == SIOCGIFADDR:
            if self.address is None:
                raise OSError(errno.EADDRNOTAVAIL, os.strerror(errno.EADDRNOTAVAIL))
            return buffer[:16] + sockaddr(self.address).ljust(24, b"\0")
        if request == SIOCGIFNETMASK:
            return buffer[:16] + sockaddr(self.netmask).ljust(24, b"\0")
        if request == SIOCSIFADDR:
            self.address = str(ipaddress.IPv4Address(payload[4:8]))
        elif request == SIOCSIFNETMASK:
            self.netmask = str(ipaddress.IPv4Address(payload[4:8]))
        elif request == SIOCGIFFLAGS:
            return buffer[:16] + struct.pack("=h", self.flags).ljust(24, b"\0")
        elif request == SIOCSIFFLAGS:
            (self.flags,) = struct.unpack_from("=h", payload)
        return buffer


class NetworkTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.sysfs = tempfile.mkdtemp(prefix="vra-net-")
        self.addCleanup(shutil.rmtree, self.sysfs, True)
        self.interface("lo", "00:00:00:00:00:00")
        self.interface("enp0s3", MAC.upper())

    def interface(self, name: str, mac: str) -> None:
        os.makedirs(os.path.join(self.sysfs, name))
        with open(os.path.join(self.sysfs, name, "address"), "w") as f:
            f.write(mac + "\n")

    def test_interfaceIsFoundByItsMacWhateverTheCase(self) -> None:
        self.assertEqual(find_interface(MAC, self.sysfs), "enp0s3")

    def test_noInterfaceWithThatMacSaysWhereItLooked(self) -> None:
        error = self.assertRaises(
            NetworkSetupError, find_interface, "52:54:00:00:00:09", self.sysfs
        )
        self.assertEqual(
            str(error), f"no network interface has MAC 52:54:00:00:00:09 (looked in {self.sysfs})"
        )

    def test_aBareInterfaceGetsItsAddressAndIsSetUp(self) -> None:
        kernel = FakeKernel()
        self.assertEqual(bring_up(PLAN, self.sysfs, kernel.ioctl), "enp0s3")
        self.assertEqual(
            kernel.calls,
            [
                ("SIOCGIFADDR", "enp0s3"),
                ("SIOCSIFADDR", "enp0s3"),
                ("SIOCSIFNETMASK", "enp0s3"),
                ("SIOCGIFFLAGS", "enp0s3"),
                ("SIOCSIFFLAGS", "enp0s3"),
            ],
        )
        self.assertEqual(
            (kernel.address, kernel.netmask, kernel.flags & IFF_UP),
            ("10.0.2.15", "255.255.255.0", IFF_UP),
        )

    def test_anAddressInTheSubnetIsKept(self) -> None:
        kernel = FakeKernel(address="10.0.2.99", flags=IFF_UP)
        bring_up(PLAN, self.sysfs, kernel.ioctl)
        self.assertEqual(kernel.address, "10.0.2.99")
        self.assertNotIn(("SIOCSIFADDR", "enp0s3"), kernel.calls)
        self.assertNotIn(("SIOCSIFFLAGS", "enp0s3"), kernel.calls)

    def test_anAddressInAnotherSubnetIsReplaced(self) -> None:
        kernel = FakeKernel(address="192.168.1.5", flags=IFF_UP)
        bring_up(PLAN, self.sysfs, kernel.ioctl)
        self.assertEqual(kernel.address, "10.0.2.15")

    def test_aDownInterfaceWithItsAddressIsSetUp(self) -> None:
        kernel = FakeKernel(address="10.0.2.15", flags=0x1000)
        bring_up(PLAN, self.sysfs, kernel.ioctl)
        self.assertEqual(kernel.flags, 0x1000 | IFF_UP)

    def test_aRefusedIoctlIsAPreciseError(self) -> None:
        kernel = FakeKernel()
        kernel.refuse = SIOCSIFADDR
        error = self.assertRaises(NetworkSetupError, bring_up, PLAN, self.sysfs, kernel.ioctl)
        self.assertEqual(
            str(error),
            f"cannot configure the network interface enp0s3 ({MAC}): Operation not permitted",
        )

    def test_withoutTheInterfaceNoIoctlIsTried(self) -> None:
        kernel = FakeKernel()
        plan = parse_network("52:54:00:00:00:09", "10.0.2.15/24")
        self.assertRaises(NetworkSetupError, bring_up, plan, self.sysfs, kernel.ioctl)
        self.assertEqual(kernel.calls, [])

    def test_aMissingSysfsSaysSo(self) -> None:
        missing = os.path.join(self.sysfs, "nope")
        error = self.assertRaises(NetworkSetupError, find_interface, MAC, missing)
        self.assertEqual(
            str(error),
            f"cannot list network interfaces in {missing}: No such file or directory",
        )


class ParseNetworkTests(SynchronousTestCase):
    def test_macIsNormalisedToLowerCase(self) -> None:
        self.assertEqual(parse_network("52:54:00:76:6D:01", "10.0.2.15/24").mac, MAC)

    def test_describesItself(self) -> None:
        self.assertEqual(str(PLAN), f"10.0.2.15/24 on the NIC {MAC}")

    def test_refusals(self) -> None:
        for mac, address, message in [
            ("52-54-00-76-6d-01", "10.0.2.15/24", "is not a MAC address"),
            (MAC, "10.0.2.15", "has no prefix length"),
            (MAC, "10.0.2.300/24", "is not an IPv4 address/prefix"),
            (MAC, "10.0.2.15/33", "is not an IPv4 address/prefix"),
        ]:
            error = self.assertRaises(ValueError, parse_network, mac, address)
            self.assertIn(message, str(error))


class RealKernelTests(SynchronousTestCase):
    """The ioctl buffers as Linux really lays them out, read from the loopback interface."""

    def test_loopbackAlreadyHasItsAddressSoNothingChanges(self) -> None:
        if not os.path.exists("/sys/class/net/lo/address"):
            raise SkipTest("no loopback interface in /sys/class/net here")
        sysfs = tempfile.mkdtemp(prefix="vra-net-")
        self.addCleanup(shutil.rmtree, sysfs, True)
        os.makedirs(os.path.join(sysfs, "lo"))
        with open(os.path.join(sysfs, "lo", "address"), "w") as f:
            f.write("00:00:00:00:00:00\n")
        calls: list[int] = []

        def watched(fd: int, request: int, buffer: bytes) -> bytes:
            calls.append(request)
            result: bytes = fcntl.ioctl(fd, request, buffer)
            return result

        plan = parse_network("00:00:00:00:00:00", "127.0.0.1/8")
        self.assertEqual(bring_up(plan, sysfs, watched), "lo")
        # Read, found 127.0.0.1/8 already there and the link up: nothing was set.
        self.assertEqual(calls, [SIOCGIFADDR, SIOCGIFNETMASK, SIOCGIFFLAGS])
