"""What the daemon counts and measures, for ``GET /1.0/metrics``, without I/O.

The lifecycle's parts tell ``LifecycleMetrics`` what happened as it happens —
an action ended (with its result and how long it took), a ``ringbuf-read``
was answered, a guest API request was answered, a VM booted, its workload
said Ready — and it keeps counters and histograms.  What *is* (instances by
status, agent links by state) is not kept here: ``families`` is handed the
current state at each scrape, so a gauge can never drift from the store.

Counters and histograms live as long as the daemon: they start from zero at
each daemon start (``vmready_start_time_seconds`` says when).  Every label
takes values from a fixed set (actions, results, HTTP methods and codes,
statuses), so a guest cannot grow the scrape without bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from vmready.agentlink import RingBufferDevice
from vmready.domain import ACTIONS, OperatorStatus
from vmready.protocols import AgentStatus
from vmready.protocols.prometheus import (
    COUNTER,
    GAUGE,
    HISTOGRAM,
    MetricFamily,
    Sample,
    histogram_samples,
)

# Seconds; an action's duration and a boot's time to Ready fall in the first bucket they fit.
ACTION_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
READY_LATENCY_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# The methods counted by name; any other is counted as "other".
GUEST_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class Counter:
    """A counter per combination of label values, each starting at zero when first counted."""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help
        self.labels = tuple(labels)
        self._values: dict[tuple[str, ...], float] = {}
        if not self.labels:
            self._values[()] = 0.0  # shown from the start, at zero

    def declare(self, *values: str) -> None:
        """Show these label values from now on, at zero until counted."""
        self.inc(*values, amount=0.0)

    def inc(self, *values: str, amount: float = 1.0) -> None:
        """Add ``amount`` (not negative: a counter only grows) for these label values."""
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, not {values}")
        if not amount >= 0:
            raise ValueError(f"{self.name} cannot grow by {amount}")
        self._values[values] = self._values.get(values, 0.0) + amount

    def value(self, *values: str) -> float:
        """The count for these label values (0 when never counted)."""
        return self._values.get(values, 0.0)

    def family(self) -> MetricFamily:
        """Its samples, sorted by label values."""
        return MetricFamily(
            self.name,
            COUNTER,
            self.help,
            tuple(
                Sample("", tuple(zip(self.labels, key, strict=True)), value)
                for key, value in sorted(self._values.items())
            ),
        )


class Histogram:
    """Observations counted in fixed buckets (upper bounds, in seconds), per label values."""

    def __init__(
        self, name: str, help: str, bounds: Sequence[float], labels: Sequence[str] = ()
    ) -> None:
        if list(bounds) != sorted(set(bounds)) or not all(map(math.isfinite, bounds)):
            raise ValueError(f"{name}: bucket bounds must be finite and increasing")
        self.name = name
        self.help = help
        self.bounds = tuple(bounds)
        self.labels = tuple(labels)
        # Per label values: the count in each bucket (the last: above every bound), the sum.
        self._counts: dict[tuple[str, ...], list[int]] = {}
        self._sums: dict[tuple[str, ...], float] = {}
        if not self.labels:
            # Shown from the start, empty.
            self._counts[()] = [0] * (len(self.bounds) + 1)
            self._sums[()] = 0.0

    def observe(self, value: float, *values: str) -> None:
        """Count one observation (a duration: negative ones count as zero)."""
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, not {values}")
        value = max(0.0, value)
        counts = self._counts.setdefault(values, [0] * (len(self.bounds) + 1))
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), -1)
        counts[index] += 1
        self._sums[values] = self._sums.get(values, 0.0) + value

    def count(self, *values: str) -> int:
        """How many observations these label values have."""
        return sum(self._counts.get(values, ()))

    def total(self, *values: str) -> float:
        """The sum of their observations."""
        return self._sums.get(values, 0.0)

    def family(self) -> MetricFamily:
        """Cumulative buckets, sum and count for each label values, sorted."""
        samples: list[Sample] = []
        for key, counts in sorted(self._counts.items()):
            labels = tuple(zip(self.labels, key, strict=True))
            samples.extend(histogram_samples(self.bounds, counts, self._sums[key], labels))
        return MetricFamily(self.name, HISTOGRAM, self.help, tuple(samples))


class LifecycleMetrics:
    """The daemon's counters and histograms, and the gauges computed at each scrape."""

    def __init__(self, started_at: float) -> None:
        self.started_at = started_at
        self.actions = Counter(
            "vmready_actions_total",
            "Actions that ended since the daemon started, by action and result "
            "(success or error, as in the action history).",
            ("action", "result"),
        )
        self.action_durations = Histogram(
            "vmready_action_duration_seconds",
            "How long actions took, from their claim to their end, by action.",
            ACTION_DURATION_BUCKETS,
            ("action",),
        )
        self.ring_reads = Counter(
            "vmready_qmp_ring_reads_total",
            "ringbuf-read QMP commands issued to read agents' ring buffers, by result "
            "(ok, or error when QEMU refused or the monitor failed).",
            ("result",),
        )
        self.ring_read_bytes = Counter(
            "vmready_qmp_ring_read_bytes_total",
            "Bytes drained from agents' ring buffers by ringbuf-read.",
        )
        self.guest_requests = Counter(
            "vmready_guest_api_requests_total",
            "Guest API requests answered, by method and HTTP status code "
            "(connections refused at the TLS handshake are not requests).",
            ("method", "code"),
        )
        self.ready_latency = Histogram(
            "vmready_ready_latency_seconds",
            "From the start of a VM's QEMU process (or the guest's reset) to its workload's "
            "first Ready of that boot.",
            READY_LATENCY_BUCKETS,
        )
        for action in ACTIONS:
            for result in ("success", "error"):
                self.actions.declare(action, result)
        for result in ("ok", "error"):
            self.ring_reads.declare(result)
        # When each running VM's current boot began (until its workload says Ready).
        self._boots: dict[str, float] = {}

    # -- what happened ------------------------------------------------------

    def action_ended(self, action: str, result: str, seconds: float) -> None:
        """An action ended (``success`` or ``error``) after ``seconds``."""
        self.actions.inc(action, result)
        self.action_durations.observe(seconds, action)

    def ring_read(self, ok: bool, size: int = 0) -> None:
        """A ``ringbuf-read`` was answered (``size`` bytes) or failed."""
        self.ring_reads.inc("ok" if ok else "error")
        if size:
            self.ring_read_bytes.inc(amount=size)

    def guest_request(self, method: str, code: int) -> None:
        """A guest API request was answered with ``code``."""
        self.guest_requests.inc(method if method in GUEST_METHODS else "other", str(code))

    def boot_started(self, name: str, when: float) -> None:
        """The instance's VM began a boot at ``when`` (its QEMU started, or the guest reset)."""
        self._boots[name] = when

    def boot_ended(self, name: str) -> None:
        """The instance's VM is no longer followed: a Ready now would belong to no boot."""
        self._boots.pop(name, None)

    def ready(self, name: str, when: float) -> None:
        """The instance's workload said Ready: the first time in its boot is observed."""
        started = self._boots.pop(name, None)
        if started is not None:
            self.ready_latency.observe(when - started)

    # -- the scrape -----------------------------------------------------------

    def families(
        self, statuses: Iterable[str], agent_links: Iterable[AgentStatus]
    ) -> list[MetricFamily]:
        """Every metric, given each instance's status and each followed agent link's state."""
        by_status = dict.fromkeys((status.value for status in OperatorStatus), 0)
        for status in statuses:
            by_status[status] = by_status.get(status, 0) + 1
        by_link = {state.value: 0 for state in AgentStatus}
        for link in agent_links:
            by_link[link.value] += 1
        return [
            MetricFamily(
                "vmready_start_time_seconds",
                GAUGE,
                "When the daemon started (Unix time): counters count from then.",
                (Sample("", (), self.started_at),),
            ),
            _gauge(
                "vmready_instances",
                "Instances by status (READY, RUNNING, STOPPED, ERROR, STOPPING…).",
                "status",
                by_status,
            ),
            _gauge(
                "vmready_agent_links",
                "Agent links of running VMs, by what the agent last said.",
                "state",
                by_link,
            ),
            self.actions.family(),
            self.action_durations.family(),
            self.ring_reads.family(),
            self.ring_read_bytes.family(),
            self.guest_requests.family(),
            self.ready_latency.family(),
        ]


def _gauge(name: str, help: str, label: str, values: dict[str, int]) -> MetricFamily:
    return MetricFamily(
        name,
        GAUGE,
        help,
        tuple(Sample("", ((label, key),), value) for key, value in values.items()),
    )


class CountedRingDevice:
    """A VM's ring buffer as the agent monitor reads it, each ``ringbuf-read`` counted."""

    def __init__(self, vm: RingBufferDevice, metrics: LifecycleMetrics) -> None:
        self.vm = vm
        self.metrics = metrics

    async def ringbuf_read(self, device: str, size: int) -> bytes:
        """Drain up to ``size`` bytes, counting the read whichever way it ends."""
        try:
            chunk = await self.vm.ringbuf_read(device, size)
        except BaseException:
            self.metrics.ring_read(False)
            raise
        self.metrics.ring_read(True, len(chunk))
        return chunk

    async def ringbuf_write(self, device: str, data: bytes) -> None:
        """Append ``data`` (not a read: not counted)."""
        await self.vm.ringbuf_write(device, data)
