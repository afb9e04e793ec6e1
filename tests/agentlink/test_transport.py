"""Tests for vmready.agentlink.transport: which transport a VM gets, and what its agent is told."""

from __future__ import annotations

import os
import random

from twisted.trial.unittest import SynchronousTestCase

from vmready.agentlink.transport import (
    TransportError,
    allocate_cid,
    choose_transport,
    connect_line,
    forward_mac,
    vhost_vsock_problem,
)

NO_DEVICE = "/dev/vhost-vsock cannot be opened: No such file or directory"
FIRST_CID = 3
LAST_CID = 2**32 - 2


class RealQemuTransportTests(SynchronousTestCase):
    """Real QEMU: vsock where vhost-vsock opens, else the forward; never hybrid vsock."""

    def test_autoIsVsockWhereTheDeviceOpens(self) -> None:
        self.assertEqual(choose_transport("qemu", "auto", None), "vsock")

    def test_autoIsTheForwardWithoutTheDevice(self) -> None:
        self.assertEqual(choose_transport("qemu", "auto", NO_DEVICE), "forward")

    def test_vsockWhereTheDeviceOpens(self) -> None:
        self.assertEqual(choose_transport("qemu", "vsock", None), "vsock")

    def test_vsockWithoutTheDeviceIsRefusedSayingWhy(self) -> None:
        with self.assertRaises(TransportError) as caught:
            choose_transport("qemu", "vsock", NO_DEVICE)
        self.assertEqual(
            str(caught.exception),
            "the vsock transport needs vhost-vsock, and /dev/vhost-vsock cannot be opened: "
            "No such file or directory",
        )

    def test_forwardIsGivenWithOrWithoutTheDevice(self) -> None:
        self.assertEqual(
            [choose_transport("qemu", "forward", problem) for problem in (None, NO_DEVICE)],
            ["forward", "forward"],
        )

    def test_hybridVsockIsRefused(self) -> None:
        with self.assertRaises(TransportError) as caught:
            choose_transport("qemu", "hvsock", None)
        self.assertEqual(
            str(caught.exception), "real QEMU has no hybrid vsock device: use vsock or forward"
        )


class FakeQemuTransportTests(SynchronousTestCase):
    """fakeqemu guests are host processes: hybrid vsock by default, the forward on request."""

    def test_autoIsHybridVsockWhateverTheDevice(self) -> None:
        self.assertEqual(
            [choose_transport("fakeqemu", "auto", problem) for problem in (None, NO_DEVICE)],
            ["hvsock", "hvsock"],
        )

    def test_hybridVsockOnRequest(self) -> None:
        self.assertEqual(choose_transport("fakeqemu", "hvsock", NO_DEVICE), "hvsock")

    def test_forwardOnRequest(self) -> None:
        self.assertEqual(choose_transport("fakeqemu", "forward", None), "forward")

    def test_vsockIsRefused(self) -> None:
        with self.assertRaises(TransportError) as caught:
            choose_transport("fakeqemu", "vsock", None)
        self.assertEqual(
            str(caught.exception),
            "fakeqemu guests are host processes without a vsock device: use hvsock "
            "(the default) or forward",
        )


class UnknownTransportTests(SynchronousTestCase):
    """A transport name that is not one of ours is refused, naming the choices."""

    def test_unknownTransportIsRefusedOnEitherHypervisor(self) -> None:
        for hypervisor in ("qemu", "fakeqemu"):
            with self.assertRaises(TransportError) as caught:
                choose_transport(hypervisor, "tcp", None)
            self.assertEqual(
                str(caught.exception),
                "unknown guest transport 'tcp': expected auto, vsock, forward, hvsock",
            )

    def test_transportErrorIsAValueError(self) -> None:
        self.assertTrue(issubclass(TransportError, ValueError))


class ConnectLineTests(SynchronousTestCase):
    """The CONNECT line each transport's agent is sent."""

    def test_vsockAgentDialsTheHostCID(self) -> None:
        self.assertEqual(connect_line("vsock", 4242), b"CONNECT 2:4242\n")

    def test_hybridVsockAgentDialsTheHostCID(self) -> None:
        self.assertEqual(connect_line("hvsock", 50123), b"CONNECT 2:50123\n")

    def test_forwardAgentDialsTheForwardedAddress(self) -> None:
        self.assertEqual(connect_line("forward", 4242), b"CONNECT tcp:10.0.2.100:8443\n")

    def test_forwardLineDoesNotDependOnTheVsockPort(self) -> None:
        self.assertEqual(connect_line("forward", 1), connect_line("forward", 65000))


class ForwardMacTests(SynchronousTestCase):
    """The forward NIC's MAC: QEMU's prefix and the instance uuid's last 24 bits."""

    UUID = "6f1c3a52-9d2e-4b7a-8c11-0123456789ab"

    def test_macIsWellFormed(self) -> None:
        self.assertRegex(forward_mac(self.UUID), r"\A52:54:00(:[0-9a-f]{2}){3}\Z")

    def test_macIsTheUuidsLastBytes(self) -> None:
        self.assertEqual(forward_mac(self.UUID), "52:54:00:67:89:ab")

    def test_macIsStable(self) -> None:
        self.assertEqual(forward_mac(self.UUID), forward_mac(self.UUID))

    def test_upperCaseUuidGivesTheSameMac(self) -> None:
        self.assertEqual(forward_mac(self.UUID.upper()), forward_mac(self.UUID))

    def test_instancesGetDifferentMacs(self) -> None:
        other = "6f1c3a52-9d2e-4b7a-8c11-0123456789ac"
        self.assertNotEqual(forward_mac(self.UUID), forward_mac(other))

    def test_macIsUnicastAndLocallyAdministered(self) -> None:
        first = int(forward_mac(self.UUID).split(":")[0], 16)
        self.assertEqual((first & 0x01, first & 0x02), (0, 0x02))


class AllocateCidTests(SynchronousTestCase):
    """A CID drawn at random, never one another instance holds or one that is reserved."""

    def draws(self, seed: int, count: int) -> list[int]:
        """What a Random seeded with ``seed`` draws from the CID range, in order."""
        rng = random.Random(seed)
        return [rng.randint(FIRST_CID, LAST_CID) for _ in range(count)]

    def test_cidIsDrawnFromTheUnreservedRange(self) -> None:
        self.assertEqual(allocate_cid(set(), random.Random(11)), self.draws(11, 1)[0])

    def test_cidIsNeverReservedOrVmaddrCidAny(self) -> None:
        rng = random.Random(12)
        cids = [allocate_cid(set(), rng) for _ in range(1000)]
        self.assertTrue(all(FIRST_CID <= cid <= LAST_CID for cid in cids))

    def test_usedCidsAreSkipped(self) -> None:
        draws = self.draws(13, 1000)
        self.assertEqual(len(set(draws)), 1000)
        used = set(draws[:-1])
        self.assertEqual(allocate_cid(used, random.Random(13)), draws[-1])

    def test_cidIsNotInUse(self) -> None:
        used = set(self.draws(14, 500))
        rng = random.Random(14)
        cids = [allocate_cid(used, rng) for _ in range(100)]
        self.assertEqual(used & set(cids), set())

    def test_usedMayBeAnyCollection(self) -> None:
        draws = self.draws(15, 3)
        self.assertEqual(allocate_cid(draws[:2], random.Random(15)), draws[2])

    def test_systemRandomByDefault(self) -> None:
        cid = allocate_cid({FIRST_CID})
        self.assertTrue(FIRST_CID < cid <= LAST_CID)


class VhostVsockProblemTests(SynchronousTestCase):
    """Why VMs cannot get vhost-vsock here: the device does not open."""

    def setUp(self) -> None:
        self.directory = self.mktemp()
        os.makedirs(self.directory)

    def test_deviceThatOpensIsNoProblem(self) -> None:
        device = os.path.join(self.directory, "vhost-vsock")
        with open(device, "wb"):
            pass
        self.assertIsNone(vhost_vsock_problem(device))

    def test_missingDeviceSaysSo(self) -> None:
        device = os.path.join(self.directory, "vhost-vsock")
        self.assertEqual(
            vhost_vsock_problem(device),
            f"{device} cannot be opened: No such file or directory",
        )

    def test_deviceThatCannotBeOpenedSaysWhy(self) -> None:
        self.assertEqual(
            vhost_vsock_problem(self.directory),
            f"{self.directory} cannot be opened: Is a directory",
        )

    def test_problemNamesTheHostDeviceByDefault(self) -> None:
        problem = vhost_vsock_problem()
        self.assertTrue(
            problem is None or problem.startswith("/dev/vhost-vsock cannot be opened: "), problem
        )
