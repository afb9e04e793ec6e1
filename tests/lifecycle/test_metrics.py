"""Tests for vmready.lifecycle.metrics: the counters alone, then a real lifecycle counting."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from tests.lifecycle.test_lifecycle import _async, _until
from tests.lifecycle.test_ready import AgentLinkTestCase
from tests.reactor import reactor
from vmready.domain.model import HypervisorError
from vmready.domain.states import ACTIONS, OperatorStatus
from vmready.lifecycle.booting import Booting
from vmready.lifecycle.metrics import (
    ACTION_DURATION_BUCKETS,
    READY_LATENCY_BUCKETS,
    CountedRingDevice,
    Counter,
    Histogram,
    LifecycleMetrics,
)
from vmready.protocols.prometheus import MetricFamily, exposition
from vmready.protocols.ringbuffer import AgentStatus


def _samples(family: MetricFamily) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.suffix, sample.labels): sample.value for sample in family.samples}


def _family(families: list[MetricFamily], name: str) -> MetricFamily:
    (found,) = [family for family in families if family.name == name]
    return found


class CounterTests(SynchronousTestCase):
    def test_countsPerLabelValues(self) -> None:
        counter = Counter("c_total", "h", ("method", "code"))
        counter.inc("GET", "200")
        counter.inc("GET", "200")
        counter.inc("PATCH", "400", amount=3)
        self.assertEqual(counter.value("GET", "200"), 2)
        self.assertEqual(counter.value("PATCH", "400"), 3)
        self.assertEqual(counter.value("GET", "404"), 0)
        self.assertEqual(
            exposition([counter.family()]).decode().splitlines()[2:],
            ['c_total{method="GET",code="200"} 2', 'c_total{method="PATCH",code="400"} 3'],
        )

    def test_unlabelledCounterIsShownAtZero(self) -> None:
        self.assertEqual(_samples(Counter("c_total", "h").family()), {("", ()): 0})

    def test_declaredValuesAreShownAtZero(self) -> None:
        counter = Counter("c_total", "h", ("result",))
        counter.declare("ok")
        self.assertEqual(_samples(counter.family()), {("", (("result", "ok"),)): 0})

    def test_aCounterNeverShrinks(self) -> None:
        counter = Counter("c_total", "h")
        for amount in (-1.0, float("nan")):
            with self.assertRaises(ValueError):
                counter.inc(amount=amount)

    def test_labelValuesMustMatchTheLabels(self) -> None:
        with self.assertRaises(ValueError):
            Counter("c_total", "h", ("a", "b")).inc("only-one")


class HistogramTests(SynchronousTestCase):
    def test_aValueOnABoundIsInThatBucket(self) -> None:
        histogram = Histogram("h_seconds", "h", (1.0, 2.0))
        for value in (0.5, 1.0, 1.5, 2.0, 7.0):
            histogram.observe(value)
        samples = _samples(histogram.family())
        self.assertEqual(samples[("_bucket", (("le", "1"),))], 2)
        self.assertEqual(samples[("_bucket", (("le", "2"),))], 4)
        self.assertEqual(samples[("_bucket", (("le", "+Inf"),))], 5)
        self.assertEqual(samples[("_sum", ())], 12.0)
        self.assertEqual(samples[("_count", ())], 5)

    def test_unlabelledHistogramIsShownEmpty(self) -> None:
        samples = _samples(Histogram("h_seconds", "h", (1.0,)).family())
        self.assertEqual(
            samples,
            {
                ("_bucket", (("le", "1"),)): 0,
                ("_bucket", (("le", "+Inf"),)): 0,
                ("_sum", ()): 0,
                ("_count", ()): 0,
            },
        )

    def test_labelledHistogramShowsWhatWasObserved(self) -> None:
        histogram = Histogram("h_seconds", "h", (1.0,), ("action",))
        self.assertEqual(histogram.family().samples, ())
        histogram.observe(3.0, "stop")
        self.assertEqual(histogram.count("stop"), 1)
        self.assertEqual(histogram.total("stop"), 3.0)
        self.assertEqual(histogram.count("start"), 0)

    def test_aNegativeDurationCountsAsZero(self) -> None:
        histogram = Histogram("h_seconds", "h", (1.0,))
        histogram.observe(-4.0)
        self.assertEqual(_samples(histogram.family())[("_bucket", (("le", "1"),))], 1)
        self.assertEqual(histogram.total(), 0.0)

    def test_boundsMustIncrease(self) -> None:
        for bounds in ((2.0, 1.0), (1.0, 1.0), (1.0, float("inf"))):
            with self.assertRaises(ValueError):
                Histogram("h_seconds", "h", bounds)

    def test_theDaemonsBucketsAreValid(self) -> None:
        Histogram("a_seconds", "h", ACTION_DURATION_BUCKETS)
        Histogram("r_seconds", "h", READY_LATENCY_BUCKETS)


class LifecycleMetricsTests(SynchronousTestCase):
    """What happened, counted; what is, from the state handed to each scrape."""

    def setUp(self) -> None:
        self.metrics = LifecycleMetrics(1000.0)

    def scrape(self, statuses: list[str] = [], links: list[AgentStatus] = []) -> Any:  # noqa: B006
        return self.metrics.families(statuses, links)

    def test_everyStatusIsShownZeroIncluded(self) -> None:
        instances = _samples(
            _family(self.scrape(["READY", "READY", "ERROR"]), "vmready_instances")
        )
        expected = {("", (("status", name),)): 0 for name in map(str, OperatorStatus)}
        expected[("", (("status", "READY"),))] = 2
        expected[("", (("status", "ERROR"),))] = 1
        self.assertEqual(instances, expected)

    def test_everyAgentLinkStateIsShown(self) -> None:
        links = _samples(
            _family(
                self.scrape(links=[AgentStatus.CONNECTED, AgentStatus.UNKNOWN]),
                "vmready_agent_links",
            )
        )
        self.assertEqual(
            links,
            {
                ("", (("state", "unknown"),)): 1,
                ("", (("state", "started"),)): 0,
                ("", (("state", "connected"),)): 1,
                ("", (("state", "stopped"),)): 0,
            },
        )

    def test_everyActionAndResultIsShownFromTheStart(self) -> None:
        actions = _samples(_family(self.scrape(), "vmready_actions_total"))
        self.assertEqual(len(actions), 2 * len(ACTIONS))
        self.assertEqual(set(actions.values()), {0})

    def test_actionEndedIsCountedAndTimed(self) -> None:
        self.metrics.action_ended("stop", "error", 0.7)
        self.metrics.action_ended("stop", "success", 4.0)
        self.assertEqual(self.metrics.actions.value("stop", "error"), 1)
        self.assertEqual(self.metrics.actions.value("stop", "success"), 1)
        durations = _samples(_family(self.scrape(), "vmready_action_duration_seconds"))
        self.assertEqual(durations[("_bucket", (("action", "stop"), ("le", "1")))], 1)
        self.assertEqual(durations[("_bucket", (("action", "stop"), ("le", "5")))], 2)
        self.assertEqual(durations[("_sum", (("action", "stop"),))], 4.7)

    def test_readyLatencyIsFromTheBootToItsFirstReady(self) -> None:
        self.metrics.boot_started("web1", 10.0)
        self.metrics.ready("web1", 13.5)
        self.metrics.ready("web1", 20.0)  # the same boot: already observed
        self.assertEqual(self.metrics.ready_latency.count(), 1)
        self.assertEqual(self.metrics.ready_latency.total(), 3.5)
        self.metrics.boot_started("web1", 30.0)  # rebooted
        self.metrics.ready("web1", 31.0)
        self.assertEqual(self.metrics.ready_latency.count(), 2)

    def test_readyWithoutAKnownBootIsNotObserved(self) -> None:
        self.metrics.ready("adopted", 5.0)  # a VM the daemon found running
        self.metrics.boot_started("web1", 1.0)
        self.metrics.boot_ended("web1")  # stopped before its workload said Ready
        self.metrics.ready("web1", 9.0)
        self.assertEqual(self.metrics.ready_latency.count(), 0)

    def test_guestRequestsByMethodAndCode(self) -> None:
        self.metrics.guest_request("PATCH", 200)
        self.metrics.guest_request("BREW", 405)  # a guest cannot invent label values
        self.assertEqual(self.metrics.guest_requests.value("PATCH", "200"), 1)
        self.assertEqual(self.metrics.guest_requests.value("other", "405"), 1)

    def test_startTimeIsShown(self) -> None:
        start = _family(self.scrape(), "vmready_start_time_seconds")
        self.assertEqual(_samples(start), {("", ()): 1000.0})

    def test_theWholeScrapeIsValidText(self) -> None:
        self.metrics.ring_read(True, 18)
        text = exposition(self.scrape(["Ready"], [AgentStatus.CONNECTED])).decode()
        self.assertIn('vmready_qmp_ring_reads_total{result="ok"} 1\n', text)
        self.assertIn("vmready_qmp_ring_read_bytes_total 18\n", text)
        self.assertIn('vmready_ready_latency_seconds_bucket{le="+Inf"} 0\n', text)


class _Ring:
    """A ring buffer in memory: what the guest wrote, drained by reads; or a refusing one."""

    def __init__(self, contents: bytes = b"", refuse: bool = False) -> None:
        self.contents = contents
        self.refuse = refuse
        self.written = b""

    async def ringbuf_read(self, device: str, size: int) -> bytes:
        if self.refuse:
            raise HypervisorError(f"Device '{device}' not found")
        chunk, self.contents = self.contents[:size], self.contents[size:]
        return chunk

    async def ringbuf_write(self, device: str, data: bytes) -> None:
        self.written += data


class CountedRingDeviceTests(SynchronousTestCase):
    def test_readsAndTheirBytesAreCounted(self) -> None:
        metrics = LifecycleMetrics(0.0)
        ring = CountedRingDevice(_Ring(b"STARTED\n"), metrics)

        def read(size: int) -> bytes:
            return self.successResultOf(Deferred.fromCoroutine(ring.ringbuf_read("r", size)))

        self.assertEqual([read(4), read(64), read(64)], [b"STAR", b"TED\n", b""])
        self.assertEqual(metrics.ring_reads.value("ok"), 3)
        self.assertEqual(metrics.ring_read_bytes.value(), 8)

    def test_aFailedReadIsCountedAndStillFails(self) -> None:
        metrics = LifecycleMetrics(0.0)
        ring = CountedRingDevice(_Ring(refuse=True), metrics)
        failure = self.failureResultOf(Deferred.fromCoroutine(ring.ringbuf_read("r", 4)))
        failure.trap(HypervisorError)
        self.assertEqual(metrics.ring_reads.value("error"), 1)
        self.assertEqual(metrics.ring_reads.value("ok"), 0)

    def test_writesPassThroughUncounted(self) -> None:
        metrics = LifecycleMetrics(0.0)
        inner = _Ring()
        ring = CountedRingDevice(inner, metrics)
        self.successResultOf(Deferred.fromCoroutine(ring.ringbuf_write("r", b"CONNECT 2:1\n")))
        self.assertEqual(inner.written, b"CONNECT 2:1\n")
        self.assertEqual(metrics.ring_reads.value("ok"), 0)


class LifecycleCountingTests(AgentLinkTestCase):
    """A real lifecycle over fakeqemu tells its metrics what happened."""

    @property
    def metrics(self) -> LifecycleMetrics:
        return self.lifecycle.metrics

    @_async
    async def test_actionsAreCountedWithTheirResult(self) -> None:
        await self.launch()
        await self.wait(await self.lifecycle.act("vm1", "stop", force=True))

        async def refused(*args: object, **kwargs: object) -> None:
            raise HypervisorError("QEMU refused to start")

        self.patch(Booting, "launch", refused)
        operation = await self.wait(await self.lifecycle.act("vm1", "start"))
        self.assertEqual(operation.error, "QEMU refused to start")
        self.assertEqual(self.metrics.actions.value("create", "success"), 1)
        self.assertEqual(self.metrics.actions.value("stop", "success"), 1)
        self.assertEqual(self.metrics.actions.value("start", "error"), 1)
        self.assertEqual(self.metrics.actions.value("start", "success"), 0)
        for action in ("create", "stop", "start"):
            self.assertEqual(self.metrics.action_durations.count(action), 1)

    @_async
    async def test_deleteIsCountedOnce(self) -> None:
        await self.launch()
        await self.wait(await self.lifecycle.act("vm1", "delete"))
        self.assertEqual(self.metrics.actions.value("delete", "success"), 1)
        self.assertEqual(self.metrics.action_durations.count("delete"), 1)

    @_async
    async def test_ringReadsAndTheirBytesAreCounted(self) -> None:
        await self.launch()
        await self.connected_guest()
        monitor = self.lifecycle.running.monitors["vm1"]
        self.assertGreaterEqual(self.metrics.ring_reads.value("ok"), monitor.reads)
        self.assertGreater(monitor.reads, 0)
        # Everything the agent said, drained: "STARTED\n" and "CONNECTED\n".
        self.assertEqual(self.metrics.ring_read_bytes.value(), len(b"STARTED\nCONNECTED\n"))
        links = _samples(_family(self.lifecycle.metric_families(), "vmready_agent_links"))
        self.assertEqual(links[("", (("state", "connected"),))], 1)
        self.assertEqual(sum(links.values()), 1)

    @_async
    async def test_readyLatencyIsObservedOncePerBoot(self) -> None:
        before = reactor.seconds()
        await self.launch()
        await self.lifecycle.guestside.set_ready("vm1", True)
        self.assertEqual(self.metrics.ready_latency.count(), 1)
        self.assertLessEqual(self.metrics.ready_latency.total(), reactor.seconds() - before)
        await self.lifecycle.guestside.set_ready("vm1", False)
        await self.lifecycle.guestside.set_ready("vm1", True)
        self.assertEqual(self.metrics.ready_latency.count(), 1)
        await self.wait(await self.lifecycle.act("vm1", "restart", force=True))
        await self.lifecycle.guestside.set_ready("vm1", True)
        self.assertEqual(self.metrics.ready_latency.count(), 2)
        statuses = _samples(_family(self.lifecycle.metric_families(), "vmready_instances"))
        self.assertEqual(statuses[("", (("status", "READY"),))], 1)

    @_async
    async def test_aGuestRebootIsANewBoot(self) -> None:
        await self.launch()
        await self.lifecycle.guestside.set_ready("vm1", True)
        await self.guest_control(b"reboot\n")
        await _until(lambda: not self.lifecycle.store.view.get_instance("vm1").ready)
        await self.lifecycle.guestside.set_ready("vm1", True)
        self.assertEqual(self.metrics.ready_latency.count(), 2)

    @_async
    async def test_aVMFoundRunningAtDaemonStartHasNoReadyLatency(self) -> None:
        await self.launch()
        await self.lifecycle.shutdown()
        self.lifecycle = self.new_lifecycle()
        await self.lifecycle.recovery.recover()
        await _until(lambda: self.lifecycle.running.has_vm("vm1"))
        await self.lifecycle.guestside.set_ready("vm1", True)
        self.assertEqual(self.metrics.ready_latency.count(), 0)
