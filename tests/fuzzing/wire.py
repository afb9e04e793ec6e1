"""Fuzz targets for the wire parsers: ring-buffer lines, CONNECT, QMP, transcripts, endpoints.

Each concern has its module (``wire_ring``, ``wire_qmp``, ``wire_text``); the
inputs they share are in ``wire_mutations``.
"""

from __future__ import annotations

from tests.fuzzing import wire_qmp, wire_ring, wire_text
from tests.fuzzing.target import FuzzTarget

TARGETS: list[FuzzTarget] = [*wire_ring.TARGETS, *wire_qmp.TARGETS, *wire_text.TARGETS]
