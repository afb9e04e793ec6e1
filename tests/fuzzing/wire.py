"""Fuzz targets for the wire parsers (filled in as each parser is covered)."""

from __future__ import annotations

from tests.fuzzing.target import FuzzTarget

TARGETS: list[FuzzTarget] = []
