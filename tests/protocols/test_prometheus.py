"""Tests for vmready.protocols.prometheus: the text exposition format, byte for byte."""

from __future__ import annotations

import math

from twisted.trial.unittest import SynchronousTestCase

from vmready.protocols.prometheus import (
    CONTENT_TYPE,
    COUNTER,
    GAUGE,
    HISTOGRAM,
    MetricFamily,
    Sample,
    escape_help,
    escape_label_value,
    exposition,
    format_value,
    histogram_samples,
)


class ExpositionTests(SynchronousTestCase):
    """Families written as Prometheus reads them."""

    def test_smallScrapeExactly(self) -> None:
        families = [
            MetricFamily(
                "vmready_instances",
                GAUGE,
                "Instances by status.",
                (
                    Sample("", (("status", "Ready"),), 2),
                    Sample("", (("status", "Stopped"),), 0),
                ),
            ),
            MetricFamily(
                "vmready_actions_total",
                COUNTER,
                "Actions that ended.",
                (Sample("", (("action", "start"), ("result", "success")), 3),),
            ),
            MetricFamily(
                "vmready_ready_latency_seconds",
                HISTOGRAM,
                "Time to Ready.",
                tuple(histogram_samples((1.0, 2.5), [1, 0, 2], 31.5)),
            ),
        ]
        self.assertEqual(
            exposition(families).decode("utf-8"),
            "# HELP vmready_instances Instances by status.\n"
            "# TYPE vmready_instances gauge\n"
            'vmready_instances{status="Ready"} 2\n'
            'vmready_instances{status="Stopped"} 0\n'
            "# HELP vmready_actions_total Actions that ended.\n"
            "# TYPE vmready_actions_total counter\n"
            'vmready_actions_total{action="start",result="success"} 3\n'
            "# HELP vmready_ready_latency_seconds Time to Ready.\n"
            "# TYPE vmready_ready_latency_seconds histogram\n"
            'vmready_ready_latency_seconds_bucket{le="1"} 1\n'
            'vmready_ready_latency_seconds_bucket{le="2.5"} 1\n'
            'vmready_ready_latency_seconds_bucket{le="+Inf"} 3\n'
            "vmready_ready_latency_seconds_sum 31.5\n"
            "vmready_ready_latency_seconds_count 3\n",
        )

    def test_familyWithoutSamplesStillSaysWhatItIs(self) -> None:
        family = MetricFamily("vmready_guest_api_requests_total", COUNTER, "Requests.", ())
        self.assertEqual(
            exposition([family]),
            b"# HELP vmready_guest_api_requests_total Requests.\n"
            b"# TYPE vmready_guest_api_requests_total counter\n",
        )

    def test_nothingIsAnEmptyBody(self) -> None:
        self.assertEqual(exposition([]), b"")

    def test_labelValuesAreEscapedAndUTF8(self) -> None:
        family = MetricFamily("m", GAUGE, "h", (Sample("", (("name", 'a"b\\c\nd é'),), 1),))
        self.assertEqual(
            exposition([family]).splitlines()[-1],
            'm{name="a\\"b\\\\c\\nd é"} 1'.encode(),
        )

    def test_helpIsEscapedButKeepsItsQuotes(self) -> None:
        self.assertEqual(escape_help('say "hi"\\\nnow'), 'say "hi"\\\\\\nnow')
        family = MetricFamily("m", GAUGE, "two\nlines", ())
        self.assertEqual(exposition([family]).splitlines()[0], b"# HELP m two\\nlines")

    def test_escapeLabelValue(self) -> None:
        self.assertEqual(escape_label_value('\\"\n'), '\\\\\\"\\n')
        self.assertEqual(escape_label_value("plain"), "plain")

    def test_contentTypeIsVersion004(self) -> None:
        self.assertEqual(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")


class ValueTests(SynchronousTestCase):
    """Numbers as Prometheus parses them."""

    def test_integersHaveNoPoint(self) -> None:
        self.assertEqual([format_value(v) for v in (0, 3, 3.0, -2.0)], ["0", "3", "3", "-2"])

    def test_fractionsKeepEveryDigit(self) -> None:
        self.assertEqual(format_value(0.1), "0.1")
        self.assertEqual(format_value(1 / 3), repr(1 / 3))

    def test_infinitiesAndNaN(self) -> None:
        self.assertEqual(
            [format_value(v) for v in (math.inf, -math.inf, math.nan)], ["+Inf", "-Inf", "NaN"]
        )

    def test_hugeFloatsAreNotWrittenAsIntegers(self) -> None:
        self.assertEqual(format_value(1e300), "1e+300")


class HistogramSampleTests(SynchronousTestCase):
    """Per-bucket counts become cumulative buckets, ``+Inf`` last, then sum and count."""

    def test_bucketsAreCumulative(self) -> None:
        samples = histogram_samples((0.5, 1.0, 5.0), [2, 0, 3, 1], 12.0, (("action", "stop"),))
        buckets = [(s.labels, s.value) for s in samples if s.suffix == "_bucket"]
        self.assertEqual(
            buckets,
            [
                ((("action", "stop"), ("le", "0.5")), 2),
                ((("action", "stop"), ("le", "1")), 2),
                ((("action", "stop"), ("le", "5")), 5),
                ((("action", "stop"), ("le", "+Inf")), 6),
            ],
        )
        self.assertEqual(samples[-2], Sample("_sum", (("action", "stop"),), 12.0))
        self.assertEqual(samples[-1], Sample("_count", (("action", "stop"),), 6))

    def test_countsMustMatchTheBounds(self) -> None:
        with self.assertRaises(ValueError):
            histogram_samples((1.0, 2.0), [1, 2], 3.0)


class ValidationTests(SynchronousTestCase):
    """What Prometheus would refuse is refused when the family is made."""

    def test_invalidMetricName(self) -> None:
        with self.assertRaises(ValueError):
            MetricFamily("vmready-instances", GAUGE, "h", ())

    def test_invalidLabelName(self) -> None:
        for label in ("le-x", "__reserved", "1st"):
            with self.assertRaises(ValueError):
                MetricFamily("m", GAUGE, "h", (Sample("", ((label, "v"),), 1),))

    def test_unknownType(self) -> None:
        with self.assertRaises(ValueError):
            MetricFamily("m", "summary", "h", ())

    def test_onlyHistogramsHaveSuffixedSamples(self) -> None:
        with self.assertRaises(ValueError):
            MetricFamily("m", COUNTER, "h", (Sample("_bucket", (), 1),))
        with self.assertRaises(ValueError):
            MetricFamily("m", HISTOGRAM, "h", (Sample("", (), 1),))
