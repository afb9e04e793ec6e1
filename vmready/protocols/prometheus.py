"""Prometheus' text exposition format (version 0.0.4), without I/O.

A scrape is a list of ``MetricFamily``: a name, a type, a help text and its
samples.  ``exposition`` writes them as Prometheus reads them::

    # HELP vmready_actions_total Actions that ended, by action and result.
    # TYPE vmready_actions_total counter
    vmready_actions_total{action="start",result="success"} 3

A histogram's samples are its cumulative ``_bucket{le="…"}`` counts (the last
one ``le="+Inf"``), its ``_sum`` and its ``_count`` (``histogram_samples``
builds them from per-bucket counts).  Label values are escaped (backslash,
double quote, newline), help texts too (backslash, newline).  A name or a
label name Prometheus would refuse is a programming error: ``ValueError``.

Written here rather than taken from ``prometheus_client``: the daemon needs
the format only, for a handful of metrics whose values it computes itself.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import attrs

__all__ = [
    "CONTENT_TYPE",
    "COUNTER",
    "GAUGE",
    "HISTOGRAM",
    "MetricFamily",
    "Sample",
    "escape_help",
    "escape_label_value",
    "exposition",
    "format_value",
    "histogram_samples",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"
_TYPES = frozenset({COUNTER, GAUGE, HISTOGRAM})
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Suffixes a histogram's samples carry; a counter's or a gauge's carry none.
_HISTOGRAM_SUFFIXES = frozenset({"_bucket", "_sum", "_count"})

Labels = tuple[tuple[str, str], ...]


@attrs.frozen
class Sample:
    """One line: the family's name plus ``suffix`` (``_bucket``…), its labels, its value."""

    suffix: str
    labels: Labels
    value: float


@attrs.frozen
class MetricFamily:
    """One metric: its name, type (counter, gauge, histogram), help text and samples."""

    name: str
    type: str
    help: str
    samples: tuple[Sample, ...]

    def __attrs_post_init__(self) -> None:
        if not _METRIC_NAME.fullmatch(self.name):
            raise ValueError(f"invalid metric name {self.name!r}")
        if self.type not in _TYPES:
            raise ValueError(f"invalid metric type {self.type!r} of {self.name}")
        allowed = _HISTOGRAM_SUFFIXES if self.type == HISTOGRAM else frozenset({""})
        for sample in self.samples:
            if sample.suffix not in allowed:
                raise ValueError(f"a {self.type} has no {self.name}{sample.suffix} sample")
            for label, _ in sample.labels:
                if not _LABEL_NAME.fullmatch(label) or label.startswith("__"):
                    raise ValueError(f"invalid label name {label!r} of {self.name}")


def escape_label_value(value: str) -> str:
    """A label value as it stands between double quotes."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    """A help text as it stands after ``# HELP name``."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample's value: integers without a point, ``+Inf``, ``-Inf``, ``NaN``, else repr."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{name}="{escape_label_value(value)}"' for name, value in labels)
    return "{" + inner + "}"


def exposition(families: Iterable[MetricFamily]) -> bytes:
    """The families as one text exposition, UTF-8, each line ending in a newline."""
    lines: list[str] = []
    for family in families:
        lines.append(f"# HELP {family.name} {escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for sample in family.samples:
            lines.append(
                f"{family.name}{sample.suffix}{_format_labels(sample.labels)} "
                f"{format_value(sample.value)}"
            )
    return "".join(line + "\n" for line in lines).encode("utf-8")


def histogram_samples(
    bounds: Sequence[float], counts: Sequence[int], total: float, labels: Labels = ()
) -> list[Sample]:
    """A histogram's samples from its per-bucket counts (not cumulative).

    ``counts`` has one entry per bound plus a last one for observations above
    every bound; the ``_bucket`` samples are cumulative, ``le`` added to
    ``labels`` and ``+Inf`` last, then ``_sum`` (``total``) and ``_count``.
    """
    if len(counts) != len(bounds) + 1:
        raise ValueError(f"{len(bounds)} bounds need {len(bounds) + 1} counts, not {len(counts)}")
    samples = []
    running = 0
    for bound, count in zip([*bounds, math.inf], counts, strict=True):
        running += count
        samples.append(Sample("_bucket", (*labels, ("le", format_value(bound))), running))
    samples.append(Sample("_sum", labels, total))
    samples.append(Sample("_count", labels, running))
    return samples
