"""Tests for vmready.agentlink.monitor: ring-buffer reads and CONNECT writes on a Clock."""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from vmready.agentlink.link import AgentLink, PollIntervals, StatusChanged
from vmready.agentlink.monitor import AgentMonitor
from vmready.domain.model import HypervisorError
from vmready.protocols.ringbuffer import AgentStatus

INTERVALS = PollIntervals(connecting=0.05, started=0.25, connected=1.0, connect_timeout=10.0)
CONNECT = b"CONNECT 2:49152\n"


class FakeRing:
    """A VM's ring buffer: reads answer from a queue (or wait), writes are recorded."""

    def __init__(self) -> None:
        self.pending: list[bytes | Exception] = []
        self.reads = 0
        self.writes: list[tuple[str, bytes]] = []
        self.hold: Deferred[bytes] | None = None
        self.devices: list[str] = []

    async def ringbuf_read(self, device: str, size: int) -> bytes:
        self.reads += 1
        self.devices.append(device)
        if self.hold is not None:
            return await self.hold
        if not self.pending:
            return b""
        item = self.pending.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    async def ringbuf_write(self, device: str, data: bytes) -> None:
        self.writes.append((device, data))


class MonitorTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.ring = FakeRing()
        self.changes: list[StatusChanged] = []
        self.monitor = AgentMonitor(
            self.clock,
            self.ring,
            AgentLink("vm1", ring_size=4096, port=49152, intervals=INTERVALS),
            "vmready",
            self.changes.append,
        )

    def statuses(self) -> list[str]:
        return [change.current.value for change in self.changes]

    def test_adoptedVMIsToldTheNewPortAtOnceThenRead(self) -> None:
        self.monitor.start(advertise=True)
        self.assertEqual(self.ring.writes, [("vmready", CONNECT)])
        self.clock.advance(0)
        self.assertEqual(self.ring.reads, 1)
        self.assertEqual(self.ring.devices, ["vmready"])

    def test_launchedVMIsReadWithoutAdvertising(self) -> None:
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.assertEqual(self.ring.writes, [])
        self.assertEqual(self.ring.reads, 1)

    def test_startedLineIsAnsweredWithConnect(self) -> None:
        self.ring.pending.append(b"STARTED\n")
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.assertEqual(self.ring.writes, [("vmready", CONNECT)])
        self.assertEqual(self.statuses(), ["started"])
        self.assertEqual(self.monitor.status, AgentStatus.STARTED)

    def test_fastPollingWhileConnectOutstandingThenSlowOnceConnected(self) -> None:
        self.ring.pending.append(b"STARTED\n")
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        reads = self.ring.reads
        self.clock.advance(INTERVALS.connecting)
        self.assertEqual(self.ring.reads, reads + 1)
        self.ring.pending.append(b"CONNECT 2:49152\nCONNECTED\n")
        self.clock.advance(INTERVALS.connecting)
        self.assertEqual(self.statuses(), ["started", "connected"])
        reads = self.ring.reads
        self.clock.advance(INTERVALS.connected - 0.01)
        self.assertEqual(self.ring.reads, reads)
        self.clock.advance(0.01)
        self.assertEqual(self.ring.reads, reads + 1)

    def test_qmpEventReadsAtOnce(self) -> None:
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        reads = self.ring.reads
        self.monitor.qmp_event()
        self.clock.advance(0)
        self.assertEqual(self.ring.reads, reads + 1)

    def test_noReadsWhilePausedAndAtOnceWhenResumed(self) -> None:
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.monitor.paused()
        reads = self.ring.reads
        self.clock.advance(60)
        self.assertEqual(self.ring.reads, reads)
        self.monitor.resumed()
        self.clock.advance(0)
        self.assertEqual(self.ring.reads, reads + 1)

    def test_stopAnnouncesStoppedAndEndsPolling(self) -> None:
        self.ring.pending.append(b"CONNECTED\n")
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.monitor.stop()
        reads = self.ring.reads
        self.clock.advance(60)
        self.assertEqual(self.ring.reads, reads)
        self.assertEqual(self.statuses(), ["connected", "stopped"])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_daemonShutdownStopsWithoutAnnouncing(self) -> None:
        self.ring.pending.append(b"CONNECTED\n")
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.monitor.stop(announce=False)
        self.assertEqual(self.statuses(), ["connected"])

    def test_oneReadInFlightAtATime(self) -> None:
        self.ring.hold = Deferred()
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.monitor.qmp_event()
        self.clock.advance(10)
        self.assertEqual(self.ring.reads, 1)
        hold, self.ring.hold = self.ring.hold, None
        hold.callback(b"STARTED\n")
        self.assertEqual(self.statuses(), ["started"])
        self.clock.advance(INTERVALS.connecting)
        self.assertEqual(self.ring.reads, 2)

    def test_failedReadIsRetriedAtTheStartedPace(self) -> None:
        self.ring.pending.append(HypervisorError("QEMU monitor of VM vm1 did not answer"))
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.clock.advance(INTERVALS.started)
        self.assertEqual(self.ring.reads, 2)
        self.assertEqual(self.statuses(), [])

    def test_missingRingBufferStopsPolling(self) -> None:
        self.ring.pending.append(
            HypervisorError("QEMU refused ringbuf-read for vm1: Device 'vmready' not found")
        )
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.clock.advance(60)
        self.assertEqual(self.ring.reads, 1)

    def test_garbageOnTheSerialLineChangesNothing(self) -> None:
        self.ring.pending.append(b"\x00\xff garbage\nCONNECT x:y\n" + b"A" * 5000 + b"\n")
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.assertEqual(self.statuses(), [])
        self.assertEqual(self.ring.writes, [])
        self.ring.pending.append(b"STARTED\n")
        self.clock.advance(INTERVALS.started)
        self.assertEqual(self.statuses(), ["started"])

    def test_unansweredConnectFallsBackToTheStartedPace(self) -> None:
        self.ring.pending.append(b"STARTED\n")
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.clock.pump([INTERVALS.connecting] * int(INTERVALS.connect_timeout / 0.05 + 2))
        reads = self.ring.reads
        self.clock.advance(INTERVALS.connecting)
        self.assertEqual(self.ring.reads, reads)
        self.clock.advance(INTERVALS.started)
        self.assertEqual(self.ring.reads, reads + 1)
