"""Tests for vmready.agentlink.monitor: reads on events, CONNECT writes, on a Clock.

The timing rules of the event-driven link: no read without an event except
the safety read (and the follow-ups an event asks for), backoff for a VM with
no agent, and nothing lost when an event arrives while a read is under way.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from tests.agentlink.test_agentlink import INTERVALS
from vmready.agentlink.link import AgentLink, StatusChanged
from vmready.agentlink.monitor import AgentMonitor
from vmready.domain.model import HypervisorError
from vmready.protocols.ringbuffer import AgentStatus

PORT = "com.canonical.lxd"


def port_event(is_open: bool, port: str = PORT) -> dict[str, object]:
    """A ``VSERPORT_CHANGE`` event's data, in the key order QEMU sends."""
    return {"open": is_open, "id": port}


CONNECT = b"CONNECT 2:49152\n"


class FakeRing:
    """A VM's ring buffer: reads answer from a queue (or wait), writes are recorded."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.times: list[float] = []
        self.pending: list[bytes | Exception] = []
        self.idle = b""  # what a read finds when nothing is queued (heartbeats, say)
        self.reads = 0
        self.writes: list[tuple[str, bytes]] = []
        self.hold: Deferred[bytes] | None = None
        self.devices: list[str] = []

    async def ringbuf_read(self, device: str, size: int) -> bytes:
        self.reads += 1
        self.times.append(self.clock.seconds())
        self.devices.append(device)
        if self.hold is not None:
            return await self.hold
        if not self.pending:
            return self.idle
        item = self.pending.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    async def ringbuf_write(self, device: str, data: bytes) -> None:
        self.writes.append((device, data))


class MonitorTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.ring = FakeRing(self.clock)
        self.changes: list[StatusChanged] = []
        self.monitor = AgentMonitor(
            self.clock,
            self.ring,
            AgentLink("vm1", ring_size=4096, port=49152, intervals=INTERVALS),
            "vmready",
            self.changes.append,
            port_id=PORT,
        )

    def assertNoReadsFor(self, seconds: float) -> int:
        """``seconds`` pass without a ring-buffer read; the reads so far."""
        reads = self.ring.reads
        self.clock.advance(seconds)
        self.assertEqual(self.ring.reads, reads)
        return reads

    def statuses(self) -> list[str]:
        return [change.current.value for change in self.changes]

    def connect(self) -> None:
        """Start the monitor and bring its agent to CONNECTED the way a pulsing agent does."""
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.monitor.qmp_event("VSERPORT_CHANGE", port_event(True))
        self.ring.pending.append(b"STARTED\n")
        self.clock.advance(0)
        self.ring.pending.append(b"CONNECTED\n")
        self.monitor.qmp_event("VSERPORT_CHANGE", port_event(False))
        self.monitor.qmp_event("VSERPORT_CHANGE", port_event(True))
        self.clock.advance(0)
        self.clock.advance(0)
        self.assertEqual(self.statuses(), ["started", "connected"])
        self.assertEqual(self.clock.getDelayedCalls()[0].getTime() - self.clock.seconds(), 120.0)

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

    def test_noReadWithoutAnEventExceptTheSafetyRead(self) -> None:
        """An hour with a connected agent: a read on each event, else one per safety interval."""
        self.connect()
        start = len(self.ring.times)
        events = [61.5, 1000.25, 1000.75, 2500.0]
        self.ring.idle = b"CONNECTED\n"  # its heartbeats, written quietly
        for when in [*events, 3600.0]:
            # In quarter seconds: a Clock counts a call scheduled within advance() from its end.
            self.clock.pump([0.25] * round((when - self.clock.seconds()) * 4))
            if when in events:
                self.monitor.qmp_event("RTC_CHANGE", {"offset": 1})
                self.clock.advance(0)
        times = self.ring.times[start:]
        previous = 0.0
        for when in times:
            self.assertTrue(
                when in events or when - previous == INTERVALS.safety,
                f"a read at {when}s, {when - previous}s after the last, without an event",
            )
            previous = when
        self.assertEqual([when for when in times if when in events], events)
        self.assertEqual(len(times), len(events) + 3600 // 120 - 2)
        self.assertEqual(self.statuses(), ["started", "connected"])

    def test_theAgentPortEventsAreReadAtOnce(self) -> None:
        self.connect()
        reads = self.ring.reads
        self.ring.pending.append(b"STOPPED\n")
        self.monitor.qmp_event("VSERPORT_CHANGE", port_event(False))
        self.clock.advance(0)
        self.assertEqual(self.ring.reads, reads + 1)
        self.assertEqual(self.statuses(), ["started", "connected", "stopped"])

    def test_anotherPortsEventIsAReadOnly(self) -> None:
        """The unwired legacy port closing says nothing about the agent: one read, no grace."""
        self.connect()
        reads = self.ring.reads
        self.monitor.qmp_event("VSERPORT_CHANGE", port_event(False, "org.linuxcontainers.lxd"))
        self.clock.advance(0)
        self.assertEqual(self.ring.reads, reads + 1)
        self.ring.pending.append(b"CONNECTED\n")
        self.clock.advance(119)
        self.assertEqual(self.ring.reads, reads + 1)
        self.assertEqual(self.statuses(), ["started", "connected"])

    def test_aKilledAgentIsStoppedWhenTheGraceEnds(self) -> None:
        self.connect()
        self.monitor.qmp_event("VSERPORT_CHANGE", port_event(False))
        self.clock.advance(0)
        self.assertEqual(self.statuses(), ["started", "connected"])
        self.clock.advance(INTERVALS.reopen_grace - 0.01)
        self.assertEqual(self.statuses(), ["started", "connected"])
        self.clock.advance(0.01)
        self.assertEqual(self.statuses(), ["started", "connected", "stopped"])

    def test_anAgentThatOpensItsPortAndWritesLaterIsFollowedUp(self) -> None:
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.monitor.qmp_event("VSERPORT_CHANGE", port_event(True))
        self.clock.advance(0)
        reads = self.ring.reads
        self.ring.pending.extend([b"", b"STARTED\n"])
        self.clock.advance(0.05)
        self.clock.advance(0.1)
        self.assertEqual(self.ring.reads, reads + 2)
        self.assertEqual(self.statuses(), ["started"])
        self.assertEqual(self.ring.writes, [("vmready", CONNECT)])

    def test_connectIsFollowedUpUntilConnected(self) -> None:
        """An agent that writes CONNECTED without reopening (an older one) is still heard."""
        self.ring.pending.append(b"STARTED\n")
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.ring.pending.extend([b"", b"", b"CONNECTED\n"])
        self.clock.pump([0.05, 0.1, 0.2])
        self.assertEqual(self.statuses(), ["started", "connected"])
        reads = self.ring.reads
        self.clock.advance(119.9)
        self.assertEqual(self.ring.reads, reads)
        self.clock.advance(0.1)
        self.assertEqual(self.ring.reads, reads + 1)

    def test_agentlessVMsBackOffAndWakeOnTheFirstPortEvent(self) -> None:
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.clock.pump([1] * 1000)
        self.assertEqual(
            self.ring.times,
            [0, 1, 3, 7, 15, 31, 63, 127, 247, 367, 487, 607, 727, 847, 967],
        )
        reads = self.ring.reads
        self.monitor.qmp_event("VSERPORT_CHANGE", port_event(True))
        self.clock.advance(0)
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
        reads = self.assertNoReadsFor(600)
        self.monitor.resumed()
        self.clock.advance(0)
        self.assertEqual(self.ring.reads, reads + 1)

    def test_stopAnnouncesStoppedAndEndsReading(self) -> None:
        self.ring.pending.append(b"CONNECTED\n")
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.monitor.stop()
        self.assertNoReadsFor(600)
        self.assertEqual(self.statuses(), ["connected", "stopped"])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_daemonShutdownStopsWithoutAnnouncing(self) -> None:
        self.ring.pending.append(b"CONNECTED\n")
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.monitor.stop(announce=False)
        self.assertEqual(self.statuses(), ["connected"])

    def test_anEventDuringAReadIsNotLost(self) -> None:
        """STOPPED lands after the read took the ring: the close event reads once more."""
        self.connect()
        self.ring.hold = Deferred()
        self.monitor.qmp_event("RTC_CHANGE", {"offset": 1})
        self.clock.advance(0)
        reads = self.ring.reads
        self.monitor.qmp_event("VSERPORT_CHANGE", port_event(False))
        self.clock.advance(10)
        self.assertEqual(self.ring.reads, reads)  # one read in flight at a time
        hold, self.ring.hold = self.ring.hold, None
        self.ring.pending.append(b"STOPPED\n")
        hold.callback(b"")
        self.clock.advance(0)
        self.assertEqual(self.ring.reads, reads + 1)
        self.assertEqual(self.statuses(), ["started", "connected", "stopped"])

    def test_failedReadIsRetriedSlowly(self) -> None:
        self.ring.pending.append(HypervisorError("QEMU monitor of VM vm1 did not answer"))
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.assertEqual(self.ring.reads, 1)
        self.clock.advance(0.5)
        self.assertEqual(self.ring.reads, 1)
        self.clock.advance(0.5)
        self.assertEqual(self.ring.reads, 2)
        self.assertEqual(self.statuses(), [])

    def test_missingRingBufferStopsReading(self) -> None:
        self.ring.pending.append(
            HypervisorError("QEMU refused ringbuf-read for vm1: Device 'vmready' not found")
        )
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.monitor.qmp_event("VSERPORT_CHANGE", port_event(True))
        self.clock.advance(600)
        self.assertEqual(self.ring.reads, 1)

    def test_garbageOnTheSerialLineChangesNothing(self) -> None:
        self.ring.pending.append(b"\x00\xff garbage\nCONNECT x:y\n" + b"A" * 5000 + b"\n")
        self.monitor.start(advertise=False)
        self.clock.advance(0)
        self.assertEqual(self.statuses(), [])
        self.assertEqual(self.ring.writes, [])
        self.ring.pending.append(b"STARTED\n")
        self.monitor.qmp_event("VSERPORT_CHANGE", port_event(True))
        self.clock.advance(0)
        self.assertEqual(self.statuses(), ["started"])

    def test_malformedPortEventsAreOnlyAReason(self) -> None:
        """A VSERPORT_CHANGE without a boolean ``open`` changes no port state."""
        self.connect()
        for data in ({"id": PORT}, {"open": "false", "id": PORT}, {"open": 0, "id": PORT}):
            self.monitor.qmp_event("VSERPORT_CHANGE", data)
            self.clock.advance(0)
        self.assertIsNone(self.monitor.link._port_closed_at)
        self.assertEqual(self.statuses(), ["started", "connected"])
